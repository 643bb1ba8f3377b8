// The CPU implementation of qfp8::scaled_linear_cpu (schema in
// qfp8/library/cpu.py) and its out-variant _scaled_linear_cpu_into, which
// the tests use to check that every output is written.
//
// Per call, on plain tensors: cheap shape checks, the activations turned into
// a float32 [M][Kp] buffer (a copy of x, or x quantized to FP8 and held as
// the exact FP8 values, activations.cpp), then the tiles of 32 output
// channels are split over threads with at::parallel_for (or, where the ISA
// prepared the rows in parts, the parts: run_tiles). Each output is computed
// whole by one thread, its sums in an order that does not depend on how the
// work is split, so results do not depend on the number of threads. An ISA
// with a preparation step (avx512bf16, amx) prepares its own form of the
// activations once per call, from bf16: x as it is, or the quantized FP8
// values (exact in bf16) instead of the buffer.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include "bindings.h"
#include "kernel.h"

namespace qfp8 {

// A graph AOTInductor compiled hands an op an empty list argument (block_size
// = [] of a layer without block scales, the experts' input_scales = [] without
// static scales) as None through its proxy executor, which unboxing the
// argument asserts on. The graph holds an empty list, so that is what the
// kernels get.
void empty_lists_from_none(const c10::FunctionSchema& schema, torch::jit::Stack* stack) {
  const size_t count = schema.arguments().size();
  for (size_t i = 0; i < count; ++i) {
    c10::IValue& value = (*stack)[stack->size() - count + i];
    const c10::TypePtr& type = schema.arguments()[i].type();
    if (!value.isNone() || type->kind() != c10::TypeKind::ListType) continue;
    const c10::TypeKind element = type->containedType(0)->kind();
    if (element == c10::TypeKind::IntType) value = c10::IValue(c10::List<int64_t>());
    if (element == c10::TypeKind::TensorType) value = c10::IValue(c10::List<at::Tensor>());
  }
}

void parallel_ranges_fn(int64_t count, int64_t grain, RangeFn fn, void* context) {
  if (count <= 0) return;
  if (at::in_parallel_region() || at::get_num_threads() < 2 || count < 2 * grain) return fn(context, 0, count);
  at::parallel_for(0, count, grain, [&](int64_t begin, int64_t end) { fn(context, begin, end); });
}

int64_t call_threads() { return at::in_parallel_region() ? 1 : at::get_num_threads(); }

namespace {

constexpr const char* kOp = "qfp8::scaled_linear_cpu";

// What one call holds while its tiles run: the problem and the buffers it points into.
struct LinearCall {
  LinearProblem p{};
  at::ScalarType xdtype = at::kFloat;
  const float* input_scale = nullptr;  // the static activation scale, or null
  int scale_shift = 0;                 // see shift_large_weight_scales
  std::shared_ptr<const void> prepared;  // the ISA's form of the activations (freed last: it may read x_quantized)
  std::vector<float> bias_buffer, shifted_scale, row_scale, group_scale;
  ScratchBuffer<float> x_buffer;        // float32 activations [M][Kp]; every value is written
  ScratchBuffer<uint16_t> x_quantized;  // FP8 activations as bf16 [M][K]; every value is written
};

// Checks x (its last dimension only when `check_k`), the packed weight and
// its scale; fills the weight's side of the problem.
void check_weight(LinearCall& c, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& weight_scale,
                  int64_t N, int64_t K, at::IntArrayRef block_size, bool check_k = true) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu() && weight_scale.device().is_cpu(), kOp,
              ": all tensors must be on the CPU, got x on ", x.device(), ", packed_weight on ", packed.device(),
              ", weight_scale on ", weight_scale.device());
  TORCH_CHECK(!check_k || (x.dim() >= 1 && x.size(-1) == K), kOp, ": x has shape ", x.sizes(),
              " but in_features is ", K);
  c.xdtype = x.scalar_type();
  TORCH_CHECK(c.xdtype == at::kFloat || c.xdtype == at::kBFloat16 || c.xdtype == at::kHalf, kOp,
              ": x must be float32, bfloat16 or float16, got ", c.xdtype);
  LinearProblem& p = c.p;
  p.format = fp8_format(packed.scalar_type(), "qfp8::scaled_linear_cpu: packed_weight");
  const int64_t T = (N + kTileN - 1) / kTileN, Kp = (K + 1) & ~int64_t(1);
  TORCH_CHECK(N >= 1 && K >= 1 && packed.is_contiguous() && packed.numel() == T * (Kp / 2) * kGroupBytes, kOp,
              ": packed_weight has shape ", packed.sizes(), ", expected ", T * (Kp / 2) * kGroupBytes,
              " contiguous bytes for out_features=", N, ", in_features=", K, " (pack it with pack_weight_cpu)");
  TORCH_CHECK(weight_scale.scalar_type() == at::kFloat && weight_scale.is_contiguous(), kOp,
              ": weight_scale must be contiguous float32, got ", weight_scale.scalar_type());
  p.bn = p.bk = p.scale_cols = 1;
  if (!block_size.empty()) {
    TORCH_CHECK(block_size.size() == 2 && block_size[0] > 0 && block_size[1] > 0, kOp,
                ": block_size must be [bn, bk] or [], got ", block_size);
    p.bn = block_size[0];
    p.bk = block_size[1];
    const int64_t rows = (N + p.bn - 1) / p.bn, cols = (K + p.bk - 1) / p.bk;
    TORCH_CHECK(weight_scale.dim() == 2 && weight_scale.size(0) == rows && weight_scale.size(1) == cols, kOp,
                ": block weight_scale has shape ", weight_scale.sizes(), ", expected [", rows, ", ", cols,
                "] for out_features=", N, ", in_features=", K, ", block_size=", block_size);
    p.scale_kind = kScaleBlock;
    p.scale_cols = cols;
  } else if (weight_scale.numel() == 1) {
    p.scale_kind = kScaleTensor;
  } else {
    TORCH_CHECK(weight_scale.numel() == N, kOp, ": weight_scale has shape ", weight_scale.sizes(),
                ", expected [1] or [", N, ", 1] for out_features=", N);
    p.scale_kind = kScaleChannel;
  }
}

// Checks the output, the activation arguments and the bias (a bf16 or fp16
// bias is copied to float32).
void check_output_and_bias(LinearCall& c, const at::Tensor& out, int64_t M, int64_t N,
                           const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& input_scale,
                           Activation mode, at::ScalarType activation_dtype) {
  TORCH_CHECK(out.scalar_type() == c.xdtype && out.is_contiguous() && out.numel() == M * N, kOp, ": out has shape ",
              out.sizes(), " and dtype ", out.scalar_type(), ", expected ", M * N, " contiguous ", c.xdtype);
  if (mode == kStatic) {
    TORCH_CHECK(input_scale.has_value() && input_scale->numel() == 1 && input_scale->scalar_type() == at::kFloat,
                kOp, ": activation='static' needs a float32 input_scale of one element");
    c.input_scale = input_scale->data_ptr<float>();
    TORCH_CHECK_VALUE(std::isfinite(c.input_scale[0]) && c.input_scale[0] > 0.0f, kOp,
                      ": the static input_scale must be finite and > 0, got ", c.input_scale[0]);
  }
  if (mode != kNone) {
    TORCH_CHECK(activation_dtype == at::kFloat8_e4m3fn || activation_dtype == at::kFloat8_e4m3fnuz ||
                    activation_dtype == at::kFloat8_e5m2,
                kOp, ": activation_dtype must be an FP8 dtype, got ", activation_dtype);
  }
  if (!bias.has_value()) return;
  TORCH_CHECK(bias->numel() == N, kOp, ": bias has shape ", bias->sizes(), ", expected [", N, "]");
  TORCH_CHECK(bias->is_contiguous(), kOp, ": bias must be contiguous, got shape ", bias->sizes(), " with strides ",
              bias->strides(), "; pass bias.contiguous()");
  const auto bdtype = bias->scalar_type();
  if (bdtype == at::kFloat) {
    c.p.bias = bias->data_ptr<float>();
    return;
  }
  TORCH_CHECK(bdtype == at::kBFloat16 || bdtype == at::kHalf, kOp, ": bias must be float32, bfloat16 or float16, got ",
              bdtype);
  c.bias_buffer.resize(N);
  for (int64_t n = 0; n < N; ++n)
    c.bias_buffer[n] = bdtype == at::kBFloat16 ? static_cast<float>(bias->data_ptr<c10::BFloat16>()[n])
                                               : static_cast<float>(bias->data_ptr<c10::Half>()[n]);
  c.p.bias = c.bias_buffer.data();
}

// Scales up to 2^kLargestKept stay as they are.
constexpr int kLargestKept = 32;

// The power of two that takes `largest` down to 2^kLargestKept, or 0.
int excess(float largest) {
  return std::isfinite(largest) && std::ilogb(largest) > kLargestKept ? std::ilogb(largest) - kLargestKept : 0;
}

// Row-scaled W8A8 (token, token-mse, tensor, static) multiplies FP8 codes by
// FP8 codes (up to 448 x 448 per term) and applies the weight scale before
// the row's activation scale: a weight scale above about 1e31 would overflow
// those float32 sums to Inf/NaN where the result is finite. Such scales are
// taken down by a power of two, exactly, and the row scale goes up by it
// after the activations are quantized (scaled_linear_into). Group mode is
// the mirror case (shift_large_group_scales).
void shift_large_weight_scales(LinearCall& c, Activation mode, int64_t count) {
  const bool row_scaled = mode == kToken || mode == kTokenMse || mode == kTensor || mode == kStatic;
  c.scale_shift = row_scaled ? excess(*std::max_element(c.p.scale, c.p.scale + count)) : 0;
  if (!c.scale_shift) return;
  c.shifted_scale.resize(count);
  for (size_t i = 0; i < c.shifted_scale.size(); ++i) c.shifted_scale[i] = std::ldexp(c.p.scale[i], -c.scale_shift);
  c.p.scale = c.shifted_scale.data();
}

// Group scales are the mirror case of shift_large_weight_scales: the tiles
// apply them to each segment's sums (or they sit in the float32 values)
// before a channel weight scale, so a row whose largest group scale is above
// 2^kLargestKept has its group scales (or values) taken down by a power of
// two, and a row scale of that power puts it back at the end. `data` holds
// M rows of `stride` (group scales or values); row_scale holds each row's
// largest group scale (prepare_activations) and becomes the row scale.
void shift_large_group_scales(LinearCall& c, float* data, int64_t stride) {
  bool any = false;
  for (int64_t m = 0; m < c.p.M; ++m) {
    const int e = excess(c.row_scale[m]);
    c.row_scale[m] = std::ldexp(1.0f, e);
    if (!e) continue;
    any = true;
    for (int64_t i = 0; i < stride; ++i) data[m * stride + i] = std::ldexp(data[m * stride + i], -e);
  }
  c.p.row_scale = any ? c.row_scale.data() : nullptr;
}

// prepare_activations on x in its dtype, into a float32 buffer or as bf16.
void prepare_x(LinearCall& c, const at::Tensor& x, Activation mode, at::ScalarType qdtype, float* buffer,
               uint16_t* bf16, float* groups) {
  const LinearProblem& p = c.p;
  if (c.xdtype == at::kFloat) {
    prepare_activations(x.data_ptr<float>(), p.M, p.K, p.Kp, mode, qdtype, c.input_scale, buffer, c.row_scale.data(),
                        bf16, groups);
  } else if (c.xdtype == at::kBFloat16) {
    prepare_activations(x.data_ptr<c10::BFloat16>(), p.M, p.K, p.Kp, mode, qdtype, c.input_scale, buffer,
                        c.row_scale.data(), bf16, groups);
  } else {
    prepare_activations(x.data_ptr<c10::Half>(), p.M, p.K, p.Kp, mode, qdtype, c.input_scale, buffer,
                        c.row_scale.data(), bf16, groups);
  }
}

// Gives the problem its activations: the ISA's prepared form (from bf16) where
// it has a preparation step that takes them, else float32 [M][Kp] (x itself
// when it already is float32 with an even K), with their row or group scales.
void prepare_linear_activations(LinearCall& c, const IsaEntry& isa, const at::Tensor& x, Activation mode,
                                at::ScalarType qdtype) {
  LinearProblem& p = c.p;
  const int64_t M = p.M, K = p.K, Kp = p.Kp;
  const int64_t group_cols = (K + kActivationGroup - 1) / kActivationGroup;
  // An ISA that declines bf16 x (returns null) is not asked again: it would
  // decline for the same reason.
  bool declined = false;
  const uint16_t* x_bf16 = nullptr;
  if (isa.prepare && mode == kNone && c.xdtype == at::kBFloat16) {
    x_bf16 = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
  } else if (isa.prepare && mode != kNone) {
    // Quantized activations are FP8 values, exact in bf16: handed over as
    // bf16 (no float32 buffer, no split into parts). Group scales go with
    // them, for the tiles to apply to each group's partial sums (in the
    // values they would need three bf16 parts). (A block scale with an odd
    // k-block makes the ISA decline: x is then quantized again below, into
    // float32, with the group scales in the values.)
    c.x_quantized = ScratchBuffer<uint16_t>(M * K);
    TORCH_CHECK(c.x_quantized.get() != nullptr, kOp, ": could not allocate ", M * K * 2,
                " bytes for the quantized activations");
    c.row_scale.resize(M);
    if (mode == kGroup) c.group_scale.resize(M * group_cols);
    prepare_x(c, x, mode, qdtype, nullptr, c.x_quantized.get(), mode == kGroup ? c.group_scale.data() : nullptr);
    x_bf16 = c.x_quantized.get();
    if (mode == kGroup) shift_large_group_scales(c, c.group_scale.data(), group_cols);
  }
  if (x_bf16) {
    p.x_bf16 = x_bf16;
    c.prepared = isa.prepare(p);
    p.x_bf16 = nullptr;
    declined = !c.prepared;
    if (c.prepared && mode == kGroup) {
      p.group_scale = c.group_scale.data();
      p.group_cols = group_cols;
    } else if (c.prepared && mode != kNone) {
      p.row_scale = c.row_scale.data();
    }
  }
  if (c.prepared) {
    p.x = nullptr;
  } else if (mode == kNone && c.xdtype == at::kFloat && K == Kp) {
    p.x = x.data_ptr<float>();
  } else {
    c.x_buffer = ScratchBuffer<float>(M * Kp);
    TORCH_CHECK(c.x_buffer.get() != nullptr, kOp, ": could not allocate ", M * Kp * 4, " bytes for the activations");
    if (mode != kNone) c.row_scale.resize(M);
    prepare_x(c, x, mode, qdtype, c.x_buffer.get(), nullptr, nullptr);
    p.x = c.x_buffer.get();
    if (mode == kGroup) shift_large_group_scales(c, c.x_buffer.get(), Kp);
    if (mode != kNone && mode != kGroup) p.row_scale = c.row_scale.data();
  }
  if (isa.prepare && !c.prepared && !declined) c.prepared = isa.prepare(p);
  p.prepared = c.prepared.get();
}

// The output, bias and weight scale's side of a call of M rows.
void set_up_call(LinearCall& c, at::Tensor& out, const at::Tensor& packed, const at::Tensor& weight_scale,
                 const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& input_scale, int64_t M,
                 int64_t N, int64_t K, Activation mode, at::ScalarType activation_dtype) {
  check_output_and_bias(c, out, M, N, bias, input_scale, mode, activation_dtype);
  LinearProblem& p = c.p;
  p.M = M;
  p.K = K;
  p.Kp = (K + 1) & ~int64_t(1);
  p.ldx = p.Kp;
  p.w = static_cast<const uint8_t*>(packed.data_ptr());
  p.N = N;
  p.format_factor = format_factor(p.format);
  p.scale = weight_scale.data_ptr<float>();
  shift_large_weight_scales(c, mode, weight_scale.numel());
  p.out = out.data_ptr();
  p.out_dtype = c.xdtype == at::kFloat ? kOutFloat : (c.xdtype == at::kBFloat16 ? kOutBFloat16 : kOutHalf);
  p.ldo = N;
}

// The tiles of 32 output channels, split over threads; or, when the ISA
// prepared its rows in parts, one part per thread, each through every tile
// (at::parallel_for hands range r to the thread that laid out part r).
void run_tiles(LinearCall& c, const IsaEntry& isa) {
  LinearProblem& p = c.p;
  const LinearTilesFn fn = isa.fn;
  const int64_t T = (p.N + kTileN - 1) / kTileN;
  const int64_t parts = isa.prepared_row_parts && p.prepared ? isa.prepared_row_parts(p.prepared) : 1;
  if (parts > 1) {
    p.threads = parts;
    p.row_parts = parts;
    at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        LinearProblem part = p;
        part.row_part = r;
        fn(part, 0, T);
      }
    });
    return;
  }
  // At least ~256K multiply-adds per chunk so that small layers run inline.
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 18) / std::max<int64_t>(1, p.M * p.Kp * kTileN));
  p.threads = at::in_parallel_region() ? 1 : std::min<int64_t>(at::get_num_threads(), (T + grain - 1) / grain);
  at::parallel_for(0, T, grain, [&](int64_t begin, int64_t end) { fn(p, begin, end); });
}

void scaled_linear_into(at::Tensor& out, const at::Tensor& x_in, const at::Tensor& packed,
                        const at::Tensor& weight_scale, const std::optional<at::Tensor>& bias,
                        const std::optional<at::Tensor>& input_scale, int64_t N, int64_t K,
                        at::IntArrayRef block_size, Activation mode, at::ScalarType activation_dtype) {
  LinearCall c;
  check_weight(c, x_in, packed, weight_scale, N, K, block_size);
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.numel() / K;
  set_up_call(c, out, packed, weight_scale, bias, input_scale, M, N, K, mode, activation_dtype);
  if (M == 0) return;
  const IsaEntry& isa = current_isa();
  prepare_linear_activations(c, isa, x, mode, activation_dtype);
  if (c.scale_shift && c.p.row_scale) {
    for (auto& r : c.row_scale) r = std::ldexp(r, c.scale_shift);
  }
  run_tiles(c, isa);
}

// The CPU kernel of qfp8::scaled_linear_cpu, boxed (every caller but the
// eager entry, which calls scaled_linear_cpu itself, boxes anyway).
void scaled_linear_cpu_boxed(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  empty_lists_from_none(op.schema(), stack);
  auto args = torch::jit::last(*stack, 10);
  const std::vector<int64_t> block_size = args[7].toIntVector();
  at::Tensor out = scaled_linear_cpu(args[0].toTensor(), args[1].toTensor(), args[2].toTensor(),
                                     args[3].toOptional<at::Tensor>(), args[4].toOptional<at::Tensor>(),
                                     args[5].toInt(), args[6].toInt(), block_size, args[8].toStringView(),
                                     args[9].toScalarType());
  torch::jit::drop(*stack, 10);
  stack->emplace_back(std::move(out));
}

void scaled_linear_cpu_into(at::Tensor out, const at::Tensor& x, const at::Tensor& packed,
                            const at::Tensor& weight_scale, const std::optional<at::Tensor>& bias,
                            const std::optional<at::Tensor>& input_scale, int64_t out_features, int64_t in_features,
                            at::IntArrayRef block_size, c10::string_view activation, at::ScalarType activation_dtype) {
  scaled_linear_into(out, x, packed, weight_scale, bias, input_scale, out_features, in_features, block_size,
                     parse_activation(activation), activation_dtype);
}

// The quantizing modes on the patches of x: quantized run by run (no patch
// matrix of x's values), then the ISA's preparation of the FP8 values as
// for a linear call. False when the ISA or mode has no such path, or the
// preparation declines.
bool quantize_patches_into(at::Tensor& out, const ConvPatches& x, const IsaEntry& isa, const at::Tensor& packed,
                           const at::Tensor& weight_scale, const std::optional<at::Tensor>& bias,
                           const std::optional<at::Tensor>& input_scale, int64_t N, int64_t K,
                           at::IntArrayRef block_size, Activation mode, at::ScalarType activation_dtype) {
  if (!isa.helpers->finite_amax_row || !(mode == kToken || mode == kTensor || mode == kStatic)) return false;
  LinearCall c;
  check_weight(c, x.input, packed, weight_scale, N, K, block_size, /*check_k=*/false);
  set_up_call(c, out, packed, weight_scale, bias, input_scale, x.M, N, K, mode, activation_dtype);
  LinearProblem& p = c.p;
  c.x_quantized = ScratchBuffer<uint16_t>(x.M * K);
  TORCH_CHECK(c.x_quantized.get() != nullptr, kOp, ": could not allocate ", x.M * K * 2,
              " bytes for the quantized activations");
  c.row_scale.resize(x.M);
  bool quantized = false;
  const void* data = x.input.data_ptr();
  if (c.xdtype == at::kFloat) {
    quantized = quantize_patches(static_cast<const float*>(data), x.rows, x.M, mode, activation_dtype, c.input_scale,
                                 c.row_scale.data(), c.x_quantized.get());
  } else if (c.xdtype == at::kBFloat16) {
    quantized = quantize_patches(static_cast<const c10::BFloat16*>(data), x.rows, x.M, mode, activation_dtype,
                                 c.input_scale, c.row_scale.data(), c.x_quantized.get());
  } else {
    quantized = quantize_patches(static_cast<const c10::Half*>(data), x.rows, x.M, mode, activation_dtype,
                                 c.input_scale, c.row_scale.data(), c.x_quantized.get());
  }
  if (!quantized) return false;
  p.x_bf16 = c.x_quantized.get();
  c.prepared = isa.prepare(p);
  p.x_bf16 = nullptr;
  if (!c.prepared) return false;
  if (c.scale_shift) {
    for (auto& r : c.row_scale) r = std::ldexp(r, c.scale_shift);
  }
  p.row_scale = c.row_scale.data();
  p.prepared = c.prepared.get();
  run_tiles(c, isa);
  return true;
}

}  // namespace

void scaled_linear_patches_into(at::Tensor& out, const ConvPatches& x, const at::Tensor& packed,
                                const at::Tensor& weight_scale, const std::optional<at::Tensor>& bias,
                                const std::optional<at::Tensor>& input_scale, int64_t N, int64_t K,
                                at::IntArrayRef block_size, Activation mode, at::ScalarType activation_dtype) {
  const IsaEntry& isa = current_isa();
  if (isa.prepare_patches && mode == kNone && x.input.scalar_type() == at::kBFloat16 && x.M > 0) {
    LinearCall c;
    check_weight(c, x.input, packed, weight_scale, N, K, block_size, /*check_k=*/false);
    set_up_call(c, out, packed, weight_scale, bias, input_scale, x.M, N, K, mode, activation_dtype);
    LinearProblem& p = c.p;
    p.x_bf16 = reinterpret_cast<const uint16_t*>(x.input.data_ptr<c10::BFloat16>());
    p.patches = &x.rows;
    c.prepared = isa.prepare_patches(p);
    p.x_bf16 = nullptr;
    p.patches = nullptr;
    if (c.prepared) {
      p.prepared = c.prepared.get();
      return run_tiles(c, isa);
    }
  }
  if (isa.prepare && mode != kNone && x.M > 0 && quantize_patches_into(out, x, isa, packed, weight_scale, bias,
                                                                    input_scale, N, K, block_size, mode,
                                                                    activation_dtype)) {
    return;
  }
  scaled_linear_into(out, x.dense(), packed, weight_scale, bias, input_scale, N, K, block_size, mode,
                     activation_dtype);
}

at::Tensor scaled_linear_cpu(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& weight_scale,
                             const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& input_scale,
                             int64_t out_features, int64_t in_features, at::IntArrayRef block_size,
                             c10::string_view activation, at::ScalarType activation_dtype) {
  TORCH_CHECK(x.dim() >= 1, "qfp8::scaled_linear_cpu: x must have at least one dimension, got a scalar");
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out_features;
  at::Tensor out = at::empty(shape, x.options().memory_format(at::MemoryFormat::Contiguous));
  scaled_linear_into(out, x, packed, weight_scale, bias, input_scale, out_features, in_features, block_size,
                     parse_activation(activation), activation_dtype);
  return out;
}

}  // namespace qfp8

TORCH_LIBRARY_FRAGMENT(qfp8, m) {
  m.def(
      "_scaled_linear_cpu_into(Tensor(a!) out, Tensor x, Tensor packed_weight, Tensor weight_scale, Tensor? bias, "
      "Tensor? input_scale, int out_features, int in_features, int[] block_size, str activation, "
      "ScalarType activation_dtype) -> ()");
}

TORCH_LIBRARY_IMPL(qfp8, CPU, m) {
  m.impl("scaled_linear_cpu", torch::CppFunction::makeFromBoxedFunction<&qfp8::scaled_linear_cpu_boxed>());
  m.impl("_scaled_linear_cpu_into", &qfp8::scaled_linear_cpu_into);
}
