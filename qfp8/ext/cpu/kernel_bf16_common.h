// What the two bf16-product kernels share (kernel_avx512bf16.cpp and
// kernel_amx.cpp, both compiled with the AVX512-BF16 flags, the second also
// with AMX's): FP8 -> bf16 by table, the lane order of a converted group,
// the split of float32 activations into bf16 parts, and the store of a
// tile's lane-order sums. Internal linkage on purpose: each ISA unit gets
// its own copy, compiled with its own flags.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernel.h"

namespace qfp8 {
namespace bf16 {
namespace {

// Nonzero activation magnitudes below this make the bf16 kernels decline:
// vdpbf16ps and AMX's tdpbf16ps treat bf16 denormals as zero and flush
// denormal products, so a part times the smallest FP8 weight could vanish.
constexpr float kTinyActivation = 0x1p-80f;

// bf16 bits of FP8 code i (0..127, sign clear), exact.
uint16_t bf16_of_code(int format, int i) {
  float v;
  if (format == kE5M2) {
    const int e = i >> 2, m = i & 3;
    if (e == 31) {
      v = m == 0 ? __builtin_inff() : __builtin_nanf("");
    } else {
      v = e == 0 ? std::ldexp(static_cast<float>(m), -16) : std::ldexp(1.0f + m / 4.0f, e - 15);
    }
  } else {
    const int bias = format == kE4M3FNUZ ? 8 : 7;
    const int e = i >> 3, m = i & 7;
    if (format == kE4M3FN && i == 0x7F) {
      v = __builtin_nanf("");
    } else {
      v = e == 0 ? std::ldexp(static_cast<float>(m), 1 - bias - 3) : std::ldexp(1.0f + m / 8.0f, e - bias);
    }
  }
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  return static_cast<uint16_t>(bits >> 16);
}

struct Tables {
  __m512i lo0, lo1, hi0, hi1;  // low / high bf16 bytes of codes 0-63 and 64-127
};

Tables make_tables(int format) {
  alignas(64) uint8_t lo[128], hi[128];
  for (int i = 0; i < 128; ++i) {
    const uint16_t b = bf16_of_code(format, i);
    lo[i] = static_cast<uint8_t>(b & 0xFF);
    hi[i] = static_cast<uint8_t>(b >> 8);
  }
  return {_mm512_load_si512(lo), _mm512_load_si512(lo + 64), _mm512_load_si512(hi), _mm512_load_si512(hi + 64)};
}

// One 64-byte group -> two zmm of bf16 pairs (channel order in the header).
inline void convert_group(const Tables& tb, const uint8_t* src, __m512i& w0, __m512i& w1) {
  const __m512i bytes = _mm512_loadu_si512(src);
  const __m512i lo = _mm512_permutex2var_epi8(tb.lo0, bytes, tb.lo1);
  __m512i hi = _mm512_permutex2var_epi8(tb.hi0, bytes, tb.hi1);
  hi = _mm512_ternarylogic_epi32(hi, bytes, _mm512_set1_epi8(static_cast<char>(0x80)), 0xF8);  // hi | (bytes & 0x80)
  w0 = _mm512_unpacklo_epi8(lo, hi);
  w1 = _mm512_unpackhi_epi8(lo, hi);
}

// Channel (0..31) held by dword i of the first (j = 0) or second register.
inline int lane_channel(int j, int i) { return 8 * (i / 4) + 4 * j + i % 4; }

// Block scales of the tile's channels at column k, in register lane order:
// one load when bn is a multiple of 32, else two divisions and a running
// block row (not two divisions per channel, which cost more than the
// small-M products they scale).
inline void lane_block_scales(const LinearProblem& p, int64_t tile, int64_t k, __m512& s0, __m512& s1) {
  if (p.bn % kTileN == 0) {  // the tile's channels (and N - 1, where they stop) lie in one block row
    s0 = s1 = _mm512_set1_ps(p.scale[(tile * kTileN / p.bn) * p.scale_cols + k / p.bk]);
    return;
  }
  alignas(64) float by_channel[kTileN];
  const float* column = p.scale + k / p.bk;  // this k-block's column of the [N / bn, K / bk] scales
  const int64_t n0 = tile * kTileN;
  int64_t row = n0 / p.bn, next_row_at = (row + 1) * p.bn;  // the block row of channel n, where the next starts
  for (int c = 0; c < kTileN; ++c) {
    const int64_t n = n0 + c;
    if (n < p.N && n >= next_row_at) {
      ++row;
      next_row_at += p.bn;
    }
    by_channel[c] = column[row * p.scale_cols];  // channels past N take the last one's
  }
  alignas(64) float s[2][16];
  for (int j = 0; j < 2; ++j)
    for (int i = 0; i < 16; ++i) s[j][i] = by_channel[lane_channel(j, i)];
  s0 = _mm512_load_ps(s[0]);
  s1 = _mm512_load_ps(s[1]);
}

// Writes one row of a tile from its lane-order sums: as store_tile_row
// (kernel.h), in the same order of operations (so the same bits), 16
// channels at a time; mult is in channel order.
inline void store_lanes(const LinearProblem& p, int64_t m, int64_t tile, __m512 v0, __m512 v1, const float* mult) {
  const int64_t n0 = tile * kTileN;
  const int64_t count = p.N - n0 < kTileN ? p.N - n0 : kTileN;
  // Channel c of the tile is dword 4 * (c / 8) + c % 4 of register (c % 8) / 4
  // (lane_channel's inverse); index 16 + i picks dword i of the second.
  const __m512i order[2] = {_mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0),
                            _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8)};
  for (int h = 0; h < 2 && 16 * h < count; ++h) {
    __m512 v = _mm512_mul_ps(_mm512_permutex2var_ps(v0, order[h], v1), _mm512_loadu_ps(mult + 16 * h));
    const __mmask16 valid = count - 16 * h >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (count - 16 * h)) - 1);
    if (p.row_scale) v = _mm512_mul_ps(v, _mm512_set1_ps(p.row_scale[m]));
    if (p.bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(valid, p.bias + n0 + 16 * h));
    const int64_t at = m * p.ldo + n0 + 16 * h;
    if (p.out_dtype == kOutFloat) {
      _mm512_mask_storeu_ps(static_cast<float*>(p.out) + at, valid, v);
      continue;
    }
    __m256i bits;
    if (p.out_dtype == kOutBFloat16) {  // round to nearest even; NaN stays NaN (float_to_bf16_bits)
      const __m512i u = _mm512_castps_si512(v);
      const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
      __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd), 16);
      const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
      bits = _mm512_cvtepi32_epi16(r);
    } else {
      bits = _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
    _mm256_mask_storeu_epi16(static_cast<uint16_t*>(p.out) + at, valid, bits);
  }
}

inline void store_lanes(const LinearProblem& p, int64_t m, int64_t tile, const float* lanes, const float* mult) {
  store_lanes(p, m, tile, _mm512_loadu_ps(lanes), _mm512_loadu_ps(lanes + 16), mult);
}

// The bf16 parts of 16 values (masked lanes read as zero): hi, mid, lo;
// returns the values.
// Each part is the bf16 rounding (to nearest even) of what the previous
// ones left; a non-finite value is all in hi (its rest, NaN, is dropped).
inline __m512 split16(const float* x, __mmask16 valid, __m512& h, __m512& md, __m512& l) {
  const __m512 v = _mm512_maskz_loadu_ps(valid, x);
  h = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
  __m512 r = _mm512_sub_ps(v, h);
  r = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(r, r, _CMP_ORD_Q), r);
  md = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(r)), 16));
  l = _mm512_sub_ps(r, md);
  return v;
}

inline __mmask16 lanes_below(int64_t count) {
  return count >= 16 ? __mmask16(0xFFFF) : (count <= 0 ? __mmask16(0) : __mmask16((1u << count) - 1));
}

// What splitting activations found: which parts they need, and whether a
// value is outside the bf16 route's range (a nonzero magnitude below
// kTinyActivation, or finite but above bf16's largest value: hi would round
// to Inf).
struct SplitCheck {
  __mmask16 need_mid = 0, need_lo = 0, out_of_range = 0;
  int parts() const { return need_lo ? 3 : (need_mid ? 2 : 1); }
};

// The bf16 parts (split16) of the 32 values x[0..count) (the rest read as
// zero): lo[] of the first 16, hi[] of the next 16; notes them in check.
inline void split32(const float* x, int64_t count, __m512 (&lo)[3], __m512 (&hi)[3], SplitCheck& check) {
  const __m512 tiny = _mm512_set1_ps(kTinyActivation);
  const __m512 zero = _mm512_setzero_ps();
  const __m512 largest = _mm512_set1_ps(0x1.fffffep127f), bf16_max = _mm512_set1_ps(0x1.fep127f);
  const __m512 v0 = split16(x, lanes_below(count), lo[0], lo[1], lo[2]);
  const __m512 v1 = split16(x + 16, lanes_below(count - 16), hi[0], hi[1], hi[2]);
  for (const __m512 v : {v0, v1}) {
    const __m512 av = _mm512_abs_ps(v);
    check.out_of_range |= _mm512_mask_cmp_ps_mask(_mm512_cmp_ps_mask(av, zero, _CMP_GT_OQ), av, tiny, _CMP_LT_OQ);
    check.out_of_range |=
        _mm512_mask_cmp_ps_mask(_mm512_cmp_ps_mask(av, largest, _CMP_LE_OQ), av, bf16_max, _CMP_GT_OQ);
  }
  check.need_mid |= _mm512_cmp_ps_mask(lo[1], zero, _CMP_NEQ_UQ) | _mm512_cmp_ps_mask(hi[1], zero, _CMP_NEQ_UQ);
  check.need_lo |= _mm512_cmp_ps_mask(lo[2], zero, _CMP_NEQ_UQ) | _mm512_cmp_ps_mask(hi[2], zero, _CMP_NEQ_UQ);
}

// Transposes 16 x 16 dwords in place: r[i] lane j <- r[j] lane i. Two
// unpack stages within 128-bit lanes, then the lanes themselves.
inline void transpose16(__m512i (&r)[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // c[i + j]: rows i..i+3 at column 4 L + j of lane L
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int j = 0; j < 4; ++j) {
    const __m512i d0 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x44), d1 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xEE);
    const __m512i d2 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x44);
    const __m512i d3 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xEE);
    t[j] = _mm512_shuffle_i32x4(d0, d2, 0x88);
    t[4 + j] = _mm512_shuffle_i32x4(d0, d2, 0xDD);
    t[8 + j] = _mm512_shuffle_i32x4(d1, d3, 0x88);
    t[12 + j] = _mm512_shuffle_i32x4(d1, d3, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

}  // namespace
}  // namespace bf16
}  // namespace qfp8
