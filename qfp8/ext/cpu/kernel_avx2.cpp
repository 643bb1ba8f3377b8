// AVX2 + FMA + F16C kernel (compiled with -mavx2 -mfma -mf16c, called only
// when the CPU reports those features).
//
// Layout: the packed tiles of kernel.h, [T][Kp/2][64] bytes.
//
// Two routes:
// - The float32 tile kernel (kernel_float32_tiles.h) on 256-bit vectors: 16
//   bytes of a group hold 8 consecutive channels x a k pair; vpmaddubsw with
//   the constant bytes (128, 0) gives 128 * (int8)b of the even bytes
//   (k = 2p) as 8 words, with (0, 128) the odd bytes (k = 2p + 1); an AND
//   with 0xBFFF makes the fp16 bits of the e4m3 value / 2^8 (/ 2^7 for fnuz;
//   see kernel.h); e5m2 bytes are moved into the high byte of each word
//   instead (shift / AND). vpmaddubsw runs on a multiply port, so the loop
//   issues no shuffles at all. M > 4 goes there (the panel, 6 rows x 16
//   channels per register block), and so do block scales with an odd bk.
// - M <= 4 (decode, small batches): the weights are converted in registers
//   and used by every row at once; the loop is bound by the conversion, so
//   it takes the cheaper float32 route below (no vcvtph2ps).
//
// The float32 route: the FP8 byte is put into the top byte of a 32-bit lane,
// then vpsrad + vpand leave s|0000|eeee|mmm|0.. (e5m2: s|000|eeeee|mm|0..):
// the float32 whose value is the FP8 value times 2^-120 (e4m3fnuz 2^-119,
// e5m2 2^-112). Each 32-bit lane of a 32-byte load holds 4 weights, which
// 16-bit and 32-bit shifts move into place (ShiftConvert).
// FP8 subnormals land on float32 subnormals, which the FMA takes exactly
// while MXCSR.DAZ is clear (the kernel clears it for its own duration).
// Products of such tiny weights with x would underflow, so x is first
// multiplied by an exact power of two 2^E that puts its largest magnitude
// near 2^116; the sums are brought back by 2^(112 - E), which makes them
// equal to the fp16 route's sums, so the same channel multipliers apply.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "attention_impl.h"
#include "kernel.h"
#include "kernel_activation_impl.h"
#include "kernel_float32_tiles.h"

namespace qfp8 {
namespace {

// 256-bit vectors for the float32 tile kernel and the activation helpers
// (kernel_float32_tiles.h, kernel_activation_impl.h).
struct Avx2Vector {
  using Float = __m256;
  using Int = __m256i;
  using Double = __m256d;
  using Mask = __m256;
  static constexpr int kLanes = 8;
  static constexpr int kRows = 6;  // rows per register block: 6 x 2 accumulators + 2 weights + 1 x

  static Float zero() { return _mm256_setzero_ps(); }
  static Float set1(float v) { return _mm256_set1_ps(v); }
  static Float broadcast(const float* p) { return _mm256_broadcast_ss(p); }
  static Float load(const float* p) { return _mm256_load_ps(p); }
  static Float loadu(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, Float v) { _mm256_store_ps(p, v); }
  static void storeu(float* p, Float v) { _mm256_storeu_ps(p, v); }
  static Float add(Float a, Float b) { return _mm256_add_ps(a, b); }
  static Float sub(Float a, Float b) { return _mm256_sub_ps(a, b); }
  static Float mul(Float a, Float b) { return _mm256_mul_ps(a, b); }
  static Float div(Float a, Float b) { return _mm256_div_ps(a, b); }
  static Float min(Float a, Float b) { return _mm256_min_ps(a, b); }
  static Float max(Float a, Float b) { return _mm256_max_ps(a, b); }
  static Float fmadd(Float a, Float b, Float c) { return _mm256_fmadd_ps(a, b, c); }
  static Float abs(Float a) { return _mm256_and_ps(a, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff))); }
  static Int set1_int(int v) { return _mm256_set1_epi32(v); }
  static Int as_int(Float a) { return _mm256_castps_si256(a); }
  static Float as_float(Int a) { return _mm256_castsi256_ps(a); }
  static Int and_int(Int a, Int b) { return _mm256_and_si256(a, b); }
  static Int andnot_int(Int a, Int b) { return _mm256_andnot_si256(a, b); }
  static Int or_int(Int a, Int b) { return _mm256_or_si256(a, b); }
  static Int add_int(Int a, Int b) { return _mm256_add_epi32(a, b); }
  template <int N>
  static Int srli(Int a) { return _mm256_srli_epi32(a, N); }
  static Mask less(Float a, Float b) { return _mm256_cmp_ps(a, b, _CMP_LT_OQ); }
  static Mask less_equal(Float a, Float b) { return _mm256_cmp_ps(a, b, _CMP_LE_OQ); }
  static Float select(Mask m, Float if_true, Float if_false) { return _mm256_blendv_ps(if_false, if_true, m); }
  static Float keep(Mask m, Float a) { return _mm256_and_ps(a, m); }
  static Double zero_double() { return _mm256_setzero_pd(); }
  static Double low_double(Float a) { return _mm256_cvtps_pd(_mm256_castps256_ps128(a)); }
  static Double high_double(Float a) { return _mm256_cvtps_pd(_mm256_extractf128_ps(a, 1)); }
  static Double fmadd_double(Double a, Double b, Double c) { return _mm256_fmadd_pd(a, b, c); }
  static Double add_double(Double a, Double b) { return _mm256_add_pd(a, b); }
  static double reduce_add_double(Double a) {
    alignas(32) double lanes[4];
    _mm256_store_pd(lanes, a);
    return (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
  }
  static float reduce_max(Float a) {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, a);
    float result = lanes[0];
    for (int i = 1; i < 8; ++i) result = std::fmax(result, lanes[i]);
    return result;
  }

  // 16 packed bytes (8 channels x a k pair) -> float32 lanes of the 8 channels
  // at k = 2p (even) and k = 2p + 1 (odd), before scale and format factor.
  template <int Format>
  static void convert(const uint8_t* src, Float& even, Float& odd) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
    __m128i e, o;
    if (Format == kE5M2) {
      e = _mm_slli_epi16(bytes, 8);
      o = _mm_and_si128(bytes, _mm_set1_epi16(static_cast<short>(0xFF00)));
    } else {
      const __m128i mask = _mm_set1_epi16(static_cast<short>(0xBFFF));
      e = _mm_and_si128(_mm_maddubs_epi16(_mm_set1_epi16(0x0080), bytes), mask);
      o = _mm_and_si128(_mm_maddubs_epi16(_mm_set1_epi16(static_cast<short>(0x8000)), bytes), mask);
    }
    even = _mm256_cvtph_ps(e);
    odd = _mm256_cvtph_ps(o);
  }
};

// M == 1 streams kStreams tiles side by side and prefetches kPrefetchBytes
// ahead in each (see pairs_single_row_f32).
constexpr int kStreams = 2;
constexpr int64_t kPrefetchBytes = 3072;

// 2^e for e in [-250, 250] as two float32 factors (neither overflows), so
// that v * first * second is v * 2^e exactly unless the result itself
// leaves float32's range.
struct Pow2 {
  float first, second;
  explicit Pow2(int e) : first(std::ldexp(1.0f, e / 2)), second(std::ldexp(1.0f, e - e / 2)) {}
  float apply(float v) const { return v * first * second; }
};

// Block scales on the float32 route: the sums of each k block are finished
// in registers and multiplied by that block's 32 lane scales (the scale
// times the format factor) as they are added to the tile's totals, so the
// inner loop stays the same as for channel scales. Needs bk even (a block
// boundary never splits a k pair); the scale row of each lane is computed
// once per tile, so a block costs 32 loads, not 32 divisions.
struct BlockLanes {
  int64_t row_offset[kTileN];
  int64_t pairs_per_block;  // bk / 2; the whole K for tensor and channel scales
  BlockLanes(const LinearProblem& p, int64_t t) {
    pairs_per_block = p.scale_kind == kScaleBlock ? p.bk / 2 : p.Kp / 2;
    if (p.scale_kind != kScaleBlock) return;
    for (int64_t c = 0; c < kTileN; ++c) {
      const int64_t n = std::min(t * kTileN + c, p.N - 1);  // padded channels hold zero weights
      row_offset[c] = (n / p.bn) * p.scale_cols;
    }
  }
  inline void fill(const LinearProblem& p, int64_t block, float* lanes) const {
    for (int64_t c = 0; c < kTileN; ++c) lanes[c] = p.scale[row_offset[c] + block] * p.format_factor;
  }
};

// The float32 route on one 32-byte load (two 16-byte chunks: 16 channels x
// a k pair): f[i] gets byte i of each 32-bit lane, i.e. bytes 4l + i, which
// are channels 2l + i / 2 of the chunk at k = 2p + i % 2 (byte 2c + j is
// channel c at k = 2p + j). One 16-bit arithmetic shift lines up bytes 3
// and 1 (the high byte of each half), a second one after vpsllw 8 bytes 2
// and 0; bytes 3 and 2 are then a vpand away, bytes 1 and 0 a vpslld 16 and
// a vpand: 9 integer instructions per 32 weights, no shuffles.
template <int Format>
struct ShiftConvert {
  static constexpr int kShift = Format == kE5M2 ? 3 : 4;
  const __m256i keep = _mm256_set1_epi32(static_cast<int>(Format == kE5M2 ? 0x8FE00000u : 0x87F00000u));
  inline void operator()(const uint8_t* src, __m256* f) const {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
    const __m256i high = _mm256_srai_epi16(b, kShift);
    const __m256i low = _mm256_srai_epi16(_mm256_slli_epi16(b, 8), kShift);
    f[0] = _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(low, 16), keep));
    f[1] = _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(high, 16), keep));
    f[2] = _mm256_castsi256_ps(_mm256_and_si256(low, keep));
    f[3] = _mm256_castsi256_ps(_mm256_and_si256(high, keep));
  }
};

// Slot 8j + i (lane i of accumulator j) of the float32 route holds tile
// channel 16 (j / 2) + 2i + j % 2: accumulators 2h and 2h + 1 collect the even
// and the odd channels of chunk h (channels 16h .. 16h + 15).
constexpr int slot_channel(int slot) { return 16 * (slot / 16) + 2 * (slot % 8) + (slot / 8) % 2; }

// M == 1 on the float32 route, Tiles tiles side by side over k pairs
// [pair0, pair1), each 32-byte load through ShiftConvert (its 16-bit shifts
// beat both a 32-bit shift chain per byte and a vpshufb loop on L2-resident
// weights, and match them from memory, where the memory's rate is the
// limit). out[u] receives tile u's sums in slot order (see slot_channel).
// Two tiles keep the 8 accumulators, 2 x values and the mask in registers
// (more would spill); the prefetch keeps two streams busy enough. With
// Cross, each stream's prefetch goes on past its own tile's end into the
// tile it takes next (Tiles on), so that the next call's streams start warm
// (a gain on short tiles, K = 576, none lost on long ones).
template <int Format, int Tiles, bool Cross>
void pairs_single_row_f32(const uint8_t* tile0, int64_t tile_bytes, const float* xs, int64_t pair0, int64_t pair1,
                          float (*out)[kTileN]) {
  const ShiftConvert<Format> convert;
  const uint8_t* g[Tiles];
  __m256 acc[Tiles][4];
  for (int u = 0; u < Tiles; ++u) {
    g[u] = tile0 + u * tile_bytes + pair0 * kGroupBytes;
    for (auto& v : acc[u]) v = _mm256_setzero_ps();
  }
  for (int64_t pair = pair0; pair < pair1; ++pair) {
    const __m256 x0 = _mm256_broadcast_ss(xs + 2 * pair);
    const __m256 x1 = _mm256_broadcast_ss(xs + 2 * pair + 1);
    const int64_t ahead = Cross && pair * kGroupBytes + kPrefetchBytes >= tile_bytes ? (Tiles - 1) * tile_bytes : 0;
    for (int u = 0; u < Tiles; ++u) {
      // A few KB ahead of each stream: the hardware prefetcher alone leaves
      // gaps when several streams run side by side.
      _mm_prefetch(reinterpret_cast<const char*>(g[u]) + kPrefetchBytes + ahead, _MM_HINT_T0);
      for (int h = 0; h < 2; ++h) {
        __m256 f[4];
        convert(g[u] + 32 * h, f);
        acc[u][2 * h] = _mm256_fmadd_ps(f[1], x1, _mm256_fmadd_ps(f[0], x0, acc[u][2 * h]));
        acc[u][2 * h + 1] = _mm256_fmadd_ps(f[3], x1, _mm256_fmadd_ps(f[2], x0, acc[u][2 * h + 1]));
      }
      g[u] += kGroupBytes;
    }
  }
  for (int u = 0; u < Tiles; ++u)
    for (int j = 0; j < 4; ++j) _mm256_store_ps(out[u] + 8 * j, acc[u][j]);
}

// Block scales on the float32 route need bk even (see BlockLanes): the
// lane scales of block `block` of tile t, in slot order.
inline void fill_lane_slots(const LinearProblem& p, const BlockLanes& blocks, int64_t block, float* lane_slots) {
  alignas(32) float lanes[kTileN];
  blocks.fill(p, block, lanes);
  for (int s = 0; s < kTileN; ++s) lane_slots[s] = lanes[slot_channel(s)];
}

// M == 1 on the float32 route (see the file comment), Tiles tiles at once.
// xs is the pre-scaled activation; the sums come out in units of
// 2^(E - 112) of the fp16 route's sums (times the lane scales for block
// scales), in slot order, and are finished by store_slots_row.
template <int Format, int Tiles>
void tiles_single_row_f32(const LinearProblem& p, int64_t t0, const float* xs, float (*sums)[kTileN]) {
  const int64_t pairs = p.Kp / 2;
  const int64_t tile_bytes = pairs * kGroupBytes;
  const uint8_t* tile0 = p.w + t0 * tile_bytes;
  if (p.scale_kind != kScaleBlock) {
    pairs_single_row_f32<Format, Tiles, true>(tile0, tile_bytes, xs, 0, pairs, sums);
    return;
  }
  // Block scales (see BlockLanes): each k block's sums are multiplied by
  // that block's lane scales as they are added to the totals.
  alignas(32) float slots[Tiles][kTileN];
  alignas(32) float lane_slots[kTileN];
  static_assert(Tiles <= 2, "one BlockLanes per tile below");
  const BlockLanes first(p, t0), second(p, t0 + Tiles - 1);
  const BlockLanes* blocks[2] = {&first, &second};
  for (int u = 0; u < Tiles; ++u) std::fill(sums[u], sums[u] + kTileN, 0.0f);
  const int64_t pairs_per_block = first.pairs_per_block;
  for (int64_t pair0 = 0, block = 0; pair0 < pairs; pair0 += pairs_per_block, ++block) {
    pairs_single_row_f32<Format, Tiles, false>(tile0, tile_bytes, xs, pair0, std::min(pairs, pair0 + pairs_per_block),
                                               slots);
    for (int u = 0; u < Tiles; ++u) {
      fill_lane_slots(p, *blocks[u], block, lane_slots);
      for (int s = 0; s < kTileN; ++s) sums[u][s] += slots[u][s] * lane_slots[s];
    }
  }
}

// 2 <= M <= 4 (small batches, speculative decoding) on the float32 route:
// the weights converted by ShiftConvert go to every row straight from
// registers (the panel's store and reload cost more than the rows' FMAs at
// this M). Halves 32-byte halves of each group per pass keep the Rows x 2
// Halves accumulators, the four converted vectors, the two x values and the
// mask within the 16 ymm registers; a tile takes 2 / Halves passes over its
// bytes (L2-resident). Totals come out in slot order (see slot_channel), for
// store_slots_row.
template <int Format, int Rows, int Halves>
void tile_small_rows_f32(const LinearProblem& p, int64_t t, const float* const* xs, float (*totals)[kTileN]) {
  const ShiftConvert<Format> convert;
  const BlockLanes blocks(p, t);
  const bool block_scales = p.scale_kind == kScaleBlock;
  const int64_t pairs = p.Kp / 2;
  alignas(32) float lane_slots[kTileN];
  for (int r = 0; r < Rows; ++r) std::fill(totals[r], totals[r] + kTileN, 0.0f);
  for (int h0 = 0; h0 < 2; h0 += Halves) {
    const uint8_t* g = p.w + t * pairs * kGroupBytes + 32 * h0;
    for (int64_t pair0 = 0, block = 0; pair0 < pairs; pair0 += blocks.pairs_per_block, ++block) {
      const int64_t pair1 = std::min(pairs, pair0 + blocks.pairs_per_block);
      __m256 acc[Rows][2 * Halves];
      for (int r = 0; r < Rows; ++r)
        for (int a = 0; a < 2 * Halves; ++a) acc[r][a] = _mm256_setzero_ps();
      for (int64_t pair = pair0; pair < pair1; ++pair, g += kGroupBytes) {
        _mm_prefetch(reinterpret_cast<const char*>(g) + kPrefetchBytes, _MM_HINT_T0);
        for (int h = 0; h < Halves; ++h) {
          __m256 f[4];
          convert(g + 32 * h, f);
          for (int r = 0; r < Rows; ++r) {
            const __m256 x0 = _mm256_broadcast_ss(xs[r] + 2 * pair);
            const __m256 x1 = _mm256_broadcast_ss(xs[r] + 2 * pair + 1);
            acc[r][2 * h] = _mm256_fmadd_ps(f[1], x1, _mm256_fmadd_ps(f[0], x0, acc[r][2 * h]));
            acc[r][2 * h + 1] = _mm256_fmadd_ps(f[3], x1, _mm256_fmadd_ps(f[2], x0, acc[r][2 * h + 1]));
          }
        }
      }
      if (block_scales) fill_lane_slots(p, blocks, block, lane_slots);
      for (int r = 0; r < Rows; ++r) {
        for (int a = 0; a < 2 * Halves; ++a) {
          float* total = totals[r] + 8 * (2 * h0 + a);
          const __m256 scaled =
              block_scales ? _mm256_mul_ps(acc[r][a], _mm256_load_ps(lane_slots + 8 * (2 * h0 + a))) : acc[r][a];
          _mm256_store_ps(total, _mm256_add_ps(_mm256_load_ps(total), scaled));
        }
      }
    }
  }
}

// The pre-scaled copy of row x (largest magnitude near 2^116) for the float32
// route, and the power of two that brings the sums back (see file comment).
// A zero or non-finite amax leaves x as is: the output is zero or
// non-finite anyway.
inline Pow2 prescale_row(const float* x, int64_t K, float* xs) {
  float amax = 0.0f;
  for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(x[k]));
  int e_max = 0;
  const bool usable = amax > 0.0f && std::isfinite(amax);
  if (usable) std::frexp(amax, &e_max);
  const int E = usable ? std::min(116 - e_max, 240) : 0;
  const Pow2 up(E);
  for (int64_t k = 0; k < K; ++k) xs[k] = up.apply(x[k]);
  return Pow2(112 - E);
}

// float32 -> bf16 bits of 8 lanes, as float_to_bf16_bits does each.
inline __m128i bf16_bits8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i high = _mm256_srli_epi32(u, 16);
  const __m256i rounded =
      _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), _mm256_and_si256(high, _mm256_set1_epi32(1)))), 16);
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
  const __m256i bits = _mm256_blendv_epi8(rounded, _mm256_or_si256(high, _mm256_set1_epi32(0x40)), nan);
  return _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1));
}

// Finishes row m of tile t from its sums in slot order: brings them back by
// `back`, multiplies by the channel multipliers (fill_channel_mult), then as
// store_tile_row does. A full tile goes in registers, in the same order of
// float32 operations as the scalar path, so the bits are the same; a tile
// past N (and fp16 output with MXCSR.FTZ set, under which vcvtps2ph is not
// documented to keep fp16 subnormals) goes through store_tile_row.
inline void store_slots_row(const LinearProblem& p, int64_t m, int64_t t, const float* slots, const Pow2& back,
                            bool folded) {
  const int64_t n0 = t * kTileN;
  if (n0 + kTileN > p.N || (p.out_dtype == kOutHalf && (_mm_getcsr() & 0x8000u))) {
    alignas(32) float sums[kTileN];
    float mult[kTileN];
    for (int s = 0; s < kTileN; ++s) sums[slot_channel(s)] = back.apply(slots[s]);
    fill_channel_mult(p, t, folded, mult);
    store_tile_row(p, m, t, sums, mult);
    return;
  }
  const __m256 first = _mm256_set1_ps(back.first), second = _mm256_set1_ps(back.second);
  const __m256 factor = _mm256_set1_ps(p.format_factor);
  const __m256 row = _mm256_set1_ps(p.row_scale ? p.row_scale[m] : 1.0f);
  for (int h = 0; h < 2; ++h) {
    // Even and odd channels of chunk h -> channels 16h .. 16h + 7 and 16h + 8 .. 16h + 15.
    const __m256 even = _mm256_load_ps(slots + 16 * h), odd = _mm256_load_ps(slots + 16 * h + 8);
    const __m256 lo = _mm256_unpacklo_ps(even, odd), hi = _mm256_unpackhi_ps(even, odd);
    const __m256 in_order[2] = {_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31)};
    for (int i = 0; i < 2; ++i) {
      const int64_t n = n0 + 16 * h + 8 * i;
      __m256 mult = _mm256_set1_ps(1.0f);
      if (!folded)
        mult = _mm256_mul_ps(p.scale_kind == kScaleTensor ? _mm256_set1_ps(p.scale[0]) : _mm256_loadu_ps(p.scale + n), factor);
      __m256 v = _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(in_order[i], first), second), mult);
      if (p.row_scale) v = _mm256_mul_ps(v, row);
      if (p.bias) v = _mm256_add_ps(v, _mm256_loadu_ps(p.bias + n));
      if (p.out_dtype == kOutFloat) {
        _mm256_storeu_ps(static_cast<float*>(p.out) + m * p.ldo + n, v);
      } else {
        const __m128i bits = p.out_dtype == kOutBFloat16 ? bf16_bits8(v) : _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(p.out) + m * p.ldo + n), bits);
      }
    }
  }
}

// M <= 4 on the float32 route: tensor and channel scales go into the
// channel multipliers at the end, block scales into the block totals.
template <int Format, int Rows>
void small_rows_f32(const LinearProblem& p, int64_t tile_begin, int64_t tile_end) {
  std::vector<float> storage(Rows * (p.Kp + 8), 0.0f);
  const float* xs[Rows];
  std::vector<Pow2> back;
  for (int r = 0; r < Rows; ++r) {
    float* row = storage.data() + r * (p.Kp + 8);
    back.push_back(prescale_row(p.x + r * p.ldx, p.K, row));
    xs[r] = row;
  }
  alignas(32) float sums[Rows][kTileN];
  const bool folded = p.scale_kind == kScaleBlock;
  int64_t t = tile_begin;
  if (Rows == 1) {
    alignas(32) float tile_sums[kStreams][kTileN];
    for (; t + kStreams <= tile_end; t += kStreams) {
      tiles_single_row_f32<Format, kStreams>(p, t, xs[0], tile_sums);
      for (int u = 0; u < kStreams; ++u) store_slots_row(p, 0, t + u, tile_sums[u], back[0], folded);
    }
  }
  for (; t < tile_end; ++t) {
    if (Rows == 1) {
      tiles_single_row_f32<Format, 1>(p, t, xs[0], sums);
    } else {
      tile_small_rows_f32<Format, Rows, Rows == 2 ? 2 : 1>(p, t, xs, sums);
    }
    for (int r = 0; r < Rows; ++r) store_slots_row(p, r, t, sums[r], back[r], folded);
  }
}

template <int Format>
void linear_tiles(const LinearProblem& p, int64_t tile_begin, int64_t tile_end) {
  if (p.M <= 4 && (p.scale_kind != kScaleBlock || p.bk % 2 == 0)) {
    const unsigned csr = _mm_getcsr();
    if (csr & 0x40u) _mm_setcsr(csr & ~0x40u);  // DAZ would flush the FP8 subnormals
    switch (p.M) {
      case 1:
        small_rows_f32<Format, 1>(p, tile_begin, tile_end);
        break;
      case 2:
        small_rows_f32<Format, 2>(p, tile_begin, tile_end);
        break;
      case 3:
        small_rows_f32<Format, 3>(p, tile_begin, tile_end);
        break;
      default:
        small_rows_f32<Format, 4>(p, tile_begin, tile_end);
    }
    if (csr & 0x40u) _mm_setcsr(csr);
    return;
  }
  float32::linear_tiles<Avx2Vector, Format>(p, tile_begin, tile_end);
}

}  // namespace

void linear_tiles_avx2(const LinearProblem& p, int64_t tile_begin, int64_t tile_end) {
  switch (p.format) {
    case kE5M2:
      return linear_tiles<kE5M2>(p, tile_begin, tile_end);
    default:  // e4m3fn and e4m3fnuz share the bits; only the factor (2^8 / 2^7) differs
      return linear_tiles<kE4M3FN>(p, tile_begin, tile_end);
  }
}

namespace {

// Decode attention: 16 FP8 bytes -> 16 float32 through the fp16 bit trick of
// kernel.h (e4m3: ((b & 0x80) << 8) | ((b & 0x7F) << 7), the value / 2^8;
// e5m2: b << 8, the value itself), FMA dot products and a polynomial exp.
struct Avx2AttentionOps {
  static float factor(int format) { return format_factor(format); }

  // A cache holds NaN codes where K or V was NaN (quantization keeps NaN):
  // e5m2's map to fp16 NaN/Inf by themselves; the e4m3 formats' NaN code
  // (0x7F/0xFF for e4m3fn, 0x80 for e4m3fnuz), shifted as a finite value,
  // would read as 480 or -0, so its fp16 exponent bits are set (0x7E00).
  static void row(const uint8_t* src, int64_t d, int format, float* dst) {
    int64_t i = 0;
    const bool e5m2 = format == kE5M2;
    const uint16_t nan_bits = format == kE4M3FNUZ ? 0xFF : 0x7F, nan_code = format == kE4M3FNUZ ? 0x80 : 0x7F;
    const __m256i nan_mask = _mm256_set1_epi16(static_cast<int16_t>(nan_bits));
    const __m256i nan_value = _mm256_set1_epi16(static_cast<int16_t>(nan_code));
    for (; i + 16 <= d; i += 16) {
      const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
      __m256i bits;
      if (e5m2) {
        bits = _mm256_slli_epi16(w, 8);
      } else {
        const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8);
        const __m256i magnitude = _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7F)), 7);
        const __m256i nan = _mm256_cmpeq_epi16(_mm256_and_si256(w, nan_mask), nan_value);
        bits = _mm256_or_si256(_mm256_or_si256(sign, magnitude), _mm256_and_si256(nan, _mm256_set1_epi16(0x7E00)));
      }
      _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm256_castsi256_si128(bits)));
      _mm256_storeu_ps(dst + i + 8, _mm256_cvtph_ps(_mm256_extracti128_si256(bits, 1)));
    }
    for (; i < d; ++i) {
      const uint16_t b = src[i];
      uint16_t bits = e5m2 ? static_cast<uint16_t>(b << 8) : static_cast<uint16_t>(((b & 0x80) << 8) | ((b & 0x7F) << 7));
      if (!e5m2 && (b & nan_bits) == nan_code) bits |= 0x7E00;
      dst[i] = _cvtsh_ss(bits);
    }
  }

  static float hsum(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
  }

  static float dot(const float* a, const float* b, int64_t d) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= d; i += 16) {
      s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
      s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    }
    for (; i + 8 <= d; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    float sum = hsum(_mm256_add_ps(s0, s1));
    for (; i < d; ++i) sum += a[i] * b[i];
    return sum;
  }

  static void axpy(float alpha, const float* x, float* y, int64_t d) {
    const __m256 a = _mm256_set1_ps(alpha);
    int64_t i = 0;
    for (; i + 8 <= d; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(a, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < d; ++i) y[i] += alpha * x[i];
  }

  // exp(x) for x <= 0: 2^n * p(r), r = x - n ln 2 in [-ln2/2, ln2/2], a
  // degree-6 polynomial (relative error ~1e-7); below -87 it is taken as 0.
  // NaN stays NaN (a NaN key's score): max_ps returns its second operand
  // when either is NaN.
  static __m256 exp_nonpositive(__m256 x) {
    const __m256 tiny = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ);
    x = _mm256_max_ps(_mm256_set1_ps(-87.0f), x);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i pow2 = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(pow2)));
  }

  static float exp_shift(float* s, int64_t n, float top) {
    const __m256 t = _mm256_set1_ps(top);
    __m256 sum = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + i), t));
      _mm256_storeu_ps(s + i, e);
      sum = _mm256_add_ps(sum, e);
    }
    float total = hsum(sum);
    for (; i < n; ++i) total += (s[i] = std::exp(s[i] - top));
    return total;
  }
};

}  // namespace

void decode_attention_avx2(const DecodeAttention& a, int64_t task_begin, int64_t task_end) {
  decode_attention_tasks<Avx2AttentionOps>(a, task_begin, task_end);
}

// The activation helpers (kernel_activation_impl.h) on 256-bit vectors.
double grid_error_avx2(const float* row, int64_t K, float inverse, const Fp8Grid& grid) {
  return activation::grid_error_any<Avx2Vector>(row, K, inverse, grid);
}

void quantize_row_avx2(const float* row, int64_t K, float scale, float post, const Fp8Grid& grid, float* out) {
  activation::quantize_row_any<Avx2Vector>(row, K, scale, post, grid, out);
}

float finite_amax_avx2(const float* row, int64_t K) { return activation::finite_amax<Avx2Vector>(row, K); }

}  // namespace qfp8
