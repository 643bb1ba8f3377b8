// AVX2 + FMA + F16C kernel (compiled with -mavx2 -mfma -mf16c, called only
// when the CPU reports those features).
//
// Layout: the packed tiles of kernel.h, [T][Kp/2][64] bytes; one 64-byte
// group (32 channels x a k pair) becomes 8 ymm of float32 lanes in byte order.
//
// Arithmetic per group: vpunpck{l,h}bw with zero puts each byte in the high
// half of a 16-bit lane; for e4m3 an arithmetic shift right by 1 and an AND
// with 0xBFFF make the fp16 bits (see kernel.h), e5m2 needs nothing more;
// vcvtph2ps gives float32 (exact, subnormals included); vfmadd231ps with the
// broadcast pair (x[2p], x[2p+1]) accumulates. The format factor (2^8, 2^7
// or 1) and the weight scale are applied per channel at the end (tensor and
// channel scales) or folded into the weights per lane (block scales).
//
// Two schedules:
// - M == 1 (decode): the weights are converted in registers and used once;
//   the loop is bound by the conversion, ~13 instructions per 32 weights.
// - M > 1: a panel of 64 k pairs x 32 channels is converted once into a
//   16 KB float32 buffer (L1-resident) with the scale folded in, then a
//   6-row x 16-lane register-blocked loop runs every row over it, so the
//   conversion is paid once per weight, not once per row.
#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "kernel.h"

namespace qfp8 {
namespace {

constexpr int64_t kPanelPairs = 64;  // k pairs per converted panel: 64 * 64 floats = 16 KB
constexpr int kRows = 6;             // rows per register block: 6 x 2 accumulators + 2 weights + 1 x

// Converts 32 packed bytes into 4 x 8 float32 lanes, in byte order
// (out[0] = bytes 0-7, out[1] = 8-15, ...). The unpack works within 128-bit
// halves, so the low/high halves of `lo` and `hi` hold bytes 0-7, 16-23 and
// 8-15, 24-31; the results are named accordingly instead of shuffled.
template <int Format>
inline void convert32(const uint8_t* src, __m256* out) {
  const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  const __m256i zero = _mm256_setzero_si256();
  __m256i lo = _mm256_unpacklo_epi8(zero, bytes);
  __m256i hi = _mm256_unpackhi_epi8(zero, bytes);
  if (Format != kE5M2) {
    const __m256i mask = _mm256_set1_epi16(static_cast<short>(0xBFFF));
    lo = _mm256_and_si256(_mm256_srai_epi16(lo, 1), mask);
    hi = _mm256_and_si256(_mm256_srai_epi16(hi, 1), mask);
  }
  out[0] = _mm256_cvtph_ps(_mm256_castsi256_si128(lo));
  out[2] = _mm256_cvtph_ps(_mm256_extracti128_si256(lo, 1));
  out[1] = _mm256_cvtph_ps(_mm256_castsi256_si128(hi));
  out[3] = _mm256_cvtph_ps(_mm256_extracti128_si256(hi, 1));
}

// (x[k], x[k+1]) repeated over the 8 lanes: one 64-bit broadcast.
inline __m256 broadcast_pair(const float* x) {
  return _mm256_castpd_ps(_mm256_broadcast_sd(reinterpret_cast<const double*>(x)));
}

// Adds lanes 2c and 2c+1 of the 64 lane accumulators into channel c.
inline void reduce_lanes(const float* lanes, float* sums) {
  for (int64_t c = 0; c < kTileN; ++c) sums[c] = lanes[2 * c] + lanes[2 * c + 1];
}

// M == 1: stream the tile once, converting in registers.
template <int Format, bool Folded>
void tile_single_row(const LinearProblem& p, int64_t t, const float* x, float* sums) {
  const uint8_t* g = p.w + t * (p.Kp / 2) * kGroupBytes;
  const int64_t pairs = p.Kp / 2;
  __m256 acc[8];
  for (auto& a : acc) a = _mm256_setzero_ps();
  alignas(32) float lane_scale[kGroupBytes] = {};
  __m256 scale[8];
  int64_t refresh = 0;
  for (int64_t pair = 0; pair < pairs; ++pair, g += kGroupBytes) {
    __m256 w[8];
    convert32<Format>(g, w);
    convert32<Format>(g + 32, w + 4);
    const __m256 xx = broadcast_pair(x + 2 * pair);
    if (Folded) {
      if (2 * pair >= refresh) {
        refresh = fill_lane_scales(p, t, pair, lane_scale);
        for (int i = 0; i < 8; ++i) scale[i] = _mm256_load_ps(lane_scale + 8 * i);
      }
      for (int i = 0; i < 8; ++i) w[i] = _mm256_mul_ps(w[i], scale[i]);
    }
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_fmadd_ps(w[i], xx, acc[i]);
  }
  alignas(32) float lanes[kGroupBytes];
  for (int i = 0; i < 8; ++i) _mm256_store_ps(lanes + 8 * i, acc[i]);
  reduce_lanes(lanes, sums);
}

// Converts `count` groups starting at k pair `pair0` into float32 lanes with
// the lane scales folded in (lane_scale refreshed at block boundaries).
template <int Format>
void convert_panel(const LinearProblem& p, int64_t t, int64_t pair0, int64_t count, float* panel,
                   float* lane_scale, int64_t& refresh) {
  const uint8_t* g = p.w + (t * (p.Kp / 2) + pair0) * kGroupBytes;
  __m256 scale[8];
  for (int i = 0; i < 8; ++i) scale[i] = _mm256_load_ps(lane_scale + 8 * i);
  for (int64_t i = 0; i < count; ++i, g += kGroupBytes) {
    const int64_t pair = pair0 + i;
    if (2 * pair >= refresh) {
      refresh = fill_lane_scales(p, t, pair, lane_scale);
      for (int j = 0; j < 8; ++j) scale[j] = _mm256_load_ps(lane_scale + 8 * j);
    }
    __m256 w[8];
    convert32<Format>(g, w);
    convert32<Format>(g + 32, w + 4);
    for (int j = 0; j < 8; ++j) _mm256_store_ps(panel + i * kGroupBytes + 8 * j, _mm256_mul_ps(w[j], scale[j]));
  }
}

// Rows [m0, m0 + Rows) times a converted panel, 16 lanes at a time,
// accumulating into acc_rows (64 lanes per row).
template <int Rows>
void panel_rows(const float* panel, int64_t count, const float* const* x, float* const* acc_rows) {
  for (int v = 0; v < 8; v += 2) {
    __m256 acc[Rows][2];
    for (int r = 0; r < Rows; ++r) {
      acc[r][0] = _mm256_loadu_ps(acc_rows[r] + 8 * v);
      acc[r][1] = _mm256_loadu_ps(acc_rows[r] + 8 * v + 8);
    }
    const float* w = panel + 8 * v;
    for (int64_t i = 0; i < count; ++i, w += kGroupBytes) {
      const __m256 w0 = _mm256_load_ps(w);
      const __m256 w1 = _mm256_load_ps(w + 8);
      for (int r = 0; r < Rows; ++r) {
        const __m256 xx = broadcast_pair(x[r] + 2 * i);
        acc[r][0] = _mm256_fmadd_ps(w0, xx, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(w1, xx, acc[r][1]);
      }
    }
    for (int r = 0; r < Rows; ++r) {
      _mm256_storeu_ps(acc_rows[r] + 8 * v, acc[r][0]);
      _mm256_storeu_ps(acc_rows[r] + 8 * v + 8, acc[r][1]);
    }
  }
}

using PanelRowsFn = void (*)(const float*, int64_t, const float* const*, float* const*);
constexpr PanelRowsFn kPanelRows[kRows + 1] = {nullptr,          panel_rows<1>, panel_rows<2>, panel_rows<3>,
                                               panel_rows<4>, panel_rows<5>, panel_rows<6>};

template <int Format>
void tile_many_rows(const LinearProblem& p, int64_t t, float* panel, float* acc) {
  const int64_t pairs = p.Kp / 2;
  std::fill(acc, acc + p.M * kGroupBytes, 0.0f);
  alignas(32) float lane_scale[kGroupBytes] = {};
  int64_t refresh = 0;
  for (int64_t pair0 = 0; pair0 < pairs; pair0 += kPanelPairs) {
    const int64_t count = std::min(kPanelPairs, pairs - pair0);
    convert_panel<Format>(p, t, pair0, count, panel, lane_scale, refresh);
    for (int64_t m0 = 0; m0 < p.M; m0 += kRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kRows, p.M - m0));
      const float* x[kRows];
      float* acc_rows[kRows];
      for (int r = 0; r < rows; ++r) {
        x[r] = p.x + (m0 + r) * p.ldx + 2 * pair0;
        acc_rows[r] = acc + (m0 + r) * kGroupBytes;
      }
      kPanelRows[rows](panel, count, x, acc_rows);
    }
  }
}

template <int Format>
void linear_tiles(const LinearProblem& p, int64_t tile_begin, int64_t tile_end) {
  float sums[kTileN], mult[kTileN];
  if (p.M == 1) {
    const bool folded = p.scale_kind == kScaleBlock;
    for (int64_t t = tile_begin; t < tile_end; ++t) {
      fill_channel_mult(p, t, folded, mult);
      if (folded) {
        tile_single_row<Format, true>(p, t, p.x, sums);
      } else {
        tile_single_row<Format, false>(p, t, p.x, sums);
      }
      store_tile_row(p, 0, t, sums, mult);
    }
    return;
  }
  // Panel and accumulators per call of this function (one per thread chunk).
  std::vector<float, std::allocator<float>> panel_storage(kPanelPairs * kGroupBytes + 8);
  float* panel = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(panel_storage.data()) + 31) & ~uintptr_t(31));
  std::vector<float> acc(p.M * kGroupBytes);
  for (int64_t t = tile_begin; t < tile_end; ++t) {
    fill_channel_mult(p, t, true, mult);
    tile_many_rows<Format>(p, t, panel, acc.data());
    for (int64_t m = 0; m < p.M; ++m) {
      reduce_lanes(acc.data() + m * kGroupBytes, sums);
      store_tile_row(p, m, t, sums, mult);
    }
  }
}

}  // namespace

void linear_tiles_avx2(const LinearProblem& p, int64_t tile_begin, int64_t tile_end) {
  switch (p.format) {
    case kE5M2:
      return linear_tiles<kE5M2>(p, tile_begin, tile_end);
    case kE4M3FNUZ:  // same bits as e4m3fn; only the factor (2^7) differs
    default:
      return linear_tiles<kE4M3FN>(p, tile_begin, tile_end);
  }
}

}  // namespace qfp8
