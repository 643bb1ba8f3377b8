// AVX512-BF16 kernel (compiled with the AVX512 flags plus -mavx512bf16
// -mavx512vbmi; chosen only when the CPU reports both).
//
// FP8 -> bf16 by table: every FP8 value is exact in bf16 (3 or 2 mantissa
// bits, exponents from 2^-16 to 2^15, all normal in bf16), so no scale or
// power-of-two factor is folded into the weights. The low and high bytes of
// the bf16 of each code come from two 128-entry tables indexed by the code's
// low seven bits (vpermt2b ignores bit 7); the sign bit is or-ed into the
// high byte. One 64-byte group of the packed layout (32 channels x a k pair)
// becomes, by two byte interleaves, two zmm registers of bf16 pairs:
// dword i of the first holds channel 8 * (i / 4) + i % 4, of the second the
// same plus 4, each with its two k side by side - the operand vdpbf16ps
// multiplies against a broadcast pair of activations.
//
// Activations: each row of x (float32 in the LinearProblem) is split into
// bf16 parts x = hi + mid + lo, each the bf16 rounding of what the previous
// parts left. bf16 inputs and FP8-quantized activations (W8A8) are exact in
// hi alone; fp16 inputs in hi + mid; float32 needs all three (8 + 8 + 8
// significant bits). Each part is one more "virtual row" accumulated into the
// same output row, so the products are exact and only the float32 sums round,
// as in the float32 kernels. vdpbf16ps treats bf16 denormals as zero and
// flushes denormal results: a call whose activations hold nonzero magnitudes
// below 2^-80 (where a part times the smallest FP8 weight could be flushed)
// runs the float32 AVX512 code of kernel_avx512_impl.h instead, as does a
// float32 x beyond bf16's range (finite, rounding to Inf in bf16) and a
// block scale whose k-block is odd (a k pair would straddle two scales).
//
// Scales: tensor and channel scales multiply the finished sums; block scales
// multiply each k block's partial sums as they are added to the output's.
//
// Up to 4 virtual rows (M == 1 included): a fused loop converts each group
// and multiplies it at once (memory-bound: two groups per step, so every row
// has four independent accumulators; software prefetch 8 KB ahead, 3.5 KB on
// Zen 4, 2 KB on Intel, at most 4 KB for one row when threads share the call).
// More rows: a register-blocked loop of up to 12 virtual rows x 32 channels
// (24 zmm accumulators, a broadcast activation pair per row and k pair) goes
// through K chunk by chunk (512 k pairs). Up to 64 virtual rows it converts
// each group in registers as it multiplies it (every row block converts the
// chunk again, from L1/L2); more rows multiply a bf16 panel (64 KB, in L2)
// converted once per chunk, by the chunk's first row block as it multiplies
// it (512-pair chunks: smaller ones in L1 are slower at large M). The last
// row block prefetches the next chunk's weights, a line per k pair. When the
// activations outgrow L2, four tiles go through K together, so each row block's activations are read once for the four. The
// activations of these loops are laid out by register block (Activations).
// When the activations outgrow the cache, the rows go through the tiles in
// groups, and a group's rows through K in segments (see RowGroup).
//
// The activations are split once per call (prepare_avx512bf16, before the
// tiles are shared out among threads), not once per thread; their layout by
// register block is shared out among the call's threads. With many rows, each
// thread lays out a part of the rows and takes it through every tile
// (Activations::row_parts), so that its activations stay in its own cache.
#include <cpuid.h>
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <new>
#include <utility>
#include <vector>

#define QFP8_AVX512_ENTRY linear_tiles_avx512bf16_float32
#include "kernel_avx512_impl.h"
#undef QFP8_AVX512_ENTRY
#include "kernel_activation_impl.h"
#include "kernel_bf16_common.h"
#include "kernel_avx512bf16_activations.h"

namespace qfp8 {
namespace bf16 {
namespace {

constexpr int64_t kGroupTiles = 4;    // tiles that go through K together (M > 4)
// Groups ahead the fused loop asks for, tuned per CPU family (the figures
// are in docs/cpu-kernels-measurements.md): 8 KB by default, 4 KB for one
// row when threads share the call (each then gets less of the memory's
// bandwidth), 3.5 KB on Zen 4 (AMD family 0x19), 2 KB on Intel, where
// prefetcht0 far ahead keeps L1 fill buffers waiting on DRAM that the L2
// streamer would have filled anyway.
constexpr int64_t kPrefetchPairs = 128;
constexpr int64_t kZen4PrefetchPairs = 56;
constexpr int64_t kIntelPrefetchPairs = 32;
constexpr int64_t kSharedPrefetchPairs = 64;

int64_t prefetch_pairs() {
  static const int64_t pairs = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid(0, &a, &b, &c, &d)) return kPrefetchPairs;
    if (b == 0x756e6547 && d == 0x49656e69 && c == 0x6c65746e) return kIntelPrefetchPairs;  // "GenuineIntel"
    const bool amd = b == 0x68747541 && d == 0x69746e65 && c == 0x444d4163;  // "AuthenticAMD"
    if (!amd || !__get_cpuid(1, &a, &b, &c, &d)) return kPrefetchPairs;
    const unsigned family = ((a >> 8) & 0xF) + (((a >> 8) & 0xF) == 0xF ? (a >> 20) & 0xFF : 0);
    return family == 0x19 ? kZen4PrefetchPairs : kPrefetchPairs;
  }();
  return pairs;
}

inline __m512 dot(__m512 acc, __m512i w, __m512i x) {
  return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)x);
}

constexpr int64_t kActivationGroupPairs = kActivationGroup / 2;

// The end (in k pairs) of the run of pairs from `start` that one weight scale
// block (Block) and one activation group (with group scales) cover: partial
// sums are scaled at each such end.
template <bool Block>
inline int64_t segment_end(const LinearProblem& p, int64_t start, int64_t pairs) {
  int64_t end = pairs;
  if (Block) end = std::min(end, (start / (p.bk / 2) + 1) * (p.bk / 2));
  if (p.group_scale) end = std::min(end, (start / kActivationGroupPairs + 1) * kActivationGroupPairs);
  return end;
}

// out += sum, times the lanes' block scales and the row's group scale where given.
inline void add_scaled(float* out, __m512 sum, const __m512* lane, const float* row_scale) {
  const __m512 before = _mm512_loadu_ps(out);
  if (row_scale) {
    const __m512 mult = _mm512_set1_ps(*row_scale);
    _mm512_storeu_ps(out, _mm512_fmadd_ps(sum, lane ? _mm512_mul_ps(*lane, mult) : mult, before));
  } else {
    _mm512_storeu_ps(out, lane ? _mm512_fmadd_ps(sum, *lane, before) : _mm512_add_ps(before, sum));
  }
}

// The group scales of output rows `rows[0..count)` for the activation group of pair `start`.
inline void row_group_scales(const LinearProblem& p, const int64_t* rows, int count, int64_t start, float* out) {
  for (int r = 0; r < count; ++r) out[r] = p.group_scale[rows[r] * p.group_cols + start / kActivationGroupPairs];
}

// One to four virtual rows (M == 1 included): each group is converted and
// multiplied at once, two groups per step so that every row has four
// independent accumulators; the loop waits on memory, and asks for it ahead.
// Adds (times the block scales) into the rows' lane-order accumulators.
template <int Rows, bool Block>
void tile_few_rows(const LinearProblem& p, const Tables& tb, int64_t t, const uint32_t* x, int64_t ld,
                   float* const* acc_rows, const int64_t* output_rows) {
  const int64_t pairs = p.Kp / 2;
  const uint8_t* g = p.w + t * pairs * kGroupBytes;
  const int64_t ahead = Rows == 1 && p.threads > 1 ? std::min(kSharedPrefetchPairs, prefetch_pairs()) : prefetch_pairs();
  for (int64_t s0 = 0, s1; s0 < pairs; s0 = s1) {
    s1 = segment_end<Block>(p, s0, pairs);
    __m512 acc[Rows][4];
    for (int r = 0; r < Rows; ++r) acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = _mm512_setzero_ps();
    int64_t i = s0;
    for (; i + 2 <= s1; i += 2) {
      _mm_prefetch(reinterpret_cast<const char*>(g + (i + ahead) * kGroupBytes), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(g + (i + ahead + 1) * kGroupBytes), _MM_HINT_T0);
      __m512i w00, w01, w10, w11;
      convert_group(tb, g + i * kGroupBytes, w00, w01);
      convert_group(tb, g + (i + 1) * kGroupBytes, w10, w11);
      for (int r = 0; r < Rows; ++r) {
        const __m512i x0 = _mm512_set1_epi32(static_cast<int>(x[r * ld + i]));
        const __m512i x1 = _mm512_set1_epi32(static_cast<int>(x[r * ld + i + 1]));
        acc[r][0] = dot(acc[r][0], w00, x0);
        acc[r][1] = dot(acc[r][1], w01, x0);
        acc[r][2] = dot(acc[r][2], w10, x1);
        acc[r][3] = dot(acc[r][3], w11, x1);
      }
    }
    if (i < s1) {
      __m512i w0, w1;
      convert_group(tb, g + i * kGroupBytes, w0, w1);
      for (int r = 0; r < Rows; ++r) {
        const __m512i x0 = _mm512_set1_epi32(static_cast<int>(x[r * ld + i]));
        acc[r][0] = dot(acc[r][0], w0, x0);
        acc[r][1] = dot(acc[r][1], w1, x0);
      }
    }
    __m512 scale[2];
    if (Block) lane_block_scales(p, t, 2 * s0, scale[0], scale[1]);
    float row_mult[Rows];
    if (p.group_scale) row_group_scales(p, output_rows, Rows, s0, row_mult);
    for (int r = 0; r < Rows; ++r) {  // in row order (two virtual rows may share an output row)
      for (int j = 0; j < 2; ++j) {
        add_scaled(acc_rows[r] + 16 * j, _mm512_add_ps(acc[r][j], acc[r][2 + j]), Block ? &scale[j] : nullptr,
                   p.group_scale ? &row_mult[r] : nullptr);
      }
    }
  }
}

using FewRowsFn = void (*)(const LinearProblem&, const Tables&, int64_t, const uint32_t*, int64_t, float* const*,
                           const int64_t*);
constexpr FewRowsFn kFewRowsFns[2][kFewRows + 1] = {
    {nullptr, tile_few_rows<1, false>, tile_few_rows<2, false>, tile_few_rows<3, false>, tile_few_rows<4, false>},
    {nullptr, tile_few_rows<1, true>, tile_few_rows<2, true>, tile_few_rows<3, true>, tile_few_rows<4, true>}};

// The runs of a panel chunk over which the scales are constant (one weight
// block and one activation group), with their scales: a chunk keeps its
// 512 pairs whatever the block and group sizes (shorter chunks are slower at
// large M, block scales or not), and its partial sums
// are scaled and added at the end of each run.
struct ChunkRuns {
  int count = 0;
  std::vector<int64_t> end;  // [count] the run's end, in pairs from the chunk's start
  std::vector<__m512> lane;  // [tiles][count][2] the tile's block scales in lane order (Block)
  std::vector<float> row;    // [count][kMaxRows] the row block's group scales (group scales)
};

// Rows x a converted panel of `count` pairs; adds each run's sums (times the
// tile's block scales `lane` [run][2], and each row's group scale
// `row` [run][kMaxRows], when given) into the rows' lane-order accumulators.
// The register block's sums over the panel's pairs [begin, end): acc[r][j] is
// row r times channels 16 j.. of the tile in lane order; the prefetch asks for
// a line per pair.
// Whether the register blocks convert the FP8 groups as they multiply them
// (up to kFusedMaxRows virtual rows) instead of multiplying a bf16 panel
// converted once per chunk. The conversion's byte shuffles run beside
// vdpbf16ps almost for free, while writing the panel costs as much as the
// multiplies of 4 rows, so few rows gain most; past 64 rows the two are as
// fast and the panel stays.
constexpr int64_t kFusedMaxRows = 64;
inline bool fuses(const Activations& a) { return a.rows <= kFusedMaxRows; }

// Where a register block takes the weights it multiplies from: a converted
// bf16 panel (two zmm a pair), or the packed FP8 groups themselves, converted
// in registers as they are multiplied, and with kFusedToPanel also stored
// into the panel for the row blocks after it. The first row block of a
// panel chunk does that instead of a conversion pass of its own before the
// blocks: the shuffles then run beside its vdpbf16ps (the same bits).
enum Source : int { kFromPanel = 0, kFused = 1, kFusedToPanel = 2 };

struct BlockWeights {
  const void* w;  // __m512i panel or uint8_t groups, at the chunk's first pair
  const Tables* tb;
  __m512i* panel = nullptr;  // kFusedToPanel: where the converted groups go
};

template <int Src>
inline void block_weights(const BlockWeights& bw, const Tables& tb, int64_t i, __m512i& w0, __m512i& w1) {
  if (Src != kFromPanel) {
    convert_group(tb, static_cast<const uint8_t*>(bw.w) + i * kGroupBytes, w0, w1);
    if (Src == kFusedToPanel) {
      _mm512_store_si512(bw.panel + 2 * i, w0);
      _mm512_store_si512(bw.panel + 2 * i + 1, w1);
    }
  } else {
    const __m512i* panel = static_cast<const __m512i*>(bw.w);
    w0 = _mm512_load_si512(panel + 2 * i);
    w1 = _mm512_load_si512(panel + 2 * i + 1);
  }
}

template <int Rows, int Src>
inline void panel_sums(const BlockWeights& bw, const uint32_t* x, int64_t begin, int64_t end, const uint8_t* prefetch,
                       __m512 (&acc)[Rows][2]) {
  const Tables tb = *bw.tb;  // in registers through the loop
  for (int r = 0; r < Rows; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t i = begin; i < end; ++i) {
    if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(prefetch + i * kGroupBytes), _MM_HINT_T0);
    __m512i w0, w1;
    block_weights<Src>(bw, tb, i, w0, w1);
    for (int r = 0; r < Rows; ++r) {
      const __m512i xv = _mm512_set1_epi32(static_cast<int>(x[i * Rows + r]));
      acc[r][0] = dot(acc[r][0], w0, xv);
      acc[r][1] = dot(acc[r][1], w1, xv);
    }
  }
}

// The scales panel_rows applies to each run's sums, a template argument so
// that the adds at a run's end are straight-line code (chosen at run time,
// with the output rows' pointers read from memory at each run's end, they
// added a tenth or more to the time of block scales over channel scales).
enum RunScales : int { kNoRunScales = 0, kLaneScales = 1, kRowScales = 2, kLaneAndRowScales = 3 };

template <int Rows, int Src, int Scales>
void panel_rows(const BlockWeights& bw, const uint32_t* x, float* const* acc_rows, int runs, const int64_t* run_end,
                const __m512* lane, const float* row, const uint8_t* prefetch) {
  constexpr bool kLane = Scales & kLaneScales, kRow = Scales & kRowScales;
  float* out[Rows];
  for (int r = 0; r < Rows; ++r) out[r] = acc_rows[r];
  for (int run = 0; run < runs; ++run) {
    __m512 acc[Rows][2];
    panel_sums<Rows, Src>(bw, x, run ? run_end[run - 1] : 0, run_end[run], prefetch, acc);
    const __m512 lane0 = kLane ? lane[2 * run] : _mm512_setzero_ps();
    const __m512 lane1 = kLane ? lane[2 * run + 1] : _mm512_setzero_ps();
    // In row order: two virtual rows of one output row add one after the other.
#pragma GCC unroll 16
    for (int r = 0; r < Rows; ++r) {
      __m512 s0 = lane0, s1 = lane1;
      if (kRow) {
        const __m512 g = _mm512_set1_ps(row[run * kMaxRows + r]);
        s0 = kLane ? _mm512_mul_ps(lane0, g) : g;
        s1 = kLane ? _mm512_mul_ps(lane1, g) : g;
      }
      if (kLane || kRow) {
        _mm512_storeu_ps(out[r], _mm512_fmadd_ps(acc[r][0], s0, _mm512_loadu_ps(out[r])));
        _mm512_storeu_ps(out[r] + 16, _mm512_fmadd_ps(acc[r][1], s1, _mm512_loadu_ps(out[r] + 16)));
      } else {
        _mm512_storeu_ps(out[r], _mm512_add_ps(_mm512_loadu_ps(out[r]), acc[r][0]));
        _mm512_storeu_ps(out[r] + 16, _mm512_add_ps(_mm512_loadu_ps(out[r] + 16), acc[r][1]));
      }
    }
  }
}

// Rows x weights that hold the whole K (one chunk, one run: no block or group
// scales) of one-part activations: the finished sums go straight to the
// output rows m0.. (store_lanes), not through the lane-order accumulators.
// With little K per output (K = 64-512 at large M) the accumulators' zeroing,
// adding and reading back would cost as much as the multiplies.
template <int Rows, int Src>
void panel_rows_store(const LinearProblem& p, const BlockWeights& bw, const uint32_t* x, int64_t count, int64_t m0,
                      int64_t tile, const float* mult, const uint8_t* prefetch) {
  __m512 acc[Rows][2];
  panel_sums<Rows, Src>(bw, x, 0, count, prefetch, acc);
  for (int r = 0; r < Rows; ++r) store_lanes(p, m0 + r, tile, acc[r][0], acc[r][1], mult);
}

using PanelStoreFn = void (*)(const LinearProblem&, const BlockWeights&, const uint32_t*, int64_t, int64_t, int64_t,
                              const float*, const uint8_t*);
using PanelRowsFn = void (*)(const BlockWeights&, const uint32_t*, float* const*, int, const int64_t*, const __m512*,
                             const float*, const uint8_t*);

// [Source][rows]
template <int Src, size_t... Rows>
constexpr std::array<PanelStoreFn, kMaxRows + 1> panel_store_fns(std::index_sequence<Rows...>) {
  return {nullptr, panel_rows_store<Rows + 1, Src>...};
}
template <int Src, int Scales, size_t... Rows>
constexpr std::array<PanelRowsFn, kMaxRows + 1> panel_rows_fns(std::index_sequence<Rows...>) {
  return {nullptr, panel_rows<Rows + 1, Src, Scales>...};
}
template <int Src>
constexpr std::array<std::array<PanelRowsFn, kMaxRows + 1>, 4> panel_rows_by_scales() {  // [RunScales][rows]
  constexpr auto rows = std::make_index_sequence<kMaxRows>();
  return {panel_rows_fns<Src, kNoRunScales>(rows), panel_rows_fns<Src, kLaneScales>(rows),
          panel_rows_fns<Src, kRowScales>(rows), panel_rows_fns<Src, kLaneAndRowScales>(rows)};
}
constexpr std::array<PanelStoreFn, kMaxRows + 1> kPanelStore[3] = {
    panel_store_fns<kFromPanel>(std::make_index_sequence<kMaxRows>()),
    panel_store_fns<kFused>(std::make_index_sequence<kMaxRows>()),
    panel_store_fns<kFusedToPanel>(std::make_index_sequence<kMaxRows>())};
constexpr std::array<std::array<PanelRowsFn, kMaxRows + 1>, 4> kPanelRows[3] = {  // [Source][RunScales][rows]
    panel_rows_by_scales<kFromPanel>(), panel_rows_by_scales<kFused>(), panel_rows_by_scales<kFusedToPanel>()};

// Tiles [t0, t0 + tiles) (tiles <= kGroupTiles): acc holds each tile's
// [M][32] lane-order sums. Up to kFewRows rows, tile by tile through the
// fused loop. More, the tiles of a group go through K together, so a row
// block's activations (12 rows x a chunk, in L1) serve every tile of the
// group before the next block's are read.
// Whether tile_group writes the output itself (panel_rows_store): more rows than
// the fused loop takes, the whole K in one panel chunk, one activation part,
// no block or group scales.
inline bool stores_directly(const LinearProblem& p, const Activations& a) {
  return p.scale_kind != kScaleBlock && !p.group_scale && a.parts == 1 && a.rows > kFewRows && a.pairs <= kChunkPairs;
}

// Row groups and K segments. Each group of tiles reads every row block's
// activations once; with more activations than the cache keeps between two
// groups (a core's share of a shared L3, a few MB), every group would read
// them from memory. So:
// - past kCachedBytes of activations of one part (the parts of a row must
//   meet in its sums), the rows go in groups that each go through every tile
//   (the weights are read and converted again per group): as many rows as
//   keep a group's activations within kCachedBytes, kMinGroupRows to
//   kMaxGroupRows.
// - past kCachedBytes of a group's activations (several parts, or a K so
//   long that kMinGroupRows outgrow it), its tiles go through K a segment
//   (of up to kSegmentBytes) at a time, all the tiles of a span before the
//   next segment, keeping their sums in lane order until the last.
// Either way each sum gets the same additions in the same order: the same
// bits.
constexpr int64_t kCachedBytes = int64_t(4) << 20;
constexpr int64_t kMinGroupRows = 96;
constexpr int64_t kMaxGroupRows = 256;
constexpr int64_t kSegmentBytes = int64_t(2) << 20;
constexpr int64_t kSpanBytes = int64_t(8) << 20;  // lane-order sums of a span's tiles

// How many row groups the rows of register blocks [b_begin, b_end) go in.
inline int64_t row_group_count(const Activations& a, int64_t b_begin, int64_t b_end) {
  const int64_t rows = a.block_start(b_end) - a.block_start(b_begin);
  if (a.parts != 1 || rows * a.pairs * 4 <= kCachedBytes) return 1;
  const int64_t group_rows = std::clamp(kCachedBytes / (a.pairs * 4), kMinGroupRows, kMaxGroupRows);
  return (rows + group_rows - 1) / group_rows;
}

// The register blocks [b_begin, b_end) of a row group, and the output rows
// [m0, m0 + rows) its lane-order sums hold (with more than one part, the one
// group of all blocks and every output row).
struct RowGroup {
  int64_t b_begin, b_end, m0, rows;
  int64_t virtual_rows(const Activations& a) const { return a.block_start(b_end) - a.block_start(b_begin); }
};

// Row group g of `count` of register blocks [b_begin, b_end), of as even sizes as they can be.
inline RowGroup row_group(const LinearProblem& p, const Activations& a, int64_t b_begin, int64_t b_end, int64_t g,
                          int64_t count) {
  if (count == 1 && b_begin == 0 && b_end == a.blocks) return {0, a.blocks, 0, p.M};
  const int64_t b0 = b_begin + g * (b_end - b_begin) / count, b1 = b_begin + (g + 1) * (b_end - b_begin) / count;
  return {b0, b1, a.block_start(b0), a.block_start(b1) - a.block_start(b0)};  // one part: virtual row = output row
}

// Pairs a segment covers (whole chunks), or all of them when the group's
// activations stay in the cache or its rows are few (tile_few_rows goes
// through K at once).
inline int64_t segment_pairs(const Activations& a, const RowGroup& g) {
  const int64_t rows = g.virtual_rows(a);
  if (rows <= kFewRows || rows * a.pairs * 4 <= kCachedBytes) return a.pairs;
  return std::max<int64_t>(1, kSegmentBytes / (rows * 4 * kChunkPairs)) * kChunkPairs;
}

// Tiles whose sums are kept together across the K segments (a multiple of
// `group`); one group when K is not segmented.
inline int64_t span_tiles(const Activations& a, const RowGroup& g, int64_t segment, int64_t group) {
  if (segment >= a.pairs) return group;
  return std::max<int64_t>(1, kSpanBytes / (g.rows * kTileN * 4 * group)) * group;
}

// Writes the output rows itself when stores_directly, else leaves their sums
// in acc ([tiles][g.rows][32]) for store_lanes. Only the register blocks of
// row group g, and with many rows only the pairs [c_begin, c_end) (a K
// segment, see segment_pairs): acc starts at zero with the first segment and
// gathers the others' sums.
template <bool Block>
void tile_group(const LinearProblem& p, const Tables& tb, const Activations& a, const RowGroup& g, int64_t t0,
                int64_t tiles, __m512i* panels, float* acc, ChunkRuns& runs, int64_t c_begin, int64_t c_end) {
  const int64_t pairs = a.pairs;
  const int64_t tile_bytes = pairs * kGroupBytes;
  const bool fused = fuses(a);
  if (stores_directly(p, a)) {
    const uint8_t* w = p.w + t0 * tile_bytes;
    float mult[kGroupTiles][kTileN];
    for (int64_t j = 0; j < tiles; ++j) {
      fill_channel_mult(p, t0 + j, false, mult[j]);
    }
    for (int64_t b = g.b_begin; b < g.b_end; ++b) {
      const int64_t v0 = a.block_start(b);
      for (int64_t j = 0; j < tiles; ++j) {
        // The last row block asks for the next group's tile (see below).
        const uint8_t* next = b == g.b_end - 1 ? w + (tiles + j) * tile_bytes : nullptr;
        const int src = fused ? kFused : (b == g.b_begin ? kFusedToPanel : kFromPanel);  // see Source
        __m512i* panel = panels + j * 2 * kChunkPairs;
        const BlockWeights bw{src == kFromPanel ? static_cast<const void*>(panel) : w + j * tile_bytes, &tb, panel};
        kPanelStore[src][a.rows_in(b)](p, bw, a.block(b, 0), pairs, v0, t0 + j, mult[j], next);
      }
    }
    return;
  }
  if (c_begin == 0) std::fill(acc, acc + tiles * g.rows * kTileN, 0.0f);
  if (a.rows <= kFewRows) {  // one row group of every row
    for (int64_t j = 0; j < tiles; ++j) {
      float* acc_rows[kFewRows];
      for (int r = 0; r < a.rows; ++r) acc_rows[r] = acc + (j * p.M + a.output_row[r]) * kTileN;
      kFewRowsFns[Block][a.rows](p, tb, t0 + j, a.row(0), pairs, acc_rows, a.output_row.data());
    }
    return;
  }
  const uint8_t* w = p.w + t0 * tile_bytes;
  const bool grouped = p.group_scale != nullptr;
  const int run_scales = (Block ? kLaneScales : 0) | (grouped ? kRowScales : 0);
  for (int64_t c0 = c_begin; c0 < c_end;) {
    const int64_t count = std::min(kChunkPairs, c_end - c0);
    runs.count = 0;
    for (int64_t r0 = c0, r1; r0 < c0 + count; r0 = r1) {
      r1 = std::min(c0 + count, segment_end<Block>(p, r0, pairs));
      runs.end[runs.count++] = r1 - c0;
    }
    for (int64_t j = 0; j < tiles; ++j) {
      if (Block) {
        for (int run = 0; run < runs.count; ++run) {
          __m512* lane = runs.lane.data() + (j * kChunkPairs + run) * 2;
          lane_block_scales(p, t0 + j, 2 * (c0 + (run ? runs.end[run - 1] : 0)), lane[0], lane[1]);
        }
      }
    }
    for (int64_t b = g.b_begin; b < g.b_end; ++b) {
      const int64_t v0 = a.block_start(b);
      const int rows = a.rows_in(b);
      if (grouped) {
        for (int run = 0; run < runs.count; ++run) {
          row_group_scales(p, a.output_row.data() + v0, rows, c0 + (run ? runs.end[run - 1] : 0),
                           runs.row.data() + run * kMaxRows);
        }
      }
      for (int64_t j = 0; j < tiles; ++j) {
        float* acc_rows[kMaxRows];
        for (int r = 0; r < rows; ++r) acc_rows[r] = acc + (j * g.rows + a.output_row[v0 + r] - g.m0) * kTileN;
        // The last row block asks for each tile's next chunk (after the
        // segment's last, its first in the tile a group further), a line per
        // k pair, so that it streams in while this one is multiplied (asked
        // for by the first block, the lines would wait through every block
        // and partly leave L2 again).
        const uint8_t* next = w + j * tile_bytes +
                              (c0 + count < c_end ? (c0 + count) * kGroupBytes : tiles * tile_bytes + c_begin * kGroupBytes);
        const void* weights = w + j * tile_bytes + c0 * kGroupBytes;
        const int src = fused ? kFused : (b == g.b_begin ? kFusedToPanel : kFromPanel);  // see Source
        __m512i* panel = panels + j * 2 * kChunkPairs;
        const BlockWeights bw{src == kFromPanel ? static_cast<const void*>(panel) : weights, &tb, panel};
        kPanelRows[src][run_scales][rows](bw, a.block(b, c0), acc_rows, runs.count, runs.end.data(),
                                          Block ? runs.lane.data() + j * kChunkPairs * 2 : nullptr,
                                          grouped ? runs.row.data() : nullptr, b == g.b_end - 1 ? next : nullptr);
      }
    }
    c0 += count;
  }
}

}  // namespace
}  // namespace bf16

std::shared_ptr<const void> prepare_avx512bf16(const LinearProblem& p) {
  if (p.scale_kind == kScaleBlock && p.bk % 2 != 0) return nullptr;  // the float32 code
  auto a = std::make_shared<bf16::Activations>();
  if (p.x_bf16) {
    if (!bf16::take_bf16_activations(p, *a)) return nullptr;
  } else {
    const int parts = bf16::split_activations(p, 1, *a);  // bf16 inputs and FP8 activations: one pass
    if (parts == 0) return nullptr;
    if (parts > 1) bf16::split_activations(p, parts, *a);
  }
  a->row_parts = a->rows > bf16::kFewRows ? bf16::row_parts_for(*a) : 1;
  if (a->rows > bf16::kFewRows && !a->interleave(p.x_bf16 != nullptr)) return nullptr;
  return a;
}

std::shared_ptr<const void> prepare_patches_avx512bf16(const LinearProblem& p) {
  const PatchRows* patches = p.patches;
  if (!patches || !p.x_bf16 || p.M <= bf16::kFewRows || patches->segment_length % 2 != 0) return nullptr;
  if (p.scale_kind == kScaleBlock && p.bk % 2 != 0) return nullptr;
  auto a = std::make_shared<bf16::Activations>();
  a->shape(1, p.M, p.Kp);
  a->row_parts = bf16::row_parts_for(*a);
  if (!a->interleave(true, p.x_bf16, patches)) return nullptr;
  return a;
}

int64_t prepared_row_parts_avx512bf16(const void* prepared) {
  return static_cast<const bf16::Activations*>(prepared)->row_parts;
}

void linear_tiles_avx512bf16(const LinearProblem& problem, int64_t tile_begin, int64_t tile_end) {
  if (!problem.prepared) return linear_tiles_avx512bf16_float32(problem, tile_begin, tile_end);
  const bf16::Activations& a = *static_cast<const bf16::Activations*>(problem.prepared);
  LinearProblem p = problem;
  p.format_factor = 1.0f;  // the tables give the FP8 values themselves
  // Built once per format (128 ldexp each), not per call.
  static const bf16::Tables tables[3] = {bf16::make_tables(kE4M3FN), bf16::make_tables(kE5M2),
                                         bf16::make_tables(kE4M3FNUZ)};
  const bf16::Tables& tb = tables[p.format];
  // Panels: 64 KB a tile, 64-byte aligned, for more than kFewRows rows.
  const bool panel = a.rows > bf16::kFewRows && !bf16::fuses(a);
  std::vector<float> panel_storage;
  float mult[kTileN];
  const bool block = p.scale_kind == kScaleBlock;
  bf16::ChunkRuns runs;  // a chunk has at most one run per pair
  runs.end.resize(bf16::kChunkPairs);
  if (block) runs.lane.resize(bf16::kGroupTiles * bf16::kChunkPairs * 2);  // the most tiles a group has
  if (p.group_scale) runs.row.resize(bf16::kChunkPairs * bf16::kMaxRows);
  const bool stores = bf16::stores_directly(p, a);
  std::vector<float> lanes;
  // One row part (see Activations::row_parts), or all the rows.
  const bool part = p.row_parts > 1;
  const int64_t b_begin = part ? a.part_block(p.row_part) : 0, b_end = part ? a.part_block(p.row_part + 1) : a.blocks;
  const int64_t row_groups = bf16::row_group_count(a, b_begin, b_end);
  for (int64_t r = 0; r < row_groups; ++r) {
    const bf16::RowGroup g = bf16::row_group(p, a, b_begin, b_end, r, row_groups);
    // Grouped tiles only when the activations outgrow L2 (below, grouping
    // gains nothing and slows small calls).
    const bool large = g.virtual_rows(a) * a.pairs * 4 > (int64_t(512) << 10);
    const int64_t group = std::min<int64_t>(large ? bf16::kGroupTiles : 1, tile_end - tile_begin);
    const int64_t segment = bf16::segment_pairs(a, g);
    const int64_t span = std::min(bf16::span_tiles(a, g, segment, group), tile_end - tile_begin);
    if (!stores) lanes.resize(std::max<size_t>(lanes.size(), span * g.rows * kTileN));
    if (panel) panel_storage.resize(std::max<size_t>(panel_storage.size(), group * 2 * bf16::kChunkPairs * 16 + 16));
    __m512i* panels = reinterpret_cast<__m512i*>((reinterpret_cast<uintptr_t>(panel_storage.data()) + 63) & ~uintptr_t(63));
    for (int64_t s0 = tile_begin; s0 < tile_end; s0 += span) {
      const int64_t s1 = std::min(s0 + span, tile_end);
      for (int64_t c = 0; c < a.pairs; c += segment) {
        const int64_t c_end = std::min(c + segment, a.pairs);
        for (int64_t t0 = s0; t0 < s1; t0 += group) {
          const int64_t tiles = std::min(group, s1 - t0);
          float* acc = stores ? nullptr : lanes.data() + (t0 - s0) * g.rows * kTileN;
          if (block) {
            bf16::tile_group<true>(p, tb, a, g, t0, tiles, panels, acc, runs, c, c_end);
          } else {
            bf16::tile_group<false>(p, tb, a, g, t0, tiles, panels, acc, runs, c, c_end);
          }
        }
      }
      for (int64_t t = s0; t < s1 && !stores; ++t) {
        fill_channel_mult(p, t, block, mult);
        for (int64_t m = 0; m < g.rows; ++m) {
          bf16::store_lanes(p, g.m0 + m, t, lanes.data() + ((t - s0) * g.rows + m) * kTileN, mult);
        }
      }
    }
  }
}

// ------------------------------------------------------------ activation helpers
// grid_error, quantize_row and finite_amax are kernel_activation_impl.h's on
// 512-bit vectors; the row helpers read a row of x as given (kernel.h).

namespace {

// 512-bit vectors for the activation helpers (kernel_activation_impl.h).
struct Avx512Ops : Avx512Vector {
  using Int = __m512i;
  using Double = __m512d;
  using Mask = __mmask16;

  static Float set1(float v) { return _mm512_set1_ps(v); }
  static Float sub(Float a, Float b) { return _mm512_sub_ps(a, b); }
  static Float div(Float a, Float b) { return _mm512_div_ps(a, b); }
  static Float min(Float a, Float b) { return _mm512_min_ps(a, b); }
  static Float max(Float a, Float b) { return _mm512_max_ps(a, b); }
  static Float abs(Float a) { return _mm512_abs_ps(a); }
  static Int set1_int(int v) { return _mm512_set1_epi32(v); }
  static Int as_int(Float a) { return _mm512_castps_si512(a); }
  static Float as_float(Int a) { return _mm512_castsi512_ps(a); }
  static Int and_int(Int a, Int b) { return _mm512_and_si512(a, b); }
  static Int andnot_int(Int a, Int b) { return _mm512_andnot_si512(a, b); }
  static Int or_int(Int a, Int b) { return _mm512_or_si512(a, b); }
  static Int add_int(Int a, Int b) { return _mm512_add_epi32(a, b); }
  template <int N>
  static Int srli(Int a) { return _mm512_srli_epi32(a, N); }
  static Mask less(Float a, Float b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
  static Mask less_equal(Float a, Float b) { return _mm512_cmp_ps_mask(a, b, _CMP_LE_OQ); }
  static Float select(Mask m, Float if_true, Float if_false) { return _mm512_mask_blend_ps(m, if_false, if_true); }
  static Float keep(Mask m, Float a) { return _mm512_maskz_mov_ps(m, a); }
  static Double zero_double() { return _mm512_setzero_pd(); }
  static Double low_double(Float a) { return _mm512_cvtps_pd(_mm512_castps512_ps256(a)); }
  static Double high_double(Float a) { return _mm512_cvtps_pd(_mm512_extractf32x8_ps(a, 1)); }
  static Double fmadd_double(Double a, Double b, Double c) { return _mm512_fmadd_pd(a, b, c); }
  static Double add_double(Double a, Double b) { return _mm512_add_pd(a, b); }
  static double reduce_add_double(Double a) { return _mm512_reduce_add_pd(a); }
  static float reduce_max(Float a) { return _mm512_reduce_max_ps(a); }
};

// 16 values of a row given as float32, bf16 or fp16 (RowKind), as float32;
// the lanes past `lanes` are zero.
template <int Kind>
inline __m512 load_row16(const void* row, int64_t k, __mmask16 lanes) {
  if constexpr (Kind == kRowFloat) {
    return _mm512_maskz_loadu_ps(lanes, static_cast<const float*>(row) + k);
  } else {
    const __m256i h = _mm256_maskz_loadu_epi16(lanes, static_cast<const uint16_t*>(row) + k);
    if constexpr (Kind == kRowHalf) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}

inline __mmask16 lanes16(int64_t count) {
  return count >= 16 ? __mmask16(0xFFFF) : (count <= 0 ? __mmask16(0) : __mmask16((1u << count) - 1));
}

// round_to_grid of clamp(q, +-fmax) for 16 quotients q, NaN where q is not
// finite. The rounding here is the hardware's: |q| + c - c with c = 2^(e +
// Dropped), e the exponent of |q| or of the smallest normal, whichever is
// larger, rounds |q| to a multiple of 2^(e + Dropped - 23) (the grid's step
// there) to nearest even, as round_to_grid does with integers and magic.
template <int Dropped>
inline __m512 quantize16(__m512 q, __m512 fmax, __m512i min_exponent, __m512 nan) {
  const __m512i sign = _mm512_set1_epi32(static_cast<int>(0x80000000u));
  const __m512 a = _mm512_abs_ps(q);
  const __mmask16 finite = _mm512_cmp_ps_mask(a, _mm512_set1_ps(3.40282347e38f), _CMP_LE_OQ);
  const __m512 u = _mm512_min_ps(a, fmax);
  const __m512i e = _mm512_max_epi32(_mm512_and_si512(_mm512_castps_si512(u), _mm512_set1_epi32(0x7f800000)), min_exponent);
  const __m512 c = _mm512_castsi512_ps(_mm512_add_epi32(e, _mm512_set1_epi32(Dropped << 23)));
  const __m512 r = _mm512_sub_ps(_mm512_add_ps(u, c), c);
  return _mm512_castsi512_ps(_mm512_mask_ternarylogic_epi32(_mm512_castps_si512(nan), finite, _mm512_castps_si512(r),
                                                            _mm512_and_si512(_mm512_castps_si512(q), sign), 0xEE));
}

template <int Dropped, int Kind>
void quantize_row_bf16_impl(const void* row, int64_t K, float scale, const Fp8Grid& grid, uint16_t* out) {
  const __m512 s = _mm512_set1_ps(scale), fmax = _mm512_set1_ps(grid.fmax), nan = _mm512_set1_ps(NAN);
  uint32_t min_normal_bits;
  std::memcpy(&min_normal_bits, &grid.min_normal, sizeof min_normal_bits);
  const __m512i min_exponent = _mm512_set1_epi32(static_cast<int>(min_normal_bits & 0x7f800000u));
  for (int64_t k = 0; k < K; k += 32) {
    const __mmask16 lanes0 = lanes16(K - k), lanes1 = lanes16(K - k - 16);
    // a division, as the scalar code; the lanes past K are 0 / scale
    const __m512 v0 = quantize16<Dropped>(_mm512_div_ps(load_row16<Kind>(row, k, lanes0), s), fmax, min_exponent, nan);
    const __m512 v1 = quantize16<Dropped>(_mm512_div_ps(load_row16<Kind>(row, k + 16, lanes1), s), fmax, min_exponent, nan);
    // exact: an FP8 value (or NaN) is a bf16 value, and no FP8 value is a float32 denormal
    const __m512i bits = (__m512i)_mm512_cvtne2ps_pbh(v1, v0);
    _mm512_mask_storeu_epi16(out + k, K - k >= 32 ? __mmask32(0xFFFFFFFF) : __mmask32((1ull << (K - k)) - 1), bits);
  }
}

template <int Dropped>
void quantize_row_bf16_dispatch(const void* row, int kind, int64_t K, float scale, const Fp8Grid& grid, uint16_t* out) {
  if (kind == kRowBFloat16) return quantize_row_bf16_impl<Dropped, kRowBFloat16>(row, K, scale, grid, out);
  if (kind == kRowHalf) return quantize_row_bf16_impl<Dropped, kRowHalf>(row, K, scale, grid, out);
  quantize_row_bf16_impl<Dropped, kRowFloat>(row, K, scale, grid, out);
}

}  // namespace

void quantize_row_bf16_avx512bf16(const void* row, int kind, int64_t K, float scale, const Fp8Grid& grid,
                                  uint16_t* out) {
  if (grid.dropped_bits == 21) return quantize_row_bf16_dispatch<21>(row, kind, K, scale, grid, out);
  quantize_row_bf16_dispatch<20>(row, kind, K, scale, grid, out);
}

// bf16 and fp16: a magnitude's bits order as the magnitudes do, so the
// largest finite one is an integer max over the bits (Inf and NaN, the
// all-ones exponent, left out), converted once.
float finite_amax_row_avx512bf16(const void* row, int kind, int64_t K) {
  if (kind == kRowFloat) return finite_amax_avx512bf16(static_cast<const float*>(row), K);
  const uint16_t* bits = static_cast<const uint16_t*>(row);
  const __m512i magnitude = _mm512_set1_epi16(0x7fff);
  const __m512i exponent = _mm512_set1_epi16(static_cast<short>(kind == kRowHalf ? 0x7c00 : 0x7f80));
  __m512i amax = _mm512_setzero_si512();
  for (int64_t k = 0; k < K; k += 32) {
    const __mmask32 lanes = K - k >= 32 ? __mmask32(0xFFFFFFFF) : __mmask32((1ull << (K - k)) - 1);
    const __m512i mag = _mm512_and_si512(_mm512_maskz_loadu_epi16(lanes, bits + k), magnitude);
    amax = _mm512_mask_max_epu16(amax, _mm512_cmplt_epu16_mask(mag, exponent), amax, mag);
  }
  const __m512i wide = _mm512_max_epu32(_mm512_and_si512(amax, _mm512_set1_epi32(0xffff)), _mm512_srli_epi32(amax, 16));
  const uint16_t top = static_cast<uint16_t>(_mm512_reduce_max_epu32(wide));
  if (kind == kRowHalf) return _cvtsh_ss(top);
  const uint32_t f = static_cast<uint32_t>(top) << 16;
  float value;
  std::memcpy(&value, &f, sizeof value);
  return value;
}

double grid_error_avx512bf16(const float* row, int64_t K, float inverse, const Fp8Grid& grid) {
  return activation::grid_error_any<Avx512Ops>(row, K, inverse, grid);
}

void quantize_row_avx512bf16(const float* row, int64_t K, float scale, float post, const Fp8Grid& grid, float* out) {
  activation::quantize_row_any<Avx512Ops>(row, K, scale, post, grid, out);
}

float finite_amax_avx512bf16(const float* row, int64_t K) { return activation::finite_amax<Avx512Ops>(row, K); }

}  // namespace qfp8
