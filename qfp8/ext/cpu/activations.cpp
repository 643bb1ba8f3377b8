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

}  // namespace

template <typename T>
void prepare_activations(const T* x, int64_t M, int64_t K, int64_t Kp, Activation mode, at::ScalarType qdtype,
                         const float* input_scale, float* buffer, float* row_scale, uint16_t* out_bf16,
                         float* group_scale) {
  float qmax = 448.0f;
  if (qdtype == at::kFloat8_e4m3fnuz) qmax = 240.0f;
  if (qdtype == at::kFloat8_e5m2) qmax = 57344.0f;
  const IsaHelpers& helpers = *current_isa().helpers;
  const QuantizeRowFn quantize_row = helpers.quantize_row;
  const FiniteAmaxFn finite_amax = helpers.finite_amax;
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

template void prepare_activations<float>(const float*, int64_t, int64_t, int64_t, Activation, at::ScalarType,
                                         const float*, float*, float*, uint16_t*, float*);
template void prepare_activations<c10::BFloat16>(const c10::BFloat16*, int64_t, int64_t, int64_t, Activation,
                                                 at::ScalarType, const float*, float*, float*, uint16_t*, float*);
template void prepare_activations<c10::Half>(const c10::Half*, int64_t, int64_t, int64_t, Activation, at::ScalarType,
                                             const float*, float*, float*, uint16_t*, float*);

}  // namespace qfp8
