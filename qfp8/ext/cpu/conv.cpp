// qfp8::scaled_conv_cpu: an FP8 convolution (groups = 1) as the linear
// kernel on its patch matrix, without the patch matrix where the ISA can do
// without (schema and meaning in qfp8/library/conv_cpu.py).
//
// Per call: the input [B, C, *S] (any strides) is copied once into a
// zero-padded channels-last buffer [B, Hp, Wp, C] (scratch memory, reused
// from call to call; a 1-D convolution is a 2-D one of height 1). A patch
// row, K in (*kernel, C) order, is then kh runs of kw * C contiguous values
// (kh * kw runs of C when the kernel is dilated along its width), which
// kernel.h's PatchRows describes. An ISA with a patch preparation step
// (avx512bf16) reads them in place as it lays out its activations, which it
// copies anyway. Token, tensor and static FP8 activations on an ISA with
// the row helpers (avx512bf16, amx) are quantized run by run into the FP8
// values its preparation takes (linear.cpp). Everything else gets the runs
// gathered into a dense [M][K] matrix (memcpy per run). The product
// [M][N] is the output in channels-last order: the output itself for an
// input that is not contiguous, else transposed into [B, N, *out].
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <cstdint>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#include <vector>

#include "bindings.h"
#include "kernel.h"

namespace qfp8 {

at::Tensor ConvPatches::dense() const {
  const int64_t K = rows.segments * rows.segment_length, size = input.element_size();
  size_t capacity = 0;
  void* data = scratch_alloc(static_cast<size_t>(M * K * size), &capacity);
  TORCH_CHECK(data != nullptr, "qfp8::scaled_conv_cpu: could not allocate ", M * K * size,
              " bytes for the patch matrix");
  at::Tensor dense = at::from_blob(
      data, {M, K}, [capacity](void* p) { scratch_free(p, capacity); }, input.options());
  const char* in = static_cast<const char*>(input.data_ptr());
  char* out = static_cast<char*>(data);
  const int64_t run = rows.segment_length * size;
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      for (int64_t s = 0; s < rows.segments; ++s) {
        std::memcpy(out + m * K * size + s * run, in + (rows.row_offset[m] + rows.segment_offset[s]) * size, run);
      }
    }
  });
  return dense;
}

namespace {

constexpr const char* kOp = "qfp8::scaled_conv_cpu";
constexpr int64_t kBlock = 16;  // transposes go in kBlock x kBlock blocks

#if defined(__SSE2__)
// dst[j * ld + i] = src[i * si + j] for i, j < 8, 16-bit values: three rounds of unpacks (SSE2, every x86-64).
inline void transpose8x8(uint16_t* dst, int64_t ld, const uint16_t* src, int64_t si) {
  __m128i r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i * si));
  for (int i = 0; i < 8; i += 2) {
    t[i / 2] = _mm_unpacklo_epi16(r[i], r[i + 1]);      // columns 0-3 of rows i, i + 1
    t[4 + i / 2] = _mm_unpackhi_epi16(r[i], r[i + 1]);  // columns 4-7
  }
  for (int h = 0; h < 8; h += 4) {  // h = 0: columns 0-3, h = 4: columns 4-7
    r[h] = _mm_unpacklo_epi32(t[h], t[h + 1]);          // rows 0-3, columns h, h + 1
    r[h + 1] = _mm_unpackhi_epi32(t[h], t[h + 1]);      // rows 0-3, columns h + 2, h + 3
    r[h + 2] = _mm_unpacklo_epi32(t[h + 2], t[h + 3]);  // rows 4-7, columns h, h + 1
    r[h + 3] = _mm_unpackhi_epi32(t[h + 2], t[h + 3]);  // rows 4-7, columns h + 2, h + 3
  }
  for (int h = 0; h < 8; h += 4) {
    for (int q = 0; q < 2; ++q) {  // columns h + 2q and h + 2q + 1
      uint16_t* out = dst + (h + 2 * q) * ld;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm_unpacklo_epi64(r[h + q], r[h + 2 + q]));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + ld), _mm_unpackhi_epi64(r[h + q], r[h + 2 + q]));
    }
  }
}

// The same for 4 x 4 32-bit values (bit moves only: every float32 bit pattern is kept).
inline void transpose4x4(uint32_t* dst, int64_t ld, const uint32_t* src, int64_t si) {
  __m128 r[4];
  for (int i = 0; i < 4; ++i) r[i] = _mm_castsi128_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i * si)));
  _MM_TRANSPOSE4_PS(r[0], r[1], r[2], r[3]);
  for (int j = 0; j < 4; ++j) _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + j * ld), _mm_castps_si128(r[j]));
}
#endif

// dst[j * ld + i] = src[i * si + j * sj] for i < rows, j < cols.
template <typename T>
void transpose_into(T* dst, int64_t ld, const T* src, int64_t si, int64_t sj, int64_t rows, int64_t cols) {
  if (si == 1) {  // already in dst's order: a copy per j
    for (int64_t j = 0; j < cols; ++j) std::memcpy(dst + j * ld, src + j * sj, rows * sizeof(T));
    return;
  }
  int64_t whole_i = 0, whole_j = 0;  // the blocks done with vectors (8 x 8 16-bit, 4 x 4 32-bit values)
#if defined(__SSE2__)
  constexpr int64_t step = sizeof(T) == 2 ? 8 : 4;
  if (sj == 1) {
    whole_i = rows / step * step;
    whole_j = cols / step * step;
    const auto block = [&](int64_t i0, int64_t j0) {
      if constexpr (sizeof(T) == 2) {
        transpose8x8(reinterpret_cast<uint16_t*>(dst + j0 * ld + i0), ld,
                     reinterpret_cast<const uint16_t*>(src + i0 * si + j0), si);
      } else {
        transpose4x4(reinterpret_cast<uint32_t*>(dst + j0 * ld + i0), ld,
                     reinterpret_cast<const uint32_t*>(src + i0 * si + j0), si);
      }
    };
    // The inner loop steps along i when dst's rows lie farther apart than src's, else along j: the side whose
    // rows lie far apart (maybe a multiple of 4 KB, in the same cache sets) has one block of rows in flight.
    if (ld >= si) {
      for (int64_t j0 = 0; j0 < whole_j; j0 += step) {
        for (int64_t i0 = 0; i0 < whole_i; i0 += step) block(i0, j0);
      }
    } else {
      for (int64_t i0 = 0; i0 < whole_i; i0 += step) {
        for (int64_t j0 = 0; j0 < whole_j; j0 += step) block(i0, j0);
      }
    }
  }
#endif
  // The rest in kBlock x kBlock blocks: rows from whole_i on, and the columns from whole_j on of the rows before.
  const auto scalar = [&](int64_t i_begin, int64_t i_end, int64_t j_begin) {
    for (int64_t i0 = i_begin; i0 < i_end; i0 += kBlock) {
      const int64_t i1 = std::min(i0 + kBlock, i_end);
      for (int64_t j0 = j_begin; j0 < cols; j0 += kBlock) {
        const int64_t j1 = std::min(j0 + kBlock, cols);
        for (int64_t j = j0; j < j1; ++j) {
          for (int64_t i = i0; i < i1; ++i) dst[j * ld + i] = src[i * si + j * sj];
        }
      }
    }
  };
  scalar(whole_i, rows, 0);
  scalar(0, whole_i, whole_j);
}

// The sizes of one call, a 1-D convolution as a 2-D one of height 1.
struct ConvShape {
  int64_t B, C, H, W, kh, kw, sh, sw, dh, dw, top, left, Hp, Wp, OH, OW;
};

ConvShape conv_shape(const at::Tensor& x, at::IntArrayRef kernel, at::IntArrayRef stride, at::IntArrayRef padding,
                     at::IntArrayRef dilation) {
  const int64_t dims = static_cast<int64_t>(kernel.size());
  TORCH_CHECK_VALUE(dims == 1 || dims == 2, kOp, ": kernel_size must have 1 or 2 sizes, got ", kernel);
  TORCH_CHECK_VALUE(static_cast<int64_t>(stride.size()) == dims && static_cast<int64_t>(dilation.size()) == dims &&
                        static_cast<int64_t>(padding.size()) == 2 * dims,
                    kOp, ": kernel_size ", kernel, " needs as many strides and dilations and twice as many paddings, "
                    "got stride ", stride, ", padding ", padding, ", dilation ", dilation);
  TORCH_CHECK_VALUE(x.dim() == dims + 2, kOp, ": x must be [batch, channels, ", dims == 1 ? "length" : "height, width",
                    "], got shape ", x.sizes());
  for (int64_t i = 0; i < dims; ++i) {
    TORCH_CHECK_VALUE(kernel[i] >= 1 && stride[i] >= 1 && dilation[i] >= 1 && padding[2 * i] >= 0 &&
                          padding[2 * i + 1] >= 0,
                      kOp, ": kernel_size ", kernel, ", stride ", stride, " and dilation ", dilation,
                      " must be positive and padding ", padding, " not negative");
  }
  ConvShape s{};
  s.B = x.size(0);
  s.C = x.size(1);
  const bool two = dims == 2;
  s.H = two ? x.size(2) : 1;
  s.W = x.size(-1);
  s.kh = two ? kernel[0] : 1;
  s.kw = kernel[dims - 1];
  s.sh = two ? stride[0] : 1;
  s.sw = stride[dims - 1];
  s.dh = two ? dilation[0] : 1;
  s.dw = dilation[dims - 1];
  s.top = two ? padding[0] : 0;
  s.left = padding[2 * dims - 2];
  s.Hp = s.H + s.top + (two ? padding[1] : 0);
  s.Wp = s.W + s.left + padding[2 * dims - 1];
  s.OH = s.Hp >= s.dh * (s.kh - 1) + 1 ? (s.Hp - s.dh * (s.kh - 1) - 1) / s.sh + 1 : 0;
  s.OW = s.Wp >= s.dw * (s.kw - 1) + 1 ? (s.Wp - s.dw * (s.kw - 1) - 1) / s.sw + 1 : 0;
  TORCH_CHECK_VALUE(s.OH >= 1 && s.OW >= 1, kOp, ": the input ", x.sizes(), " padded by ", padding,
                    " is smaller than the dilated kernel (kernel_size ", kernel, ", dilation ", dilation, ")");
  return s;
}

// x [B, C, H, W] (strides of x, in elements) into the zero-padded channels-last padded [B, Hp, Wp, C].
template <typename T>
void pad_channels_last(const ConvShape& s, const T* x, const int64_t* strides, T* padded) {
  const int64_t sb = strides[0], sc = strides[1], shh = strides[2], sww = strides[3], C = s.C, row = s.Wp * C;
  at::parallel_for(0, s.B * s.Hp, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t b = r / s.Hp, h = r % s.Hp - s.top;
      T* out = padded + r * row;
      if (h < 0 || h >= s.H) {
        std::memset(out, 0, row * sizeof(T));
        continue;
      }
      std::memset(out, 0, s.left * C * sizeof(T));
      std::memset(out + (s.left + s.W) * C, 0, (s.Wp - s.left - s.W) * C * sizeof(T));
      transpose_into(out + s.left * C, C, x + b * sb + h * shh, sc, sww, C, s.W);
    }
  });
}

// The patch rows of the padded input: each output pixel's offset and each run's.
void patch_rows(const ConvShape& s, std::vector<int64_t>& row_offset, std::vector<int64_t>& segment_offset,
                PatchRows& rows) {
  const int64_t C = s.C;
  row_offset.resize(s.B * s.OH * s.OW);
  for (int64_t b = 0, m = 0; b < s.B; ++b) {
    for (int64_t oh = 0; oh < s.OH; ++oh) {
      for (int64_t ow = 0; ow < s.OW; ++ow) row_offset[m++] = ((b * s.Hp + oh * s.sh) * s.Wp + ow * s.sw) * C;
    }
  }
  const bool whole_rows = s.dw == 1;  // a kernel row's kw * C values are contiguous
  for (int64_t i = 0; i < s.kh; ++i) {
    for (int64_t j = 0; j < (whole_rows ? 1 : s.kw); ++j) segment_offset.push_back((i * s.dh * s.Wp + j * s.dw) * C);
  }
  rows.row_offset = row_offset.data();
  rows.segment_offset = segment_offset.data();
  rows.segments = static_cast<int64_t>(segment_offset.size());
  rows.segment_length = whole_rows ? s.kw * C : C;
}

at::Tensor scaled_conv_cpu(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& weight_scale,
                           const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& input_scale,
                           int64_t out_features, int64_t in_features, at::IntArrayRef block_size,
                           c10::string_view activation, at::ScalarType activation_dtype, at::IntArrayRef kernel_size,
                           at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation) {
  TORCH_CHECK(x.device().is_cpu(), kOp, ": x must be on the CPU, got ", x.device());
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, kOp,
              ": x must be float32, bfloat16 or float16, got ", dtype);
  const ConvShape s = conv_shape(x, kernel_size, stride, padding, dilation);
  TORCH_CHECK_VALUE(in_features == s.C * s.kh * s.kw, kOp, ": in_features ", in_features, " is not channels ", s.C,
                    " x kernel_size ", kernel_size);
  const Activation mode = parse_activation(activation);
  const int64_t N = out_features, M = s.B * s.OH * s.OW;
  const bool one_dim = kernel_size.size() == 1;
  std::vector<int64_t> last_shape = {s.B, s.OH, s.OW, N};
  if (one_dim) last_shape = {s.B, s.OW, N};
  const bool contiguous = x.is_contiguous();
  at::Tensor out = at::empty(contiguous ? std::vector<int64_t>{s.B, N, s.OH * s.OW} : last_shape, x.options());
  if (M == 0) return contiguous ? out.view(one_dim ? at::IntArrayRef{s.B, N, s.OW} : at::IntArrayRef{s.B, N, s.OH, s.OW})
                                : out.movedim(-1, 1);

  // The padded channels-last input, in scratch memory.
  const int64_t size = x.element_size(), count = s.B * s.Hp * s.Wp * s.C;
  size_t capacity = 0;
  void* buffer = scratch_alloc(static_cast<size_t>(count * size), &capacity);
  TORCH_CHECK(buffer != nullptr, kOp, ": could not allocate ", count * size, " bytes for the padded input");
  ConvPatches patches;
  patches.input = at::from_blob(
      buffer, {s.B, s.Hp, s.Wp, s.C}, [capacity](void* p) { scratch_free(p, capacity); }, x.options());
  const int64_t strides[4] = {x.stride(0), x.stride(1), one_dim ? 0 : x.stride(2), x.stride(-1)};
  if (size == 2) {
    pad_channels_last(s, static_cast<const uint16_t*>(x.data_ptr()), strides, static_cast<uint16_t*>(buffer));
  } else {
    pad_channels_last(s, static_cast<const uint32_t*>(x.data_ptr()), strides, static_cast<uint32_t*>(buffer));
  }
  std::vector<int64_t> row_offset, segment_offset;
  patch_rows(s, row_offset, segment_offset, patches.rows);
  patches.M = M;

  if (!contiguous) {  // the product [M][N] is the channels-last output itself
    at::Tensor rows = out.view({M, N});
    scaled_linear_patches_into(rows, patches, packed, weight_scale, bias, input_scale, N, in_features, block_size,
                               mode, activation_dtype);
    return out.movedim(-1, 1);
  }
  size_t y_capacity = 0;
  void* y_data = scratch_alloc(static_cast<size_t>(M * N * size), &y_capacity);
  TORCH_CHECK(y_data != nullptr, kOp, ": could not allocate ", M * N * size, " bytes for the product");
  at::Tensor y = at::from_blob(
      y_data, {M, N}, [y_capacity](void* p) { scratch_free(p, y_capacity); }, x.options());
  scaled_linear_patches_into(y, patches, packed, weight_scale, bias, input_scale, N, in_features, block_size, mode,
                             activation_dtype);
  const int64_t P = s.OH * s.OW;
  at::parallel_for(0, s.B * ((N + kBlock - 1) / kBlock), 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {  // a batch's kBlock channels: out[b][n][p] = y[b * P + p][n]
      const int64_t b = t / ((N + kBlock - 1) / kBlock), n0 = t % ((N + kBlock - 1) / kBlock) * kBlock;
      const int64_t n = std::min(kBlock, N - n0);
      if (size == 2) {
        auto* dst = static_cast<uint16_t*>(out.data_ptr()) + (b * N + n0) * P;
        transpose_into(dst, P, static_cast<const uint16_t*>(y_data) + b * P * N + n0, N, 1, P, n);
      } else {
        auto* dst = static_cast<uint32_t*>(out.data_ptr()) + (b * N + n0) * P;
        transpose_into(dst, P, static_cast<const uint32_t*>(y_data) + b * P * N + n0, N, 1, P, n);
      }
    }
  });
  return out.view(one_dim ? at::IntArrayRef{s.B, N, s.OW} : at::IntArrayRef{s.B, N, s.OH, s.OW});
}

void scaled_conv_cpu_boxed(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  empty_lists_from_none(op.schema(), stack);
  auto args = torch::jit::last(*stack, 14);
  const std::vector<int64_t> block_size = args[7].toIntVector(), kernel = args[10].toIntVector(),
                             stride = args[11].toIntVector(), padding = args[12].toIntVector(),
                             dilation = args[13].toIntVector();
  at::Tensor out = scaled_conv_cpu(args[0].toTensor(), args[1].toTensor(), args[2].toTensor(),
                                   args[3].toOptional<at::Tensor>(), args[4].toOptional<at::Tensor>(), args[5].toInt(),
                                   args[6].toInt(), block_size, args[8].toStringView(), args[9].toScalarType(), kernel,
                                   stride, padding, dilation);
  torch::jit::drop(*stack, 14);
  stack->emplace_back(std::move(out));
}

}  // namespace
}  // namespace qfp8

TORCH_LIBRARY_FRAGMENT(qfp8, m) {
  m.def(
      "scaled_conv_cpu(Tensor x, Tensor packed_weight, Tensor weight_scale, Tensor? bias, Tensor? input_scale, "
      "int out_features, int in_features, int[] block_size, str activation, ScalarType activation_dtype, "
      "int[] kernel_size, int[] stride, int[] padding, int[] dilation) -> Tensor");
}

TORCH_LIBRARY_IMPL(qfp8, CPU, m) {
  m.impl("scaled_conv_cpu", torch::CppFunction::makeFromBoxedFunction<&qfp8::scaled_conv_cpu_boxed>());
}
