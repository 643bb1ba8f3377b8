// AVX512F/BW/VL kernel body, included by kernel_avx512.cpp and
// kernel_avx512bf16.cpp (each compiled with its own -m flags and defining
// QFP8_AVX512_ENTRY, the name of its entry point).
//
// Layout: the packed tiles of kernel.h, [T][Kp/2][64] bytes; 32 bytes of a
// group hold 16 consecutive channels x a k pair.
//
// Arithmetic per 32 bytes: as the AVX2 kernel, 256-bit wide: vpmaddubsw with
// (128, 0) / (0, 128) gives 128 * (int8)b of the even / odd bytes as 16
// words in channel order, an AND with 0xBFFF the fp16 bits (e5m2: shift /
// AND), one vcvtph2ps 16 float32 lanes (exact, subnormals included), and
// vfmadd231ps with a broadcast x[k] accumulates per parity of k. Scales and
// format factor as in the AVX2 kernel. The M > 1 panel runs 8 rows x 32
// channels per register block (16 zmm accumulators, x broadcast from memory).
//
// kernel_avx512bf16.cpp includes this body too, as its float32 fallback
// (activations too small for vdpbf16ps or beyond bf16's range, odd k blocks).
#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "kernel.h"

namespace qfp8 {
namespace {

constexpr int64_t kPanelPairs = 64;  // k pairs per converted panel: 128 k x 32 floats = 16 KB
constexpr int kRows = 8;             // rows per register block: 8 x 2 accumulators of 32 registers

// 32 packed bytes (16 channels x a k pair) -> float32 lanes of the 16
// channels at k = 2p (even) and k = 2p + 1 (odd).
template <int Format>
inline void convert32(const uint8_t* src, __m512& even, __m512& odd) {
  const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  __m256i e, o;
  if (Format == kE5M2) {
    e = _mm256_slli_epi16(bytes, 8);
    o = _mm256_and_si256(bytes, _mm256_set1_epi16(static_cast<short>(0xFF00)));
  } else {
    const __m256i mask = _mm256_set1_epi16(static_cast<short>(0xBFFF));
    e = _mm256_and_si256(_mm256_maddubs_epi16(_mm256_set1_epi16(0x0080), bytes), mask);
    o = _mm256_and_si256(_mm256_maddubs_epi16(_mm256_set1_epi16(static_cast<short>(0x8000)), bytes), mask);
  }
  even = _mm512_cvtph_ps(e);
  odd = _mm512_cvtph_ps(o);
}

template <int Format, bool Folded>
void tile_single_row(const LinearProblem& p, int64_t t, const float* x, float* sums) {
  const uint8_t* g = p.w + t * (p.Kp / 2) * kGroupBytes;
  const int64_t pairs = p.Kp / 2;
  __m512 acc_even[2], acc_odd[2], scale[4];
  for (int j = 0; j < 2; ++j) acc_even[j] = acc_odd[j] = _mm512_setzero_ps();
  for (auto& s : scale) s = _mm512_setzero_ps();
  alignas(64) float lane_scale[kGroupBytes] = {};
  int64_t refresh = 0;
  for (int64_t pair = 0; pair < pairs; ++pair, g += kGroupBytes) {
    if (Folded && 2 * pair >= refresh) {
      refresh = fill_lane_scales(p, t, pair, lane_scale);
      for (int j = 0; j < 4; ++j) scale[j] = _mm512_load_ps(lane_scale + 16 * j);
    }
    const __m512 x0 = _mm512_set1_ps(x[2 * pair]);
    const __m512 x1 = _mm512_set1_ps(x[2 * pair + 1]);
    for (int j = 0; j < 2; ++j) {
      __m512 e, o;
      convert32<Format>(g + 32 * j, e, o);
      if (Folded) {
        e = _mm512_mul_ps(e, scale[j]);
        o = _mm512_mul_ps(o, scale[2 + j]);
      }
      acc_even[j] = _mm512_fmadd_ps(e, x0, acc_even[j]);
      acc_odd[j] = _mm512_fmadd_ps(o, x1, acc_odd[j]);
    }
  }
  for (int j = 0; j < 2; ++j) _mm512_storeu_ps(sums + 16 * j, _mm512_add_ps(acc_even[j], acc_odd[j]));
}

template <int Format>
void convert_panel(const LinearProblem& p, int64_t t, int64_t pair0, int64_t count, float* panel,
                   float* lane_scale, int64_t& refresh) {
  const uint8_t* g = p.w + (t * (p.Kp / 2) + pair0) * kGroupBytes;
  __m512 scale[4];
  for (int j = 0; j < 4; ++j) scale[j] = _mm512_load_ps(lane_scale + 16 * j);
  for (int64_t i = 0; i < count; ++i, g += kGroupBytes) {
    const int64_t pair = pair0 + i;
    if (2 * pair >= refresh) {
      refresh = fill_lane_scales(p, t, pair, lane_scale);
      for (int j = 0; j < 4; ++j) scale[j] = _mm512_load_ps(lane_scale + 16 * j);
    }
    float* row = panel + 2 * i * kTileN;
    for (int j = 0; j < 2; ++j) {
      __m512 e, o;
      convert32<Format>(g + 32 * j, e, o);
      _mm512_store_ps(row + 16 * j, _mm512_mul_ps(e, scale[j]));
      _mm512_store_ps(row + kTileN + 16 * j, _mm512_mul_ps(o, scale[2 + j]));
    }
  }
}

// Rows x a converted panel of `depth` k, all 32 channels at once.
template <int Rows>
void panel_rows(const float* panel, int64_t depth, const float* const* x, float* const* acc_rows) {
  __m512 acc[Rows][2];
  for (int r = 0; r < Rows; ++r) {
    acc[r][0] = _mm512_loadu_ps(acc_rows[r]);
    acc[r][1] = _mm512_loadu_ps(acc_rows[r] + 16);
  }
  const float* w = panel;
  for (int64_t k = 0; k < depth; ++k, w += kTileN) {
    const __m512 w0 = _mm512_load_ps(w);
    const __m512 w1 = _mm512_load_ps(w + 16);
    for (int r = 0; r < Rows; ++r) {
      const __m512 xk = _mm512_set1_ps(x[r][k]);
      acc[r][0] = _mm512_fmadd_ps(w0, xk, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(w1, xk, acc[r][1]);
    }
  }
  for (int r = 0; r < Rows; ++r) {
    _mm512_storeu_ps(acc_rows[r], acc[r][0]);
    _mm512_storeu_ps(acc_rows[r] + 16, acc[r][1]);
  }
}

using PanelRowsFn = void (*)(const float*, int64_t, const float* const*, float* const*);
constexpr PanelRowsFn kPanelRows[kRows + 1] = {nullptr,       panel_rows<1>, panel_rows<2>, panel_rows<3>, panel_rows<4>,
                                               panel_rows<5>, panel_rows<6>, panel_rows<7>, panel_rows<8>};

template <int Format>
void tile_many_rows(const LinearProblem& p, int64_t t, float* panel, float* acc) {
  const int64_t pairs = p.Kp / 2;
  std::fill(acc, acc + p.M * kTileN, 0.0f);
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
        acc_rows[r] = acc + (m0 + r) * kTileN;
      }
      kPanelRows[rows](panel, 2 * count, x, acc_rows);
    }
  }
}

template <int Format>
void linear_tiles(const LinearProblem& p, int64_t tile_begin, int64_t tile_end) {
  alignas(64) float sums[kTileN];
  float mult[kTileN];
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
  std::vector<float> panel_storage(2 * kPanelPairs * kTileN + 16);
  float* panel = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(panel_storage.data()) + 63) & ~uintptr_t(63));
  std::vector<float> acc(p.M * kTileN);
  for (int64_t t = tile_begin; t < tile_end; ++t) {
    fill_channel_mult(p, t, true, mult);
    tile_many_rows<Format>(p, t, panel, acc.data());
    for (int64_t m = 0; m < p.M; ++m) store_tile_row(p, m, t, acc.data() + m * kTileN, mult);
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
