// Portable scalar kernel: the fallback for any CPU (and any architecture).
//
// Layout: the packed tiles of kernel.h, [T][Kp/2][64] bytes.
// Arithmetic: each FP8 byte is decoded through a 256-entry float table of its
// exact value; the weight scale (times nothing: the table holds true values)
// is folded per lane for block scales and applied per channel at the end
// otherwise; 64 float32 lane accumulators per row, added pairwise per channel.
// Compiled with the default flags of the build.
#include <cmath>
#include <vector>

#include "attention_impl.h"
#include "kernel.h"

namespace qfp8 {
namespace {

// Exact value of an FP8 code; built once per format (a table, not a decoder
// in the inner loop).
struct DecodeTable {
  float value[3][256];
  DecodeTable() {
    for (int b = 0; b < 256; ++b) {
      const int sign = b >> 7;
      // e4m3fn / e4m3fnuz: 4 exponent bits, 3 mantissa bits, bias 7 / 8.
      for (int f = 0; f < 3; f += 2) {
        const int e = (b >> 3) & 15, m = b & 7, bias = f == 0 ? 7 : 8;
        float v = e == 0 ? std::ldexp(static_cast<float>(m), 1 - bias - 3)
                         : std::ldexp(static_cast<float>(8 + m), e - bias - 3);
        if (f == 0 && (b & 0x7f) == 0x7f) v = NAN;
        if (f == 2 && b == 0x80) v = NAN;
        value[f][b] = sign && !(f == 2 && b == 0x80) ? -v : v;
      }
      // e5m2: 5 exponent bits, 2 mantissa bits, bias 15, IEEE Inf/NaN.
      const int e = (b >> 2) & 31, m = b & 3;
      float v = e == 0 ? std::ldexp(static_cast<float>(m), -16) : std::ldexp(static_cast<float>(4 + m), e - 17);
      if (e == 31) v = m ? NAN : INFINITY;
      value[1][b] = sign ? -v : v;
    }
  }
};

const DecodeTable& decode_table() {
  static const DecodeTable table;
  return table;
}

}  // namespace

void linear_tiles_scalar(const LinearProblem& p, int64_t tile_begin, int64_t tile_end) {
  const float* table = decode_table().value[p.format];
  const bool folded = p.scale_kind == kScaleBlock;
  LinearProblem unit = p;
  unit.format_factor = 1.0f;  // the table already holds true values
  std::vector<float> lane_scale(kGroupBytes), acc(kGroupBytes);
  float sums[kTileN], mult[kTileN];
  for (int64_t t = tile_begin; t < tile_end; ++t) {
    fill_channel_mult(unit, t, folded, mult);
    const uint8_t* tile = p.w + t * (p.Kp / 2) * kGroupBytes;
    for (int64_t m = 0; m < p.M; ++m) {
      const float* x = p.x + m * p.ldx;
      for (auto& a : acc) a = 0.0f;
      int64_t refresh = 0;
      for (int64_t pair = 0; pair < p.Kp / 2; ++pair) {
        if (folded && 2 * pair >= refresh) refresh = fill_lane_scales(unit, t, pair, lane_scale.data());
        const uint8_t* g = tile + pair * kGroupBytes;
        for (int64_t lane = 0; lane < kGroupBytes; ++lane) {
          float wv = table[g[lane]];
          if (folded) wv *= lane_scale[kTileN * (lane & 1) + lane / 2];
          acc[lane] += wv * x[2 * pair + (lane & 1)];
        }
      }
      for (int64_t c = 0; c < kTileN; ++c) sums[c] = acc[2 * c] + acc[2 * c + 1];
      store_tile_row(p, m, t, sums, mult);
    }
  }
}

namespace {

// Decode attention, portable: FP8 rows through the table of exact values.
struct ScalarAttentionOps {
  static float factor(int) { return 1.0f; }
  static void row(const uint8_t* src, int64_t d, int format, float* dst) {
    const float* table = decode_table().value[format];
    for (int64_t i = 0; i < d; ++i) dst[i] = table[src[i]];
  }
  static float dot(const float* a, const float* b, int64_t d) {
    float sum = 0.0f;
    for (int64_t i = 0; i < d; ++i) sum += a[i] * b[i];
    return sum;
  }
  static void axpy(float alpha, const float* x, float* y, int64_t d) {
    for (int64_t i = 0; i < d; ++i) y[i] += alpha * x[i];
  }
  static float exp_shift(float* s, int64_t n, float top) {
    float sum = 0.0f;
    for (int64_t i = 0; i < n; ++i) sum += (s[i] = std::exp(s[i] - top));
    return sum;
  }
};

}  // namespace

void decode_attention_scalar(const DecodeAttention& a, int64_t task_begin, int64_t task_end) {
  decode_attention_tasks<ScalarAttentionOps>(a, task_begin, task_end);
}

double grid_error_scalar(const float* row, int64_t K, float inverse, const Fp8Grid& grid) {
  double error = 0.0;
  for (int64_t k = 0; k < K; ++k) {
    const float u = std::fmin(std::fmax(row[k] * inverse, -grid.fmax), grid.fmax);
    const float d = round_to_grid(u, grid) - u;
    error += static_cast<double>(d) * d;
  }
  return error;
}

void quantize_row_scalar(const float* row, int64_t K, float scale, float post, const Fp8Grid& grid, float* out) {
  for (int64_t k = 0; k < K; ++k) {
    const float q = row[k] / scale;
    const float value = std::isfinite(q) ? round_to_grid(std::fmin(std::fmax(q, -grid.fmax), grid.fmax), grid) : NAN;
    out[k] = post == 1.0f ? value : value * post;
  }
}

float finite_amax_scalar(const float* row, int64_t K) {
  float amax = 0.0f;
  for (int64_t k = 0; k < K; ++k) {
    const float a = std::fabs(row[k]);
    if (std::isfinite(a) && a > amax) amax = a;
  }
  return amax;
}

}  // namespace qfp8
