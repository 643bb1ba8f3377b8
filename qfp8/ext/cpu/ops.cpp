// torch bindings of the qfp8 CPU linear kernels.
//
// The public op schemas (qfp8::scaled_linear_cpu, pack/unpack) are defined in
// Python (qfp8/library/cpu.py); this file registers the CPU implementation of
// qfp8::scaled_linear_cpu and a few private helpers (ISA selection, an
// out-variant used by the tests to check that every output is written).
//
// Per call, on plain tensors: cheap shape checks, the activations turned into
// a float32 [M][Kp] buffer (a copy of x, or x quantized to FP8 and held as
// the exact FP8 values), then the tiles of 32 output channels are split over
// threads with at::parallel_for. Each tile is computed whole by one thread,
// so results do not depend on the number of threads. The avx512bf16 kernel
// prepares its own form of the activations once per call, from bf16: x as it
// is, or the quantized FP8 values (exact in bf16) instead of the buffer.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <torch/csrc/DynamicTypes.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/record_function.h>
#include <Python.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>
#include <unordered_map>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e4m3fnuz.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cmath>
#include <cstring>
#include <iterator>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#endif

#include "bindings.h"
#include "kernel.h"

namespace qfp8 {

// A buffer aligned to 2 MiB and, on Linux, advised for transparent huge
// pages before its first touch (kernel.h). Below 2 MiB, 64-byte aligned
// only: glibc maps a 2 MiB-aligned request afresh (a system call and page
// faults per call), which tripled a 5-row 576 x 576 call (11 -> 29 us).
void* huge_page_alloc(size_t nbytes) {
  constexpr size_t kHugePage = size_t{2} << 20;
  void* data = nullptr;
  if (posix_memalign(&data, nbytes < kHugePage ? 64 : kHugePage, std::max<size_t>(nbytes, 1)) != 0) return nullptr;
#if defined(MADV_HUGEPAGE)
  const size_t whole = nbytes / kHugePage * kHugePage;
  if (whole > 0) madvise(data, whole, MADV_HUGEPAGE);  // advice only: failure is harmless
#endif
  return data;
}

namespace {

// The per-thread cache behind scratch_alloc (kernel.h): up to
// kCachedScratchBuffers freed buffers and kCachedScratchBytes in all; a
// request takes the smallest cached buffer that holds it. So a prefill's
// layers reuse two to four buffers instead of mapping new memory at every
// call. What stays cached is held until the thread ends: at most 256 MB (a
// 2048-token W8A8 call of a 14336-wide layer needs 117 MB).
constexpr size_t kCachedScratchBuffers = 4;
constexpr size_t kCachedScratchBytes = size_t(256) << 20;

struct ScratchCache {
  struct Entry {
    void* data;
    size_t capacity;
  };
  std::vector<Entry> free;
  size_t bytes = 0;
  ~ScratchCache() {
    for (const Entry& e : free) std::free(e.data);
  }
};

thread_local ScratchCache scratch_cache;

}  // namespace

void* scratch_alloc(size_t nbytes, size_t* capacity) {
  std::vector<ScratchCache::Entry>& cached = scratch_cache.free;
  auto best = cached.end();
  for (auto it = cached.begin(); it != cached.end(); ++it) {
    if (it->capacity >= nbytes && (best == cached.end() || it->capacity < best->capacity)) best = it;
  }
  if (best != cached.end()) {
    void* data = best->data;
    *capacity = best->capacity;
    scratch_cache.bytes -= best->capacity;
    cached.erase(best);
    return data;
  }
  *capacity = nbytes;
  return huge_page_alloc(nbytes);
}

void scratch_free(void* data, size_t capacity) {
  if (!data) return;
  if (capacity > kCachedScratchBytes) {
    std::free(data);
    return;
  }
  std::vector<ScratchCache::Entry>& cached = scratch_cache.free;
  cached.push_back({data, capacity});
  scratch_cache.bytes += capacity;
  while (cached.size() > kCachedScratchBuffers || scratch_cache.bytes > kCachedScratchBytes) {
    // The smallest goes first: a larger buffer serves every request a smaller one would.
    auto smallest = std::min_element(cached.begin(), cached.end(),
                                     [](const auto& a, const auto& b) { return a.capacity < b.capacity; });
    std::free(smallest->data);
    scratch_cache.bytes -= smallest->capacity;
    cached.erase(smallest);
  }
}

namespace {

// ---------------------------------------------------------------- ISA table

struct IsaEntry {
  const char* name;
  LinearTilesFn fn;  // null when not compiled into this build
  bool (*cpu_has)();
  LinearPrepareFn prepare = nullptr;  // once per call, before the threads (kernel.h)
};

#if defined(__x86_64__) || defined(_M_X64)
// __builtin_cpu_supports also checks that the OS saves the vector state.
bool has_avx2() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"); }
bool has_avx512() {
  return has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}
// The bf16 kernel also looks up bytes with vpermt2b (AVX512-VBMI).
bool has_avx512bf16() {
  return has_avx512() && __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vbmi");
}
// AMX-BF16 and AMX-TILE (CPUID 7.0 EDX bits 22 and 24), the tile state
// enabled in XCR0 (bits 17 and 18), and, on Linux, this process granted
// the tile data (arch_prctl ARCH_REQ_XCOMP_PERM, once; kernels before 5.16
// refuse it, and then AMX is not used). Asked only on AVX512-BF16 CPUs.
bool amx_granted() {
#if defined(__linux__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 22) & 1u) || !((d >> 24) & 1u)) return false;
  if (!__get_cpuid(1, &a, &b, &c, &d) || !((c >> 27) & 1u)) return false;  // OSXSAVE
  unsigned lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  if (((lo >> 17) & 3u) != 3u) return false;
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}
bool has_amx() {
  static const bool granted = has_avx512bf16() && amx_granted();
  return granted;
}
#else
bool has_avx2() { return false; }
bool has_avx512() { return false; }
bool has_avx512bf16() { return false; }
bool has_amx() { return false; }
#endif
bool has_scalar() { return true; }

// Best first. An ISA is usable when it was compiled (the build defines
// QFP8_HAVE_<ISA> only if its translation unit compiled) and the CPU has it.
const IsaEntry kIsas[] = {
#if defined(QFP8_HAVE_AMX) && defined(QFP8_HAVE_AVX512BF16)  // avx512bf16's code for odd block scales
    {"amx", linear_tiles_amx, has_amx, prepare_amx},
#else
    {"amx", nullptr, has_amx},
#endif
#ifdef QFP8_HAVE_AVX512BF16
    {"avx512bf16", linear_tiles_avx512bf16, has_avx512bf16, prepare_avx512bf16},
#else
    {"avx512bf16", nullptr, has_avx512bf16},
#endif
#ifdef QFP8_HAVE_AVX512
    {"avx512", linear_tiles_avx512, has_avx512},
#else
    {"avx512", nullptr, has_avx512},
#endif
#ifdef QFP8_HAVE_AVX2
    {"avx2", linear_tiles_avx2, has_avx2},
#else
    {"avx2", nullptr, has_avx2},
#endif
    {"scalar", linear_tiles_scalar, has_scalar},
};

// Never dispatched to: the AVX512 kernel's code on AVX2, which the tests
// select by name (see kernel_avx512emu.cpp). Not in kIsas, so neither the
// automatic choice nor usable_isas() / compiled_isas() ever name it.
#ifdef QFP8_HAVE_AVX512EMU
const IsaEntry kAvx512Emulated = {"avx512emu", linear_tiles_avx512emu, has_avx2};
#else
const IsaEntry kAvx512Emulated = {"avx512emu", nullptr, has_avx2};
#endif

const IsaEntry* best_isa() {
  for (const auto& isa : kIsas)
    if (isa.fn && isa.cpu_has()) return &isa;
  return &kIsas[std::size(kIsas) - 1];  // scalar
}

std::atomic<const IsaEntry*> g_isa{nullptr};

const IsaEntry& current_isa() {
  const IsaEntry* isa = g_isa.load(std::memory_order_relaxed);
  if (!isa) {
    isa = best_isa();
    g_isa.store(isa);
  }
  return *isa;
}

std::vector<std::string> usable_isas() {
  std::vector<std::string> names;
  for (const auto& isa : kIsas)
    if (isa.fn && isa.cpu_has()) names.emplace_back(isa.name);
  return names;
}

std::vector<std::string> compiled_isas() {
  std::vector<std::string> names;
  for (const auto& isa : kIsas)
    if (isa.fn) names.emplace_back(isa.name);
  return names;
}

std::vector<std::string> emulated_isas() {
  std::vector<std::string> names;
  if (kAvx512Emulated.fn && kAvx512Emulated.cpu_has()) names.emplace_back(kAvx512Emulated.name);
  return names;
}

const IsaEntry* isa_named(c10::string_view name) {
  for (const auto& isa : kIsas)
    if (name == isa.name) return &isa;
  return name == kAvx512Emulated.name ? &kAvx512Emulated : nullptr;
}

void set_isa(c10::string_view name) {
  const IsaEntry* isa = isa_named(name);
  TORCH_CHECK(isa, "qfp8: unknown CPU kernel ISA '", std::string(name), "'; expected amx, avx512bf16, avx512, avx2 or scalar");
  TORCH_CHECK(isa->fn, "qfp8: CPU kernel ISA '", std::string(name), "' was not compiled into this build");
  TORCH_CHECK(isa->cpu_has(), "qfp8: this CPU does not support the '", std::string(name), "' kernel");
  g_isa.store(isa);
}

std::string get_isa() { return current_isa().name; }

}  // namespace

// The helpers beside the linear kernels (decode attention, the token-mse
// grid search, activation quantization) come in a scalar and an AVX2
// version; every vector ISA uses the AVX2 one, the scalar ISA the scalar.
// The activation helpers also come in an AVX512 version (in the avx512bf16
// unit), which the avx512bf16 and amx ISAs use.
#ifdef QFP8_HAVE_AVX2
#define QFP8_HELPER_FOR_CURRENT_ISA(name) (current_isa().fn != linear_tiles_scalar ? name##_avx2 : name##_scalar)
#else
#define QFP8_HELPER_FOR_CURRENT_ISA(name) (name##_scalar)
#endif
#if defined(QFP8_HAVE_AMX) && defined(QFP8_HAVE_AVX512BF16)
#define QFP8_ACTIVATION_HELPER_FOR_CURRENT_ISA(name)                                                    \
  (current_isa().fn == linear_tiles_avx512bf16 || current_isa().fn == linear_tiles_amx ? name##_avx512bf16 \
                                                                                      : QFP8_HELPER_FOR_CURRENT_ISA(name))
#elif defined(QFP8_HAVE_AVX512BF16)
#define QFP8_ACTIVATION_HELPER_FOR_CURRENT_ISA(name) \
  (current_isa().fn == linear_tiles_avx512bf16 ? name##_avx512bf16 : QFP8_HELPER_FOR_CURRENT_ISA(name))
#else
#define QFP8_ACTIVATION_HELPER_FOR_CURRENT_ISA(name) QFP8_HELPER_FOR_CURRENT_ISA(name)
#endif

// The AVX512 helpers that read a row of x as given (kernel.h), for the ISAs
// that use the AVX512 activation helpers; null for the others.
struct RowHelpers {
  FiniteAmaxRowFn finite_amax_row = nullptr;
  QuantizeRowBf16Fn quantize_row_bf16 = nullptr;
};

RowHelpers row_helpers_for_current_isa() {
#ifdef QFP8_HAVE_AVX512BF16
  if (QFP8_ACTIVATION_HELPER_FOR_CURRENT_ISA(finite_amax) == finite_amax_avx512bf16)
    return {finite_amax_row_avx512bf16, quantize_row_bf16_avx512bf16};
#endif
  return {};
}

DecodeAttentionFn decode_attention_for_current_isa() { return QFP8_HELPER_FOR_CURRENT_ISA(decode_attention); }
QuantizeRowFn quantize_row_for_current_isa() { return QFP8_ACTIVATION_HELPER_FOR_CURRENT_ISA(quantize_row); }
FiniteAmaxFn finite_amax_for_current_isa() { return QFP8_ACTIVATION_HELPER_FOR_CURRENT_ISA(finite_amax); }
GridErrorFn grid_error_for_current_isa() { return QFP8_ACTIVATION_HELPER_FOR_CURRENT_ISA(grid_error); }

int fp8_format(c10::ScalarType dtype, const char* what) {
  switch (dtype) {
    case at::kFloat8_e4m3fn:
      return kE4M3FN;
    case at::kFloat8_e5m2:
      return kE5M2;
    case at::kFloat8_e4m3fnuz:
      return kE4M3FNUZ;
    default:
      TORCH_CHECK(false, what, " must be float8_e4m3fn, float8_e5m2 or float8_e4m3fnuz, got ", dtype);
  }
}

namespace {

// ------------------------------------------------------------ activations

// Reads element i of a float32/bfloat16/float16 buffer as float32.
template <typename T>
inline float load_float(const T* data, int64_t i) {
  return static_cast<float>(data[i]);
}

enum Activation { kNone, kToken, kTensor, kGroup, kStatic, kTokenMse };

Activation parse_activation(c10::string_view activation) {
  if (activation == "none") return kNone;
  if (activation == "token") return kToken;
  if (activation == "tensor") return kTensor;
  if (activation == "group") return kGroup;
  if (activation == "static") return kStatic;
  if (activation == "token-mse") return kTokenMse;
  TORCH_CHECK(false, "qfp8::scaled_linear_cpu: unknown activation mode '", std::string(activation),
              "'; expected none, token, tensor, group, static or token-mse");
}

inline float scale_from_amax(float amax, float fmax) { return std::max(amax, 1e-12f) / fmax; }

// The FP8 grid of an activation dtype (kernel.h).
Fp8Grid fp8_grid(at::ScalarType dtype, float fmax) {
  if (dtype == at::kFloat8_e5m2) return {21, std::ldexp(1.0f, -14), std::ldexp(1.0f, -16 + 23), fmax};
  if (dtype == at::kFloat8_e4m3fnuz) return {20, std::ldexp(1.0f, -7), std::ldexp(1.0f, -10 + 23), fmax};
  return {20, std::ldexp(1.0f, -6), std::ldexp(1.0f, -9 + 23), fmax};
}

// formats.token_mse_scale for one row; `row` holds its values as float32
// with the non-finite ones replaced by zero. The factors are the float32
// values of 2^(j/16) (formats.TOKEN_MSE_FACTORS).
float token_mse_scale(const float* row, int64_t K, float amax, float fmax, at::ScalarType dtype) {
  static const std::vector<float> factors = [] {
    std::vector<float> f(16);
    for (int j = 0; j < 16; ++j) f[j] = static_cast<float>(std::exp2(j / 16.0));
    return f;
  }();
  const Fp8Grid grid = fp8_grid(dtype, fmax);
  const GridErrorFn grid_error = grid_error_for_current_isa();
  const float base = scale_from_amax(amax, fmax);
  float best_scale = base;
  double best_error = 0.0;
  for (int j = 0; j < 16; ++j) {
    const float scale = base * factors[j];
    const double error = grid_error(row, K, 1.0f / scale, grid) * (static_cast<double>(scale) * scale);
    if (j == 0 || error < best_error) {
      best_scale = scale;
      best_error = error;
    }
  }
  return best_scale;
}

// Fills buffer [M][Kp] (zero padded) and row_scale [M] from x [M][K]. With
// out_bf16 (a quantizing mode: FP8 values, exact in bf16) the values go to
// out_bf16 [M][K] as bf16 bits instead, and buffer is unused. kGroup: with
// group_scale ([M][ceil(K / kActivationGroup)]) the values are the FP8 ones
// and each group's scale goes there; without, the scales multiply the values
// (q * scale in float32, as formats.dequantize_activation does).
template <typename T>
void prepare_activations(const T* x, int64_t M, int64_t K, int64_t Kp, Activation mode, at::ScalarType qdtype,
                         const float* input_scale, float* buffer, float* row_scale, uint16_t* out_bf16 = nullptr,
                         float* group_scale = nullptr) {
  float qmax = 448.0f;
  if (qdtype == at::kFloat8_e4m3fnuz) qmax = 240.0f;
  if (qdtype == at::kFloat8_e5m2) qmax = 57344.0f;
  const QuantizeRowFn quantize_row = quantize_row_for_current_isa();
  const FiniteAmaxFn finite_amax = finite_amax_for_current_isa();
  const Fp8Grid grid = fp8_grid(qdtype, qmax);
  // Row m of x as float32: x itself for float32, else converted into `into`.
  auto row_as_float = [&](int64_t m, float* into) -> const float* {
    const T* xr = x + m * K;
    if constexpr (std::is_same_v<T, float>) {
      return xr;
    } else {
      for (int64_t k = 0; k < K; ++k) into[k] = load_float(xr, k);
      return into;
    }
  };
  // The AVX512 helpers read x as it is and write the bf16 bits at once: one
  // pass for the amax and one for the values, no float32 copy of a row.
  constexpr int kind = std::is_same_v<T, float> ? kRowFloat : (std::is_same_v<T, c10::BFloat16> ? kRowBFloat16 : kRowHalf);
  const RowHelpers helpers = row_helpers_for_current_isa();
  const bool direct = out_bf16 && helpers.finite_amax_row &&
                      (mode == kToken || mode == kTensor || mode == kStatic || (mode == kGroup && group_scale));
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(K, 1));
  // kGroup: row m's groups of kActivationGroup values, each quantized (quantize_group) with the scale of its
  // largest finite |x| (group_amax), which goes to group_scale when given. Returns the row's largest group
  // scale (scaled_linear_into's overflow guard).
  auto quantize_groups = [&](int64_t m, auto&& group_amax, auto&& quantize_group) {
    const int64_t groups = (K + kActivationGroup - 1) / kActivationGroup;
    float largest = 0.0f;
    for (int64_t g = 0; g < K; g += kActivationGroup) {
      const int64_t n = std::min(K, g + kActivationGroup) - g;
      const float scale = scale_from_amax(group_amax(g, n), qmax);
      quantize_group(g, n, scale);
      if (group_scale) group_scale[m * groups + g / kActivationGroup] = scale;
      largest = std::max(largest, scale);
    }
    return largest;
  };
  float tensor_scale = 1.0f;
  if (mode == kTensor) {
    // max is exact in any order: the same scale for every thread count
    const float amax = at::parallel_reduce(
        0, M, grain, 0.0f,
        [&](int64_t begin, int64_t end, float acc) {
          std::vector<float> row(direct ? 0 : K);
          for (int64_t m = begin; m < end; ++m)
            acc = std::max(acc, direct ? helpers.finite_amax_row(x + m * K, kind, K)
                                       : finite_amax(row_as_float(m, row.data()), K));
          return acc;
        },
        [](float a, float b) { return std::max(a, b); });
    tensor_scale = scale_from_amax(amax, qmax);
  } else if (mode == kStatic) {
    tensor_scale = input_scale[0];
  }
  if (direct) {
    at::parallel_for(0, M, grain, [&](int64_t begin, int64_t end) {
      for (int64_t m = begin; m < end; ++m) {
        const T* xr = x + m * K;
        if (mode == kGroup) {
          row_scale[m] = quantize_groups(
              m, [&](int64_t g, int64_t n) { return helpers.finite_amax_row(xr + g, kind, n); },
              [&](int64_t g, int64_t n, float scale) {
                helpers.quantize_row_bf16(xr + g, kind, n, scale, grid, out_bf16 + m * K + g);
              });
          continue;
        }
        const float scale = mode == kToken ? scale_from_amax(helpers.finite_amax_row(xr, kind, K), qmax) : tensor_scale;
        helpers.quantize_row_bf16(xr, kind, K, scale, grid, out_bf16 + m * K);
        row_scale[m] = scale;
      }
    });
    return;
  }
  at::parallel_for(0, M, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> finite(mode == kTokenMse ? K : 0);  // token-mse: a row with its non-finite values zeroed
    std::vector<float> scratch(out_bf16 ? Kp : 0);        // bf16 output: each row in float32 first
    for (int64_t m = begin; m < end; ++m) {
      float* out = out_bf16 ? scratch.data() : buffer + m * Kp;
      for (int64_t k = K; k < Kp; ++k) out[k] = 0.0f;
      const float* xr = row_as_float(m, out);  // converted in place: each step reads a value before it writes it
      switch (mode) {
        case kNone:
          if (xr != out) std::memcpy(out, xr, K * sizeof(float));
          break;
        case kToken: {
          const float scale = scale_from_amax(finite_amax(xr, K), qmax);
          quantize_row(xr, K, scale, 1.0f, grid, out);
          row_scale[m] = scale;
          break;
        }
        case kTokenMse: {
          // The search sees the non-finite values as zero; the quantization
          // (from x again) turns them into NaN.
          for (int64_t k = 0; k < K; ++k) finite[k] = std::isfinite(xr[k]) ? xr[k] : 0.0f;
          const float scale = token_mse_scale(finite.data(), K, finite_amax(finite.data(), K), qmax, qdtype);
          quantize_row(xr, K, scale, 1.0f, grid, out);
          row_scale[m] = scale;
          break;
        }
        case kTensor:
        case kStatic:
          quantize_row(xr, K, tensor_scale, 1.0f, grid, out);
          row_scale[m] = tensor_scale;
          break;
        case kGroup:
          row_scale[m] = quantize_groups(
              m, [&](int64_t g, int64_t n) { return finite_amax(xr + g, n); },
              [&](int64_t g, int64_t n, float scale) {
                quantize_row(xr + g, n, scale, group_scale ? 1.0f : scale, grid, out + g);
              });
          break;
      }
      if (out_bf16) {  // exact: an FP8 value (or NaN) keeps its top 16 bits
        uint16_t* row = out_bf16 + m * K;
        for (int64_t k = 0; k < K; ++k) {
          uint32_t bits;
          std::memcpy(&bits, out + k, sizeof bits);
          row[k] = static_cast<uint16_t>(bits >> 16);
        }
      }
    }
  });
}

// ------------------------------------------------------------------ linear

void scaled_linear_into(at::Tensor& out, const at::Tensor& x_in, const at::Tensor& packed,
                        const at::Tensor& weight_scale, const std::optional<at::Tensor>& bias,
                        const std::optional<at::Tensor>& input_scale, int64_t N, int64_t K,
                        at::IntArrayRef block_size, Activation mode, at::ScalarType activation_dtype) {
  const char* op = "qfp8::scaled_linear_cpu";
  TORCH_CHECK(x_in.device().is_cpu() && packed.device().is_cpu() && weight_scale.device().is_cpu(), op,
              ": all tensors must be on the CPU, got x on ", x_in.device(), ", packed_weight on ", packed.device(),
              ", weight_scale on ", weight_scale.device());
  TORCH_CHECK(x_in.dim() >= 1 && x_in.size(-1) == K, op, ": x has shape ", x_in.sizes(), " but in_features is ", K);
  const auto xdtype = x_in.scalar_type();
  TORCH_CHECK(xdtype == at::kFloat || xdtype == at::kBFloat16 || xdtype == at::kHalf, op,
              ": x must be float32, bfloat16 or float16, got ", xdtype);
  const int format = fp8_format(packed.scalar_type(), "qfp8::scaled_linear_cpu: packed_weight");
  const int64_t T = (N + kTileN - 1) / kTileN, Kp = (K + 1) & ~int64_t(1);
  TORCH_CHECK(N >= 1 && K >= 1 && packed.is_contiguous() && packed.numel() == T * (Kp / 2) * kGroupBytes, op,
              ": packed_weight has shape ", packed.sizes(), ", expected ", T * (Kp / 2) * kGroupBytes,
              " contiguous bytes for out_features=", N, ", in_features=", K, " (pack it with pack_weight_cpu)");
  TORCH_CHECK(weight_scale.scalar_type() == at::kFloat && weight_scale.is_contiguous(), op,
              ": weight_scale must be contiguous float32, got ", weight_scale.scalar_type());
  LinearProblem p{};
  p.bn = p.bk = p.scale_cols = 1;
  if (!block_size.empty()) {
    TORCH_CHECK(block_size.size() == 2 && block_size[0] > 0 && block_size[1] > 0, op,
                ": block_size must be [bn, bk] or [], got ", block_size);
    p.bn = block_size[0];
    p.bk = block_size[1];
    const int64_t rows = (N + p.bn - 1) / p.bn, cols = (K + p.bk - 1) / p.bk;
    TORCH_CHECK(weight_scale.dim() == 2 && weight_scale.size(0) == rows && weight_scale.size(1) == cols, op,
                ": block weight_scale has shape ", weight_scale.sizes(), ", expected [", rows, ", ", cols,
                "] for out_features=", N, ", in_features=", K, ", block_size=", block_size);
    p.scale_kind = kScaleBlock;
    p.scale_cols = cols;
  } else if (weight_scale.numel() == 1) {
    p.scale_kind = kScaleTensor;
  } else {
    TORCH_CHECK(weight_scale.numel() == N, op, ": weight_scale has shape ", weight_scale.sizes(),
                ", expected [1] or [", N, ", 1] for out_features=", N);
    p.scale_kind = kScaleChannel;
  }
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.numel() / K;
  TORCH_CHECK(out.scalar_type() == xdtype && out.is_contiguous() && out.numel() == M * N, op, ": out has shape ",
              out.sizes(), " and dtype ", out.scalar_type(), ", expected ", M * N, " contiguous ", xdtype);
  const float* input_scale_data = nullptr;
  if (mode == kStatic) {
    TORCH_CHECK(input_scale.has_value() && input_scale->numel() == 1 && input_scale->scalar_type() == at::kFloat,
                op, ": activation='static' needs a float32 input_scale of one element");
    input_scale_data = input_scale->data_ptr<float>();
    TORCH_CHECK_VALUE(std::isfinite(input_scale_data[0]) && input_scale_data[0] > 0.0f, op,
                      ": the static input_scale must be finite and > 0, got ", input_scale_data[0]);
  }
  if (mode != kNone) {
    TORCH_CHECK(activation_dtype == at::kFloat8_e4m3fn || activation_dtype == at::kFloat8_e4m3fnuz ||
                    activation_dtype == at::kFloat8_e5m2,
                op, ": activation_dtype must be an FP8 dtype, got ", activation_dtype);
  }
  std::vector<float> bias_buffer;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == N, op, ": bias has shape ", bias->sizes(), ", expected [", N, "]");
    TORCH_CHECK(bias->is_contiguous(), op, ": bias must be contiguous, got shape ", bias->sizes(), " with strides ",
                bias->strides(), "; pass bias.contiguous()");
    const auto bdtype = bias->scalar_type();
    if (bdtype == at::kFloat) {
      p.bias = bias->data_ptr<float>();
    } else {
      TORCH_CHECK(bdtype == at::kBFloat16 || bdtype == at::kHalf, op,
                  ": bias must be float32, bfloat16 or float16, got ", bdtype);
      bias_buffer.resize(N);
      for (int64_t n = 0; n < N; ++n)
        bias_buffer[n] = bdtype == at::kBFloat16 ? static_cast<float>(bias->data_ptr<c10::BFloat16>()[n])
                                                 : static_cast<float>(bias->data_ptr<c10::Half>()[n]);
      p.bias = bias_buffer.data();
    }
  }
  if (M == 0) return;

  p.M = M;
  p.K = K;
  p.Kp = Kp;
  p.ldx = Kp;
  p.w = static_cast<const uint8_t*>(packed.data_ptr());
  p.N = N;
  p.format = format;
  p.format_factor = format_factor(format);
  p.scale = weight_scale.data_ptr<float>();
  // Row-scaled W8A8 (token, token-mse, tensor, static) multiplies FP8 codes
  // by FP8 codes (up to 448 x 448 per term) and applies the weight scale
  // before the row's activation scale: a weight scale above about 1e31
  // overflowed those float32 sums to Inf/NaN where the result is finite
  // (weights of 3e35 times activations of 3e-5, measured). Such scales are
  // taken down by a power of two, exactly, and the row scales up by it
  // after the activations are quantized. Group mode is the mirror case
  // (group_shift below).
  constexpr int kLargestKept = 32;  // scales up to 2^32 stay as they are (the same bits as before)
  // The power of two that takes `largest` down to 2^32, or 0.
  auto excess = [](float largest) {
    return std::isfinite(largest) && std::ilogb(largest) > kLargestKept ? std::ilogb(largest) - kLargestKept : 0;
  };
  const bool row_scaled = mode == kToken || mode == kTokenMse || mode == kTensor || mode == kStatic;
  const int scale_shift =
      row_scaled ? excess(*std::max_element(p.scale, p.scale + weight_scale.numel())) : 0;
  std::vector<float> shifted_scale;
  if (scale_shift) {
    shifted_scale.resize(weight_scale.numel());
    for (size_t i = 0; i < shifted_scale.size(); ++i) shifted_scale[i] = std::ldexp(p.scale[i], -scale_shift);
    p.scale = shifted_scale.data();
  }
  p.out = out.data_ptr();
  p.out_dtype = xdtype == at::kFloat ? kOutFloat : (xdtype == at::kBFloat16 ? kOutBFloat16 : kOutHalf);
  p.ldo = N;

  const IsaEntry& isa = current_isa();
  std::shared_ptr<const void> prepared;
  // An ISA that prepares its own activations may take bf16 x as it is
  // (kernel.h); when it declines, x goes the float32 way below (and the ISA
  // is not asked again: it would decline for the same reason).
  bool declined = false;
  std::vector<float> row_scale, group_scale;
  // Group scales are the mirror case: the tiles apply them to each
  // segment's sums (or they sit in the float32 values) before a channel
  // weight scale, so a row whose largest group scale is above 2^32
  // (activations of 1e35 times weights of 1e-3, measured) has its group
  // scales (or values) taken down by a power of two, and a row scale of
  // that power puts it back at the end. `data` holds M rows of `stride`
  // (group scales or values); row_scale holds each row's largest group
  // scale (prepare_activations) and becomes the row scale.
  auto group_shift = [&](float* data, int64_t stride) {
    bool any = false;
    for (int64_t m = 0; m < M; ++m) {
      const int e = excess(row_scale[m]);
      row_scale[m] = std::ldexp(1.0f, e);
      if (!e) continue;
      any = true;
      for (int64_t i = 0; i < stride; ++i) data[m * stride + i] = std::ldexp(data[m * stride + i], -e);
    }
    p.row_scale = any ? row_scale.data() : nullptr;
  };
  ScratchBuffer<float> x_buffer;  // not zeroed either: all written
  // Outlives the tiles (the ISA may read it in place). In huge pages and not
  // zeroed, as every value is written: a W8A8 2048 x 14336 call spent 78 ms
  // preparing its activations with a zeroed vector, 31 ms so.
  ScratchBuffer<uint16_t> x_quantized;
  // prepare_activations on x in its dtype, into a float32 buffer or as bf16.
  auto prepare_x = [&](float* buffer, uint16_t* bf16, float* groups) {
    if (xdtype == at::kFloat) {
      prepare_activations(x.data_ptr<float>(), M, K, Kp, mode, activation_dtype, input_scale_data, buffer,
                          row_scale.data(), bf16, groups);
    } else if (xdtype == at::kBFloat16) {
      prepare_activations(x.data_ptr<c10::BFloat16>(), M, K, Kp, mode, activation_dtype, input_scale_data, buffer,
                          row_scale.data(), bf16, groups);
    } else {
      prepare_activations(x.data_ptr<c10::Half>(), M, K, Kp, mode, activation_dtype, input_scale_data, buffer,
                          row_scale.data(), bf16, groups);
    }
  };
  const uint16_t* x_bf16 = nullptr;
  if (isa.prepare && mode == kNone && xdtype == at::kBFloat16) {
    x_bf16 = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
  } else if (isa.prepare && mode != kNone) {
    // Quantized activations are FP8 values, exact in bf16: handed over as
    // bf16 (no float32 buffer, no split into parts). Group scales go with
    // them, for the tiles to apply to each group's partial sums (in the
    // values they would need three bf16 parts). (A block scale with an odd
    // k-block makes the ISA decline: x is then quantized again below, into
    // float32, with the group scales in the values.)
    x_quantized = ScratchBuffer<uint16_t>(M * K);
    TORCH_CHECK(x_quantized.get() != nullptr, op, ": could not allocate ", M * K * 2, " bytes for the quantized activations");
    row_scale.resize(M);
    if (mode == kGroup) group_scale.resize(M * ((K + kActivationGroup - 1) / kActivationGroup));
    prepare_x(nullptr, x_quantized.get(), mode == kGroup ? group_scale.data() : nullptr);
    x_bf16 = x_quantized.get();
    if (mode == kGroup) group_shift(group_scale.data(), (K + kActivationGroup - 1) / kActivationGroup);
  }
  if (x_bf16) {
    p.x_bf16 = x_bf16;
    prepared = isa.prepare(p);
    p.x_bf16 = nullptr;
    declined = !prepared;
    if (prepared && mode == kGroup) {
      p.group_scale = group_scale.data();
      p.group_cols = (K + kActivationGroup - 1) / kActivationGroup;
    } else if (prepared && mode != kNone) {
      p.row_scale = row_scale.data();
    }
  }
  // Activations as float32 [M][Kp]: x itself when it already is float32
  // with an even K, else converted (or quantized) into a buffer.
  if (prepared) {
    p.x = nullptr;
  } else if (mode == kNone && xdtype == at::kFloat && K == Kp) {
    p.x = x.data_ptr<float>();
  } else {
    x_buffer = ScratchBuffer<float>(M * Kp);
    TORCH_CHECK(x_buffer.get() != nullptr, op, ": could not allocate ", M * Kp * 4, " bytes for the activations");
    if (mode != kNone) row_scale.resize(M);
    prepare_x(x_buffer.get(), nullptr, nullptr);
    p.x = x_buffer.get();
    if (mode == kGroup) group_shift(x_buffer.get(), Kp);
    if (mode != kNone && mode != kGroup) p.row_scale = row_scale.data();
  }
  if (isa.prepare && !prepared && !declined) prepared = isa.prepare(p);
  p.prepared = prepared.get();
  if (scale_shift && p.row_scale) {
    for (auto& r : row_scale) r = std::ldexp(r, scale_shift);
  }
  const LinearTilesFn fn = isa.fn;
  // At least ~256K multiply-adds per chunk so that small layers run inline.
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 18) / std::max<int64_t>(1, M * Kp * kTileN));
  p.threads = at::in_parallel_region() ? 1 : std::min<int64_t>(at::get_num_threads(), (T + grain - 1) / grain);
  at::parallel_for(0, T, grain, [&](int64_t begin, int64_t end) { fn(p, begin, end); });
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

// AOTInductor's proxy executor (torch 2.13) hands an op an empty list
// argument (block_size = [] of a layer without block scales, the experts'
// input_scales = [] without static scales) as None, which unboxing the
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

// A byte buffer for a packed weight (huge_page_alloc). A matrix-vector product
// streams the whole weight once per call; with 4 KiB pages every page costs a
// TLB miss and the hardware prefetchers stop at each page boundary. Only the
// whole 2 MiB pages are advised, so the tail never faults in a page past the
// data. Where THP is disabled the advice is ignored and the buffer is an
// ordinary aligned allocation.
at::Tensor empty_hugepage(int64_t nbytes) {
  TORCH_CHECK(nbytes >= 0, "qfp8::_cpu_empty_hugepage: nbytes must be non-negative, got ", nbytes);
  void* data = huge_page_alloc(static_cast<size_t>(nbytes));
  TORCH_CHECK(data != nullptr, "qfp8::_cpu_empty_hugepage: could not allocate ", nbytes, " bytes");
  return at::from_blob(data, {nbytes}, [](void* p) { std::free(p); }, at::TensorOptions().dtype(at::kByte));
}

// Flat index of the first NaN/Inf code of an FP8 tensor, or -1: e4m3fn
// codes 0x7F/0xFF are NaN, e5m2 codes with all exponent bits set are Inf or
// NaN, e4m3fnuz code 0x80 is NaN. A checkpoint's weights are scanned on load,
// so the scan runs at memory speed: each 64 KiB block is first tested as a
// whole (a loop the compiler vectorizes), and only a block that holds such a
// code is searched for its position.
int64_t fp8_first_nonfinite(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu(), "qfp8::_cpu_fp8_first_nonfinite: the tensor must be on the CPU, got ",
              weight.device());
  const int format = fp8_format(weight.scalar_type(), "qfp8::_cpu_fp8_first_nonfinite: the tensor");
  const at::Tensor w = weight.contiguous();
  const uint8_t* bytes = static_cast<const uint8_t*>(w.data_ptr());
  const int64_t n = w.numel();
  const uint8_t mask = format == kE4M3FN ? 0x7F : (format == kE5M2 ? 0x7C : 0xFF);
  const uint8_t code = format == kE4M3FN ? 0x7F : (format == kE5M2 ? 0x7C : 0x80);
  constexpr int64_t kBlock = int64_t{1} << 16;
  for (int64_t start = 0; start < n; start += kBlock) {
    const int64_t end = std::min(n, start + kBlock);
    uint8_t found = 0;
    for (int64_t i = start; i < end; ++i) found |= static_cast<uint8_t>((bytes[i] & mask) == code);
    if (!found) continue;
    for (int64_t i = start; i < end; ++i)
      if ((bytes[i] & mask) == code) return i;
  }
  return -1;
}

}  // namespace
}  // namespace qfp8

// Private helpers; the public schemas live in qfp8/library/cpu.py.
TORCH_LIBRARY_FRAGMENT(qfp8, m) {
  m.def("_cpu_usable_isas() -> str[]", &qfp8::usable_isas);
  m.def("_cpu_compiled_isas() -> str[]", &qfp8::compiled_isas);
  m.def("_cpu_emulated_isas() -> str[]", &qfp8::emulated_isas);
  m.def("_cpu_set_isa(str isa) -> ()", &qfp8::set_isa);
  m.def("_cpu_get_isa() -> str", &qfp8::get_isa);
  m.def("_cpu_empty_hugepage(int nbytes) -> Tensor", &qfp8::empty_hugepage);
  m.def("_cpu_fp8_first_nonfinite(Tensor weight) -> int", &qfp8::fp8_first_nonfinite);
  m.def(
      "_scaled_linear_cpu_into(Tensor(a!) out, Tensor x, Tensor packed_weight, Tensor weight_scale, Tensor? bias, "
      "Tensor? input_scale, int out_features, int in_features, int[] block_size, str activation, "
      "ScalarType activation_dtype) -> ()");
}

TORCH_LIBRARY_IMPL(qfp8, CPU, m) {
  m.impl("scaled_linear_cpu", torch::CppFunction::makeFromBoxedFunction<&qfp8::scaled_linear_cpu_boxed>());
  m.impl("_scaled_linear_cpu_into", &qfp8::scaled_linear_cpu_into);
}

// ------------------------------------------------------------ eager entry
//
// qfp8._C.scaled_linear_cpu_eager(x, packed_weight, weight_scale, bias,
// input_scale, out_features, in_features, block_size, activation,
// activation_dtype) computes what torch.ops.qfp8.scaled_linear_cpu computes,
// for QLinear's eager fast path. A call through torch.ops boxes its ten
// arguments into IValues and back (about 7 us here, as much as the kernel of
// a 576 x 192 layer at M = 1); this entry parses them itself and calls the
// kernel directly. Whenever the dispatcher has work to do, it hands the
// call, unchanged, to the registered fallback (the op's OpOverload): a
// tensor subclass, a __torch_function__ or dispatch mode, functorch or any
// other dispatch key included in TLS, autograd (grad mode on and an input
// requiring grad), a profiler or other RecordFunction callback, or a tensor
// that is not a plain strided CPU tensor.

namespace qfp8 {
namespace {

PyObject* g_eager_fallback = nullptr;
PyObject* g_parameter_type = nullptr;  // torch.nn.Parameter, whose __torch_function__ is disabled

// A plain CPU tensor: exactly torch.Tensor (or torch.nn.Parameter for the
// bias), so no __torch_function__ override, and its dispatch keys are the
// CPU backend's alone, besides autograd's (absent in inference tensors) and
// autocast's (which the op falls through).
bool plain_cpu_tensor(PyObject* obj, bool may_be_parameter) {
  if (!(THPVariable_CheckExact(obj) ||
        (may_be_parameter && reinterpret_cast<PyObject*>(Py_TYPE(obj)) == g_parameter_type)))
    return false;
  const at::Tensor& t = THPVariable_Unpack(obj);
  const c10::DispatchKeySet keys =
      t.key_set() - c10::autograd_dispatch_keyset_with_ADInplaceOrView - c10::autocast_dispatch_keyset;
  return keys == c10::DispatchKeySet(c10::DispatchKey::CPU) && t.layout() == at::kStrided;
}

bool parse_int(PyObject* obj, int64_t& value) {
  if (!PyLong_Check(obj)) return false;
  value = PyLong_AsLongLong(obj);
  return !(value == -1 && PyErr_Occurred());
}

// Whether x carries a forward-mode tangent (a dual tensor) at one of the first levels; forward AD and
// torch.func.jvp open levels from 0 and rarely nest deeply.
bool has_forward_grad(const at::Tensor& x) {
  for (uint64_t level = 0; level < 4; ++level) {
    if (x._fw_grad(level).defined()) return true;
  }
  return false;
}

PyObject* scaled_linear_cpu_eager(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (g_eager_fallback == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "qfp8._C.scaled_linear_cpu_eager: no fallback set");
    return nullptr;
  }
  auto fallback = [&]() { return PyObject_Vectorcall(g_eager_fallback, args, static_cast<size_t>(nargs), nullptr); };
  if (nargs != 10) return fallback();
  PyObject *x = args[0], *packed = args[1], *scale = args[2], *bias = args[3], *input_scale = args[4];
  if (!plain_cpu_tensor(x, false) || !plain_cpu_tensor(packed, false) || !plain_cpu_tensor(scale, false) ||
      (bias != Py_None && !plain_cpu_tensor(bias, true)) ||
      (input_scale != Py_None && !plain_cpu_tensor(input_scale, false)))
    return fallback();
  if (at::impl::torch_function_mode_enabled() || c10::impl::dispatch_mode_enabled() ||
      !(c10::impl::tls_local_dispatch_key_set().included_ - c10::default_included_set).empty() || at::hasCallbacks())
    return fallback();
  const at::Tensor& xt = THPVariable_Unpack(x);
  std::optional<at::Tensor> bias_t, input_scale_t;
  if (bias != Py_None) bias_t = THPVariable_Unpack(bias);
  if (input_scale != Py_None) input_scale_t = THPVariable_Unpack(input_scale);
  if (c10::GradMode::is_enabled() && (xt.requires_grad() || (bias_t && bias_t->requires_grad()))) return fallback();
  if (has_forward_grad(xt)) return fallback();  // the op's Autograd kernel refuses forward-mode AD
  int64_t n = 0, k = 0;
  PyObject* block = args[7];
  if (!parse_int(args[5], n) || !parse_int(args[6], k) || !(PyList_Check(block) || PyTuple_Check(block)) ||
      !PyUnicode_Check(args[8]) || !THPDtype_Check(args[9])) {
    PyErr_Clear();
    return fallback();
  }
  std::vector<int64_t> block_size(static_cast<size_t>(PySequence_Fast_GET_SIZE(block)));
  for (size_t i = 0; i < block_size.size(); ++i) {
    if (!parse_int(PySequence_Fast_GET_ITEM(block, i), block_size[i])) {
      PyErr_Clear();
      return fallback();
    }
  }
  Py_ssize_t activation_len = 0;
  const char* activation = PyUnicode_AsUTF8AndSize(args[8], &activation_len);
  if (activation == nullptr) return nullptr;
  const at::ScalarType activation_dtype = reinterpret_cast<THPDtype*>(args[9])->scalar_type;
  at::Tensor out;
  {
    pybind11::gil_scoped_release no_gil;
    out = scaled_linear_cpu(xt, THPVariable_Unpack(packed), THPVariable_Unpack(scale), bias_t, input_scale_t, n, k,
                            block_size, c10::string_view(activation, static_cast<size_t>(activation_len)),
                            activation_dtype);
  }
  return THPVariable_Wrap(std::move(out));
  END_HANDLE_TH_ERRORS
}

PyObject* set_eager_fallback(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2 || !PyCallable_Check(args[0]) || !PyType_Check(args[1])) {
    PyErr_SetString(PyExc_TypeError,
                    "qfp8._C._set_eager_fallback(fallback, parameter_type): expected a callable and a type");
    return nullptr;
  }
  Py_INCREF(args[0]);
  Py_INCREF(args[1]);
  Py_XDECREF(g_eager_fallback);
  Py_XDECREF(g_parameter_type);
  g_eager_fallback = args[0];
  g_parameter_type = args[1];
  Py_RETURN_NONE;
}

// ------------------------------------------------------ Autograd kernel
//
// qfp8::scaled_linear_cpu and qfp8::experts_linear get gradients for their
// argument `x` (and `bias`) from Python formulas (qfp8.library.autograd,
// ExpertsLinear), which QLinear and the MoE layer apply themselves. A graph
// torch.export traced calls the ops directly, though, and so can a user. This
// kernel, on the ops' Autograd key, lets a call that needs no gradient go on
// to the op's kernel after one check; a call that needs one (grad mode on, x
// or the bias requiring grad) goes to the Python callable registered for the
// op, which applies the formula. Only those calls pay for entering Python.

std::unordered_map<std::string, PyObject*> g_differentiable;  // op name -> callable taking the op's arguments

PyObject* set_differentiable(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2 || !PyUnicode_Check(args[0]) || !PyCallable_Check(args[1])) {
    PyErr_SetString(PyExc_TypeError, "qfp8._C._set_differentiable(op_name, fn): expected a str and a callable");
    return nullptr;
  }
  const char* name = PyUnicode_AsUTF8(args[0]);
  if (name == nullptr) return nullptr;
  Py_INCREF(args[1]);
  PyObject*& slot = g_differentiable[name];
  Py_XDECREF(slot);
  slot = args[1];
  Py_RETURN_NONE;
}

// A new reference to the Python value of an op argument (the types these ops' schemas use), or nullptr with
// the Python error set.
PyObject* argument_to_python(const c10::IValue& value, const c10::Argument& argument) {
  if (value.isNone()) Py_RETURN_NONE;
  if (value.isTensor()) return THPVariable_Wrap(value.toTensor());
  if (value.isString()) {
    const std::string& text = value.toStringRef();
    return PyUnicode_FromStringAndSize(text.data(), static_cast<Py_ssize_t>(text.size()));
  }
  if (value.isInt() && argument.real_type()->kind() == c10::TypeKind::ScalarTypeType) {
    PyObject* dtype = reinterpret_cast<PyObject*>(torch::getTHPDtype(static_cast<at::ScalarType>(value.toInt())));
    Py_INCREF(dtype);
    return dtype;
  }
  if (value.isInt()) return PyLong_FromLongLong(value.toInt());
  if (value.isDouble()) return PyFloat_FromDouble(value.toDouble());
  if (value.isBool()) return PyBool_FromLong(value.toBool());
  const bool tensors = value.isTensorList();
  if (!tensors && !value.isIntList()) {
    return PyErr_Format(PyExc_TypeError, "qfp8: the gradient path cannot pass argument '%s' (%s) to Python",
                        argument.name().c_str(), value.tagKind().c_str());
  }
  const size_t size = tensors ? value.toTensorList().size() : value.toIntList().size();
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(size));
  for (size_t i = 0; list != nullptr && i < size; ++i) {
    PyObject* item = tensors ? THPVariable_Wrap(value.toTensorList().get(i))
                             : PyLong_FromLongLong(value.toIntList().get(i));
    if (item == nullptr) {
      Py_CLEAR(list);
      break;
    }
    PyList_SET_ITEM(list, static_cast<Py_ssize_t>(i), item);
  }
  return list;
}

void differentiable_autograd(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const c10::FunctionSchema& schema = op.schema();
  const size_t count = schema.arguments().size();
  const size_t first = stack->size() - count;
  // The differentiable arguments: x, and the linear op's bias.
  const c10::IValue& x = (*stack)[first + static_cast<size_t>(schema.argumentIndexWithName("x").value_or(0))];
  const std::optional<int> bias_index = schema.argumentIndexWithName("bias");
  const c10::IValue* bias = bias_index ? &(*stack)[first + static_cast<size_t>(*bias_index)] : nullptr;
  auto requires_grad = [](const c10::IValue* v) {
    return v != nullptr && v->isTensor() && v->toTensor().requires_grad();
  };
  TORCH_CHECK_NOT_IMPLEMENTED(!(x.isTensor() && has_forward_grad(x.toTensor())), schema.name(),
                              ": forward-mode AD (torch.autograd.forward_ad, torch.func.jvp) is not supported by "
                              "qfp8's kernels; the tangent would be dropped");
  if (!(c10::GradMode::is_enabled() && (requires_grad(&x) || requires_grad(bias)))) {
    // The kernels below take a None list themselves (the CPU one in scaled_linear_cpu_boxed, the experts'
    // Python one in experts_linear_impl).
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    op.callBoxed(stack);
    return;
  }
  empty_lists_from_none(schema, stack);  // the Python path reads the lists
  pybind11::gil_scoped_acquire gil;
  const auto found = g_differentiable.find(schema.name());
  TORCH_CHECK(found != g_differentiable.end(), schema.name(), ": no gradient path is registered (import qfp8)");
  std::vector<PyObject*> args(count, nullptr);
  bool complete = true;
  for (size_t i = 0; i < count && complete; ++i) {
    args[i] = argument_to_python((*stack)[first + i], schema.arguments()[i]);
    complete = args[i] != nullptr;
  }
  PyObject* result = complete ? PyObject_Vectorcall(found->second, args.data(), count, nullptr) : nullptr;
  for (PyObject* arg : args) Py_XDECREF(arg);
  if (result == nullptr) throw python_error();
  const bool tensor = THPVariable_Check(result);
  at::Tensor out = tensor ? THPVariable_Unpack(result) : at::Tensor();
  Py_DECREF(result);
  TORCH_CHECK(tensor, schema.name(), ": the gradient path returned no tensor");
  torch::jit::drop(*stack, count);
  stack->emplace_back(std::move(out));
}

PyMethodDef kMethods[] = {
    {"scaled_linear_cpu_eager", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(scaled_linear_cpu_eager)),
     METH_FASTCALL,
     "torch.ops.qfp8.scaled_linear_cpu without the dispatcher's argument boxing, for plain CPU tensors in eager "
     "mode; any other call goes to the fallback set by _set_eager_fallback."},
    {"_set_eager_fallback", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(set_eager_fallback)),
     METH_FASTCALL, "Sets the callable that takes every call the eager entry does not, and torch.nn.Parameter."},
    {"_set_differentiable", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(set_differentiable)),
     METH_FASTCALL, "Sets the callable that takes the calls of an op (by name) that need a gradient."},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace
}  // namespace qfp8

TORCH_LIBRARY_IMPL(qfp8, Autograd, m) {
  for (const char* name : {"scaled_linear_cpu", "experts_linear"}) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&qfp8::differentiable_autograd>());
  }
}

// Importing the module runs the registrations above.
static struct PyModuleDef qfp8_module = {PyModuleDef_HEAD_INIT, "_C",
                                         "qfp8 CPU kernels, registered as torch.ops.qfp8.*", -1, qfp8::kMethods};

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&qfp8_module); }
