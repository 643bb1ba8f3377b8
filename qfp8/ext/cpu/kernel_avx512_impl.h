// AVX512F/BW/VL kernel body, included by kernel_avx512.cpp and
// kernel_avx512bf16.cpp (each compiled with its own -m flags and defining
// QFP8_AVX512_ENTRY, the name of its entry point).
//
// Layout: the packed tiles of kernel.h, [T][Kp/2][64] bytes; one 64-byte
// group (32 channels x a k pair) becomes 4 zmm of float32 lanes in byte order.
//
// Arithmetic per 32 bytes: vpmovsxbw sign-extends to 32 words in order
// ((int16)(int8)b), a shift left by 7 and an AND with 0xBFFF give the fp16
// bits of the e4m3 value / 2^8 (e5m2: zero-extend and shift by 8), two
// vcvtph2ps give 2 x 16 float32 lanes (exact, subnormals included),
// vfmadd231ps with the broadcast pair (x[2p], x[2p+1]) accumulates. Scales
// and the format factor as in the AVX2 kernel: per channel at the end, or
// folded per lane for block scales and for the M > 1 panel.
//
// vdpbf16ps is deliberately not used by the avx512bf16 entry: turning FP8
// into bf16 exactly (subnormals included, no 2^-120 bias that would flush
// products of small activations) costs as many instructions as turning it
// into float32, the M == 1 loop is bound by that conversion, and the panel
// path folds scales into float32 weights, which bf16 would round.
#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "kernel.h"

namespace qfp8 {
namespace {

constexpr int64_t kPanelPairs = 64;  // k pairs per converted panel: 64 * 64 floats = 16 KB
constexpr int kRows = 8;             // rows per register block: 8 x 2 accumulators of 32 registers

// 32 packed bytes -> 2 x 16 float32 lanes in byte order.
template <int Format>
inline void convert32(const uint8_t* src, __m512* out) {
  const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  __m512i words;
  if (Format == kE5M2) {
    words = _mm512_slli_epi16(_mm512_cvtepu8_epi16(bytes), 8);
  } else {
    words = _mm512_and_si512(_mm512_slli_epi16(_mm512_cvtepi8_epi16(bytes), 7),
                             _mm512_set1_epi16(static_cast<short>(0xBFFF)));
  }
  out[0] = _mm512_cvtph_ps(_mm512_castsi512_si256(words));
  out[1] = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(words, 1));
}

// (x[k], x[k+1]) repeated over the 16 lanes: one 64-bit broadcast.
inline __m512 broadcast_pair(const float* x) {
  return _mm512_castpd_ps(_mm512_set1_pd(*reinterpret_cast<const double*>(x)));
}

inline void reduce_lanes(const float* lanes, float* sums) {
  for (int64_t c = 0; c < kTileN; ++c) sums[c] = lanes[2 * c] + lanes[2 * c + 1];
}

template <int Format, bool Folded>
void tile_single_row(const LinearProblem& p, int64_t t, const float* x, float* sums) {
  const uint8_t* g = p.w + t * (p.Kp / 2) * kGroupBytes;
  const int64_t pairs = p.Kp / 2;
  __m512 acc[4];
  for (auto& a : acc) a = _mm512_setzero_ps();
  alignas(64) float lane_scale[kGroupBytes] = {};
  __m512 scale[4];
  for (auto& s : scale) s = _mm512_setzero_ps();
  int64_t refresh = 0;
  for (int64_t pair = 0; pair < pairs; ++pair, g += kGroupBytes) {
    __m512 w[4];
    convert32<Format>(g, w);
    convert32<Format>(g + 32, w + 2);
    const __m512 xx = broadcast_pair(x + 2 * pair);
    if (Folded) {
      if (2 * pair >= refresh) {
        refresh = fill_lane_scales(p, t, pair, lane_scale);
        for (int i = 0; i < 4; ++i) scale[i] = _mm512_load_ps(lane_scale + 16 * i);
      }
      for (int i = 0; i < 4; ++i) w[i] = _mm512_mul_ps(w[i], scale[i]);
    }
    for (int i = 0; i < 4; ++i) acc[i] = _mm512_fmadd_ps(w[i], xx, acc[i]);
  }
  alignas(64) float lanes[kGroupBytes];
  for (int i = 0; i < 4; ++i) _mm512_store_ps(lanes + 16 * i, acc[i]);
  reduce_lanes(lanes, sums);
}

template <int Format>
void convert_panel(const LinearProblem& p, int64_t t, int64_t pair0, int64_t count, float* panel,
                   float* lane_scale, int64_t& refresh) {
  const uint8_t* g = p.w + (t * (p.Kp / 2) + pair0) * kGroupBytes;
  __m512 scale[4];
  for (int i = 0; i < 4; ++i) scale[i] = _mm512_load_ps(lane_scale + 16 * i);
  for (int64_t i = 0; i < count; ++i, g += kGroupBytes) {
    const int64_t pair = pair0 + i;
    if (2 * pair >= refresh) {
      refresh = fill_lane_scales(p, t, pair, lane_scale);
      for (int j = 0; j < 4; ++j) scale[j] = _mm512_load_ps(lane_scale + 16 * j);
    }
    __m512 w[4];
    convert32<Format>(g, w);
    convert32<Format>(g + 32, w + 2);
    for (int j = 0; j < 4; ++j) _mm512_store_ps(panel + i * kGroupBytes + 16 * j, _mm512_mul_ps(w[j], scale[j]));
  }
}

// Rows times a converted panel, 32 lanes (16 channels) at a time.
template <int Rows>
void panel_rows(const float* panel, int64_t count, const float* const* x, float* const* acc_rows) {
  for (int v = 0; v < 4; v += 2) {
    __m512 acc[Rows][2];
    for (int r = 0; r < Rows; ++r) {
      acc[r][0] = _mm512_loadu_ps(acc_rows[r] + 16 * v);
      acc[r][1] = _mm512_loadu_ps(acc_rows[r] + 16 * v + 16);
    }
    const float* w = panel + 16 * v;
    for (int64_t i = 0; i < count; ++i, w += kGroupBytes) {
      const __m512 w0 = _mm512_load_ps(w);
      const __m512 w1 = _mm512_load_ps(w + 16);
      for (int r = 0; r < Rows; ++r) {
        const __m512 xx = broadcast_pair(x[r] + 2 * i);
        acc[r][0] = _mm512_fmadd_ps(w0, xx, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(w1, xx, acc[r][1]);
      }
    }
    for (int r = 0; r < Rows; ++r) {
      _mm512_storeu_ps(acc_rows[r] + 16 * v, acc[r][0]);
      _mm512_storeu_ps(acc_rows[r] + 16 * v + 16, acc[r][1]);
    }
  }
}

using PanelRowsFn = void (*)(const float*, int64_t, const float* const*, float* const*);
constexpr PanelRowsFn kPanelRows[kRows + 1] = {nullptr,       panel_rows<1>, panel_rows<2>, panel_rows<3>, panel_rows<4>,
                                               panel_rows<5>, panel_rows<6>, panel_rows<7>, panel_rows<8>};

template <int Format>
void tile_many_rows(const LinearProblem& p, int64_t t, float* panel, float* acc) {
  const int64_t pairs = p.Kp / 2;
  std::fill(acc, acc + p.M * kGroupBytes, 0.0f);
  alignas(64) float lane_scale[kGroupBytes] = {};
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
  std::vector<float> panel_storage(kPanelPairs * kGroupBytes + 16);
  float* panel = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(panel_storage.data()) + 63) & ~uintptr_t(63));
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

void QFP8_AVX512_ENTRY(const LinearProblem& p, int64_t tile_begin, int64_t tile_end) {
  switch (p.format) {
    case kE5M2:
      return linear_tiles<kE5M2>(p, tile_begin, tile_end);
    default:  // e4m3fn and e4m3fnuz share the bits; only the factor differs
      return linear_tiles<kE4M3FN>(p, tile_begin, tile_end);
  }
}

}  // namespace qfp8
