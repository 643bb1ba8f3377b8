// Activations of the CPU linear op, turned into what the kernels take: x
// converted to float32, or quantized to FP8 (per token, per tensor, 1 x 128
// groups, a static scale, or the token-mse scale search) and held as the
// exact FP8 values in float32 or bf16, with the scales beside them.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "bindings.h"
#include "kernel.h"

namespace qfp8 {

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

namespace {

// Reads element i of a float32/bfloat16/float16 buffer as float32.
template <typename T>
inline float load_float(const T* data, int64_t i) {
  return static_cast<float>(data[i]);
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
  const GridErrorFn grid_error = current_isa().helpers->grid_error;
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

// One call's rows of x (T: float, c10::BFloat16 or c10::Half) and what
// their preparation shares (see prepare_activations in bindings.h).
template <typename T>
struct RowPreparer {
  const T* x;
  int64_t M, K, Kp;
  Activation mode;
  at::ScalarType qdtype;
  float* buffer;
  float* row_scale;
  uint16_t* out_bf16;
  float* group_scale;
  float qmax;
  const IsaHelpers& helpers;
  Fp8Grid grid;
  int64_t grain;
  static constexpr int kind =
      std::is_same_v<T, float> ? kRowFloat : (std::is_same_v<T, c10::BFloat16> ? kRowBFloat16 : kRowHalf);

  // Row m of x as float32: x itself for float32, else converted into `into`.
  const float* row_as_float(int64_t m, float* into) const {
    const T* xr = x + m * K;
    if constexpr (std::is_same_v<T, float>) {
      return xr;
    } else {
      for (int64_t k = 0; k < K; ++k) into[k] = load_float(xr, k);
      return into;
    }
  }

  // kGroup: row m's groups of kActivationGroup values, each quantized
  // (quantize_group) with the scale of its largest finite |x| (group_amax),
  // which goes to group_scale when given. Returns the row's largest group
  // scale (scaled_linear_into's overflow guard).
  template <typename GroupAmax, typename QuantizeGroup>
  float quantize_groups(int64_t m, GroupAmax&& group_amax, QuantizeGroup&& quantize_group) const {
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
  }

  // The scale of kTensor (from the largest finite |x|) or kStatic; 1 otherwise.
  float tensor_scale(bool direct, const float* input_scale) const {
    if (mode == kStatic) return input_scale[0];
    if (mode != kTensor) return 1.0f;
    // max is exact in any order: the same scale for every thread count
    const float amax = at::parallel_reduce(
        0, M, grain, 0.0f,
        [&](int64_t begin, int64_t end, float acc) {
          std::vector<float> row(direct ? 0 : K);
          for (int64_t m = begin; m < end; ++m)
            acc = std::max(acc, direct ? helpers.finite_amax_row(x + m * K, kind, K)
                                       : helpers.finite_amax(row_as_float(m, row.data()), K));
          return acc;
        },
        [](float a, float b) { return std::max(a, b); });
    return scale_from_amax(amax, qmax);
  }

  // The AVX512 row helpers read x as it is and write the bf16 bits at once:
  // one pass for the amax and one for the values, no float32 copy of a row.
  void quantize_direct(float tensor_scale) const {
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
  }

  // Row m (read in float32 into `out`, [Kp]) converted or quantized in place.
  void prepare_row(int64_t m, float* out, float* finite, float tensor_scale) const {
    for (int64_t k = K; k < Kp; ++k) out[k] = 0.0f;
    const float* xr = row_as_float(m, out);  // converted in place: each step reads a value before it writes it
    switch (mode) {
      case kNone:
        if (xr != out) std::memcpy(out, xr, K * sizeof(float));
        break;
      case kToken: {
        const float scale = scale_from_amax(helpers.finite_amax(xr, K), qmax);
        helpers.quantize_row(xr, K, scale, 1.0f, grid, out);
        row_scale[m] = scale;
        break;
      }
      case kTokenMse: {
        // The search sees the non-finite values as zero; the quantization
        // (from x again) turns them into NaN.
        for (int64_t k = 0; k < K; ++k) finite[k] = std::isfinite(xr[k]) ? xr[k] : 0.0f;
        const float scale = token_mse_scale(finite, K, helpers.finite_amax(finite, K), qmax, qdtype);
        helpers.quantize_row(xr, K, scale, 1.0f, grid, out);
        row_scale[m] = scale;
        break;
      }
      case kTensor:
      case kStatic:
        helpers.quantize_row(xr, K, tensor_scale, 1.0f, grid, out);
        row_scale[m] = tensor_scale;
        break;
      case kGroup:
        row_scale[m] = quantize_groups(
            m, [&](int64_t g, int64_t n) { return helpers.finite_amax(xr + g, n); },
            [&](int64_t g, int64_t n, float scale) {
              helpers.quantize_row(xr + g, n, scale, group_scale ? 1.0f : scale, grid, out + g);
            });
        break;
    }
  }

  // Every row through float32: into buffer, or (out_bf16) each row's FP8
  // values as bf16 bits, exact (an FP8 value or NaN keeps its top 16 bits).
  void prepare_through_float(float tensor_scale) const {
    at::parallel_for(0, M, grain, [&](int64_t begin, int64_t end) {
      std::vector<float> finite(mode == kTokenMse ? K : 0);  // token-mse: a row with its non-finite values zeroed
      std::vector<float> scratch(out_bf16 ? Kp : 0);        // bf16 output: each row in float32 first
      for (int64_t m = begin; m < end; ++m) {
        float* out = out_bf16 ? scratch.data() : buffer + m * Kp;
        prepare_row(m, out, finite.data(), tensor_scale);
        if (!out_bf16) continue;
        uint16_t* row = out_bf16 + m * K;
        for (int64_t k = 0; k < K; ++k) {
          uint32_t bits;
          std::memcpy(&bits, out + k, sizeof bits);
          row[k] = static_cast<uint16_t>(bits >> 16);
        }
      }
    });
  }
};

float fp8_max(at::ScalarType qdtype) {
  if (qdtype == at::kFloat8_e4m3fnuz) return 240.0f;
  if (qdtype == at::kFloat8_e5m2) return 57344.0f;
  return 448.0f;
}

}  // namespace

template <typename T>
void prepare_activations(const T* x, int64_t M, int64_t K, int64_t Kp, Activation mode, at::ScalarType qdtype,
                         const float* input_scale, float* buffer, float* row_scale, uint16_t* out_bf16,
                         float* group_scale) {
  const float qmax = fp8_max(qdtype);
  const RowPreparer<T> rows{x,         M,        K,           Kp,   mode,
                            qdtype,    buffer,   row_scale,   out_bf16, group_scale,
                            qmax,      *current_isa().helpers, fp8_grid(qdtype, qmax),
                            std::max<int64_t>(1, 32768 / std::max<int64_t>(K, 1))};
  const bool direct = out_bf16 && rows.helpers.finite_amax_row &&
                      (mode == kToken || mode == kTensor || mode == kStatic || (mode == kGroup && group_scale));
  const float tensor_scale = rows.tensor_scale(direct, input_scale);
  if (direct) {
    rows.quantize_direct(tensor_scale);
  } else {
    rows.prepare_through_float(tensor_scale);
  }
}

template <typename T>
bool quantize_patches(const T* x, const PatchRows& patches, int64_t M, Activation mode, at::ScalarType qdtype,
                      const float* input_scale, float* row_scale, uint16_t* out_bf16) {
  const IsaHelpers& helpers = *current_isa().helpers;
  if (!helpers.finite_amax_row || !(mode == kToken || mode == kTensor || mode == kStatic)) return false;
  constexpr int kind = RowPreparer<T>::kind;
  const float qmax = fp8_max(qdtype);
  const Fp8Grid grid = fp8_grid(qdtype, qmax);
  const int64_t L = patches.segment_length, K = patches.segments * L;
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(K, 1));
  const auto run = [&](int64_t m, int64_t s) { return x + patches.row_offset[m] + patches.segment_offset[s]; };
  const auto row_amax = [&](int64_t m) {  // a max: the same in any order
    float amax = 0.0f;
    for (int64_t s = 0; s < patches.segments; ++s) amax = std::max(amax, helpers.finite_amax_row(run(m, s), kind, L));
    return amax;
  };
  float tensor_scale = mode == kStatic ? input_scale[0] : 1.0f;
  if (mode == kTensor) {
    const float amax = at::parallel_reduce(
        0, M, grain, 0.0f,
        [&](int64_t begin, int64_t end, float acc) {
          for (int64_t m = begin; m < end; ++m) acc = std::max(acc, row_amax(m));
          return acc;
        },
        [](float a, float b) { return std::max(a, b); });
    tensor_scale = scale_from_amax(amax, qmax);
  }
  at::parallel_for(0, M, grain, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float scale = mode == kToken ? scale_from_amax(row_amax(m), qmax) : tensor_scale;
      for (int64_t s = 0; s < patches.segments; ++s) {
        helpers.quantize_row_bf16(run(m, s), kind, L, scale, grid, out_bf16 + m * K + s * L);
      }
      row_scale[m] = scale;
    }
  });
  return true;
}

template bool quantize_patches<float>(const float*, const PatchRows&, int64_t, Activation, at::ScalarType,
                                      const float*, float*, uint16_t*);
template bool quantize_patches<c10::BFloat16>(const c10::BFloat16*, const PatchRows&, int64_t, Activation,
                                              at::ScalarType, const float*, float*, uint16_t*);
template bool quantize_patches<c10::Half>(const c10::Half*, const PatchRows&, int64_t, Activation, at::ScalarType,
                                          const float*, float*, uint16_t*);

template void prepare_activations<float>(const float*, int64_t, int64_t, int64_t, Activation, at::ScalarType,
                                         const float*, float*, float*, uint16_t*, float*);
template void prepare_activations<c10::BFloat16>(const c10::BFloat16*, int64_t, int64_t, int64_t, Activation,
                                                 at::ScalarType, const float*, float*, float*, uint16_t*, float*);
template void prepare_activations<c10::Half>(const c10::Half*, int64_t, int64_t, int64_t, Activation, at::ScalarType,
                                             const float*, float*, float*, uint16_t*, float*);

}  // namespace qfp8
