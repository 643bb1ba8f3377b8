// AMX kernel (the AVX512-BF16 flags plus -mamx-tile -mamx-bf16; chosen only
// when the CPU reports AMX-BF16 and the OS grants the tile state, see
// isa.cpp). From two virtual rows on (rows times bf16 parts), the products
// are AMX tile multiplies (tdpbf16ps), 16 x 16 x 32 multiply-adds each. One
// row, and block scales whose k-block is not a multiple of 32, go to the
// avx512bf16 kernel: one row is bound by reading the weights, which that
// kernel already does at a plain read's speed, so tiles gain nothing there.
// (The measurements behind this file's choices are in docs/cpu-kernels.md.)
//
// Tiles (palette 1; 64 bytes a row, 16 rows but where said otherwise):
//   tmm0-3  C: float32 sums, 16 rows x 16 channels; tmm0/1 rows 0-15 of a
//           32-row block, tmm2/3 rows 16-31; tmm0/2 the first weight half
//           (with one row block, tile_pairs_amx: tmm0/1 one weight tile,
//           tmm2/3 the next)
//   tmm4-5  A: bf16 activations, 16 rows x 32 k (a contiguous 1 KB block);
//           below 32 virtual rows, C and A hold only the rows there are
//           (TileState); tile_pairs_amx loads B into tmm5 too
//   tmm6-7  B: bf16 weights, 16 k pairs x 16 channels: row q holds pair q of
//           a 32-k step, one channel per dword, its two k side by side.
// A 64-byte group of the packed layout (32 channels x one k pair) converts
// by table (kernel_bf16_common.h) into two zmm registers whose dwords are
// 16 channels each, pairs of k side by side: one row of each B tile. So a
// step of 32 k is 16 converted groups, stored as two 1 KB blocks; C's
// columns come out in that lane order, and store_lanes puts them back.
//
// Numerics: as the avx512bf16 kernel. Activations are split into 1 to 3
// bf16 parts (bf16 inputs and FP8-quantized activations: one), each a
// virtual row, so the products are exact and only the float32 sums round
// (in tdpbf16ps's order); nonzero magnitudes below 2^-80 and finite float32
// values beyond bf16's range make it decline, as tdpbf16ps treats bf16
// denormals as zero and flushes denormal results.
//
// Loop, up to 16 virtual rows (up to kScaledPairRows with block or group
// scales): tiles two at a time (tile_pairs_amx), so that each A tile load
// from L2 serves both; loading A once per tile slows the weights' stream
// from memory.
// Otherwise: a group of tiles goes through K a chunk (kChunkSteps steps of 32 k,
// kLongChunkSteps for many rows) at a time: one tile while the activations
// fit kCachedActivations (its weights then stream front to back), else as
// many as keep their float32 sums (every virtual row x 32 channels) within
// kAccBytes, so that each chunk of activations is read from L2 for all of
// them. Each tile's chunk is converted once into a bf16 panel (in L1),
// beside the multiplies of the chunk before (its groups shared evenly among
// the 32-row blocks), and multiplied by every 32-row block of activations,
// the C tiles loaded from and stored back to the tile's sums around each
// chunk.
// Block weight scales and 1 x 128 activation-group scales cut K into
// segments: C starts from zero at each, and its sums are added to the
// tile's, scaled, at the end (scale_into_sums). That add, and C's zeroing
// and store at each segment, are the cost of block scales over channel
// scales.
#include <immintrin.h>

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <new>
#include <numeric>
#include <vector>

#include "kernel.h"
#include "kernel_bf16_common.h"

namespace qfp8 {
namespace amx {
namespace {

using namespace bf16;

constexpr int64_t kStepK = 32;           // k per tile step (16 pairs)
// Steps per converted panel chunk: 128 k, 2 x 4 KB of bf16 panel (the
// fastest of 4, 8 and 16 steps up to 128 rows).
constexpr int64_t kChunkSteps = 4;
// From kLongChunkBlocks 16-row blocks of virtual rows on, kLongChunkSteps
// (256 k, 2 x 8 KB; the panel still fits L1): C's tile stores and loads
// around each chunk (a tile store waits for the tile unit to drain) weigh
// less over a longer chunk; below 8 blocks the shorter chunk is faster.
constexpr int64_t kLongChunkSteps = 8;
constexpr int64_t kLongChunkBlocks = 8;
// Weights asked for ahead of the conversion, into L2 (prefetcht2): 48 k pairs
// (3 KB); no prefetch, or one into L1, streams them slower.
constexpr int64_t kPrefetchPairs = 48;
constexpr int64_t kAccBytes = 512 << 10; // float32 sums a tile group keeps (in L2)
// Activations up to this many bytes: one tile at a time (they stay in L2
// while each tile's weights stream through once).
constexpr int64_t kCachedActivations = 1 << 20;
// Tile pairs (tile_pairs_amx) with block or group scales only up to this
// many virtual rows: past it, the pairs' extra C traffic at each segment
// end outweighs the shared A loads.
constexpr int64_t kScaledPairRows = 4;
constexpr int64_t kBlockValues = 16 * kStepK;  // bf16 values of one A or B tile: 1 KB
// zmm registers of one panel slot: two 1 KB B blocks per step of the longest chunk.
constexpr int64_t kPanelSlot = std::max(kChunkSteps, kLongChunkSteps) * 32;

// The activations as bf16 A tiles: [16-row block][step][16 rows][32 k],
// virtual row v = part * M + m; rows past the last virtual row and k past K
// are zero. When all rows fit one block, a step holds only those rows
// (block_rows), so that the A tiles' rows lie together.
struct Activations {
  int parts = 1;
  int64_t M = 0, rows = 0, blocks = 0, steps = 0;
  int64_t block_rows = 16;  // rows a block holds per step: fewer when all rows fit one block
  std::unique_ptr<uint16_t[], void (*)(void*)> data{nullptr, std::free};
  int64_t step_values() const { return block_rows * kStepK; }
  const uint16_t* block(int64_t b, int64_t s) const { return data.get() + (b * steps + s) * step_values(); }
  uint16_t* row_at(int64_t v, int64_t s) { return data.get() + ((v / 16) * steps + s) * step_values() + (v % 16) * kStepK; }

  void allocate(int64_t virtual_rows, int64_t K) {
    rows = virtual_rows;
    blocks = (rows + 15) / 16;
    block_rows = blocks == 1 ? rows : 16;
    steps = (K + kStepK - 1) / kStepK;
    const size_t bytes = static_cast<size_t>(blocks * steps * step_values()) * sizeof(uint16_t);
    data.reset(static_cast<uint16_t*>(huge_page_alloc(bytes)));
    if (!data) throw std::bad_alloc();
  }

  // Zeroes the rows [from, blocks * block_rows): the pad of the last block.
  void zero_rows_from(int64_t from) {
    for (int64_t v = from; v < (blocks - 1) * 16 + block_rows; ++v)
      for (int64_t s = 0; s < steps; ++s) std::memset(row_at(v, s), 0, kStepK * sizeof(uint16_t));
  }
};

// What prepare_amx hands the tiles: the AMX activations, or (one virtual row,
// or block scales the tiles do not take) the avx512bf16 kernel's own
// preparation.
struct Prepared {
  std::shared_ptr<const void> fallback;
  std::unique_ptr<Activations> tiles;
};

inline __mmask32 lanes32(int64_t count) {
  return count >= 32 ? __mmask32(0xFFFFFFFF) : (count <= 0 ? __mmask32(0) : __mmask32((1ull << count) - 1));
}

// bf16 x [M][K] (as given, or the FP8 values of W8A8) as the one part.
// False when a nonzero magnitude is below kTinyActivation.
bool take_bf16(const LinearProblem& p, Activations& a) {
  const int64_t M = p.M, K = p.K;
  a.parts = 1;
  a.M = M;
  a.allocate(M, K);
  const __m512i magnitude = _mm512_set1_epi16(0x7fff);
  const __m512i tiny = _mm512_set1_epi16(static_cast<short>((127 - 80) << 7));  // bf16 bits of 2^-80
  __mmask32 too_small = 0;
  for (int64_t m = 0; m < M; ++m) {
    const uint16_t* x = p.x_bf16 + m * K;
    for (int64_t s = 0; s < a.steps; ++s) {
      const __m512i v = _mm512_maskz_loadu_epi16(lanes32(K - s * kStepK), x + s * kStepK);
      const __m512i mag = _mm512_and_si512(v, magnitude);
      too_small |= _mm512_mask_cmplt_epu16_mask(_mm512_test_epi16_mask(mag, mag), mag, tiny);
      _mm512_store_si512(a.row_at(m, s), v);
    }
  }
  a.zero_rows_from(M);
  return !too_small;
}

// float32 x [M][ldx] (columns K..Kp-1 zero) split into its bf16 parts
// (kernel_bf16_common.h), as many as it needs. False when a nonzero |x| is
// below kTinyActivation or a finite |x| above bf16's largest value.
bool split_float(const LinearProblem& p, Activations& a) {
  const int64_t M = p.M, K = p.K;
  a.M = M;
  a.allocate(3 * M, K);  // all three parts; the ones not needed are zero
  SplitCheck check;
  for (int64_t m = 0; m < M; ++m) {
    const float* x = p.x + m * p.ldx;
    for (int64_t s = 0; s < a.steps; ++s) {
      __m512 lo[3], hi[3];
      split32(x + s * kStepK, K - s * kStepK, lo, hi, check);
      for (int part = 0; part < 3; ++part)  // each part is exact in bf16: the conversion only packs it
        _mm512_store_si512(a.row_at(part * M + m, s), (__m512i)_mm512_cvtne2ps_pbh(hi[part], lo[part]));
    }
  }
  a.zero_rows_from(3 * M);
  if (check.out_of_range) return false;
  a.parts = check.parts();
  // The rows past parts * M up to the block's end belong to parts that are
  // all zero, so the fewer blocks read only zeros there.
  a.rows = a.parts * M;
  a.blocks = (a.rows + 15) / 16;
  return true;
}

// tileconfig, palette 1: tmm0-7 all 16 rows x 64 bytes.
struct alignas(64) TileConfig {
  uint8_t palette_id = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// The tile state of the calling thread, held for one call's tiles.
//
// With fewer than 32 virtual rows (one or two row blocks), the A and C tiles
// of the row block(s) hold only the rows there are: a tile load of A reads
// from L2 only those.
struct TileState {
  // `pair`: tile_pairs_amx's use, tmm0-3 all C of the one row block.
  explicit TileState(int64_t rows, bool pair = false) {
    TileConfig config;
    for (int i = 0; i < 8; ++i) {
      config.colsb[i] = 64;
      config.rows[i] = 16;
    }
    if (pair) {
      config.rows[0] = config.rows[1] = config.rows[2] = config.rows[3] = config.rows[4] = static_cast<uint8_t>(rows);
    } else if (rows < 32) {
      config.rows[0] = config.rows[1] = config.rows[4] = static_cast<uint8_t>(std::min<int64_t>(rows, 16));
      if (rows > 16) config.rows[2] = config.rows[3] = config.rows[5] = static_cast<uint8_t>(rows - 16);
    }
    // Not _tile_loadconfig: GCC 12's declares a read of only the first 8
    // bytes, so the stores of colsb and rows could be (and, once this was
    // inlined twice into one function, were) dropped as dead: every tile
    // unconfigured, and the first tile instruction an illegal instruction.
    asm volatile("ldtilecfg %0" : : "m"(config));
  }
  ~TileState() { _tile_release(); }
};

// Converts one tile's chunk into a panel (per step two 1 KB B blocks), a
// run of its 64-byte groups at a time (group i: pair 16 * s0 + i). Pairs
// past the weight's are zero.
struct ChunkConverter {
  const Tables* tb = nullptr;
  const uint8_t* g = nullptr;  // the tile's packed weights
  int64_t pairs = 0, s0 = 0, s1 = 0;
  __m512i* panel = nullptr;

  int64_t groups() const { return (s1 - s0) * 16; }

  // The members are copied to locals first: the panel stores could alias
  // *this, whose members would then be read again after each one (as *tb
  // would be).
  inline void convert(int64_t i0, int64_t i1) const {
    const Tables t = *tb;
    __m512i* const out = panel;
    const int64_t real = std::min(i1, pairs - s0 * 16);  // the groups below it hold weights
    const uint8_t* src = g + (s0 * 16 + i0) * kGroupBytes;
    int64_t i = i0;
    for (; i < real; ++i, src += kGroupBytes) {
      _mm_prefetch(reinterpret_cast<const char*>(src + kPrefetchPairs * kGroupBytes), _MM_HINT_T2);
      __m512i* b = out + (i >> 4) * 32 + (i & 15);
      convert_group(t, src, b[0], b[16]);
    }
    for (; i < i1; ++i) {
      __m512i* b = out + (i >> 4) * 32 + (i & 15);
      b[0] = b[16] = _mm512_setzero_si512();
    }
  }
};

// C tiles of a row block (Two: 32 rows, else 16) times steps [0, count) of
// the panel, from the A blocks `a` (1 KB apart, the block's second 16 rows
// `second` bytes further). With a converter, its groups [g0, g1) (of the
// next chunk, into the other panel) are converted beside, spread evenly
// over the steps: the tile products run in the AMX unit while the vector
// units convert, and a panel's tile loads never wait on stores just made
// (converting each step right before its multiply halves the weights'
// stream).
template <bool Two>
inline void multiply_chunk(const uint16_t* a, int64_t step, int64_t second, const __m512i* panel, int64_t count,
                           const ChunkConverter* next, int64_t g0, int64_t g1) {
  const int64_t per = (g1 - g0) / count, extra = (g1 - g0) % count;  // no division per step
  int64_t at = g0;
  for (int64_t s = 0; s < count; ++s) {
    const int64_t to = at + per + (s < extra);
    if (next) next->convert(at, to);
    at = to;
    const uint16_t* as = a + s * step;
    _tile_loadd(4, as, 64);
    _tile_loadd(6, panel + s * 32, 64);
    _tile_loadd(7, panel + s * 32 + 16, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (Two) {
      _tile_loadd(5, reinterpret_cast<const char*>(as) + second, 64);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
}

template <bool Two>
inline void load_c(const float* c) {
  _tile_loadd(0, c, 128);
  _tile_loadd(1, c + 16, 128);
  if (Two) {
    _tile_loadd(2, c + 16 * 32, 128);
    _tile_loadd(3, c + 16 * 32 + 16, 128);
  }
}

template <bool Two>
inline void zero_c() {
  _tile_zero(0);
  _tile_zero(1);
  if (Two) {
    _tile_zero(2);
    _tile_zero(3);
  }
}

template <bool Two>
inline void store_c(float* c) {
  _tile_stored(0, c, 128);
  _tile_stored(1, c + 16, 128);
  if (Two) {
    _tile_stored(2, c + 16 * 32, 128);
    _tile_stored(3, c + 16 * 32 + 16, 128);
  }
}

// One row block over one chunk of one tile: C from `from` (null: zero),
// multiplied, stored to `to`. `kept`: C is already in the tile registers
// (the same block's previous chunk left it there); `keep`: leave it there.
template <bool Two>
inline void block_chunk(const uint16_t* a, int64_t step, int64_t second, const __m512i* panel, int64_t count,
                        const ChunkConverter* next, int64_t g0, int64_t g1, const float* from, float* to, bool kept,
                        bool keep) {
  if (!kept && from) load_c<Two>(from);
  if (!kept && !from) zero_c<Two>();
  multiply_chunk<Two>(a, step, second, panel, count, next, g0, g1);
  if (!keep) store_c<Two>(to);
}

// The k run (in steps) that one weight block and one activation group
// cover: the partial sums are scaled at its end. All of K without either.
int64_t segment_steps(const LinearProblem& p, const Activations& a) {
  int64_t k = a.steps * kStepK;
  if (p.scale_kind == kScaleBlock) k = p.bk;
  if (p.group_scale) k = p.scale_kind == kScaleBlock ? std::gcd(k, kActivationGroup) : kActivationGroup;
  return std::max<int64_t>(1, k / kStepK);
}

// One tile's chunk: what is multiplied, in order.
struct Item {
  int64_t j, c0, c1, seg;  // tile t0 + j of its group; steps [c0, c1) of segment [seg, seg_end)
  int64_t t0, tiles;       // its group
  int64_t seg_end;
  bool first, last;  // the chunk starts / ends its segment
};

// The items of tiles [tile_begin, tile_end) in the order they are multiplied:
// group by group; in a group, segment by segment, chunk by chunk, tile by tile.
struct ItemOrder {
  int64_t tile_begin, tile_end, group, steps, seg_steps, chunk;

  Item make(int64_t t0, int64_t seg, int64_t c0, int64_t j) const {
    const int64_t seg_end = std::min(seg + seg_steps, steps);
    const int64_t c1 = std::min(c0 + chunk, seg_end);
    return {j, c0, c1, seg, t0, std::min(group, tile_end - t0), seg_end, c0 == seg, c1 == seg_end};
  }
  Item first() const { return make(tile_begin, 0, 0, 0); }
  // The item after `it`; false after the last.
  bool next(const Item& it, Item& out) const {
    if (it.j + 1 < it.tiles) {
      out = make(it.t0, it.seg, it.c0, it.j + 1);
    } else if (it.c1 < it.seg_end) {
      out = make(it.t0, it.seg, it.c1, 0);
    } else if (it.seg_end < steps) {
      out = make(it.t0, it.seg_end, it.seg_end, 0);
    } else if (it.t0 + group < tile_end) {
      out = make(it.t0 + group, 0, 0, 0);
    } else {
      return false;
    }
    return true;
  }
};

// Adds a segment's C (virtual rows [v0, v1), row v at c + (v - v0) *
// kTileN) into the tile's sums (row v at sums + v * kTileN), each scaled by
// its block scales (lane order; read only with block scales) and its row's
// activation-group scale. Both tile loops use it, so a tile's bits do not
// depend on which one ran it.
inline void scale_into_sums(const LinearProblem& p, const Activations& a, bool block, const __m512 (&lane)[2],
                            int64_t seg, int64_t v0, int64_t v1, const float* c, float* sums) {
  const int64_t group_col = p.group_scale ? seg * kStepK / kActivationGroup : 0;
  int64_t m = v0 % a.M;  // the row of virtual row v
  for (int64_t v = v0; v < v1; ++v, m = m + 1 == a.M ? 0 : m + 1) {
    float* out = sums + v * kTileN;
    const float* in = c + (v - v0) * kTileN;
    __m512 m0, m1;
    if (p.group_scale) {
      const __m512 g = _mm512_set1_ps(p.group_scale[m * p.group_cols + group_col]);
      m0 = block ? _mm512_mul_ps(lane[0], g) : g;
      m1 = block ? _mm512_mul_ps(lane[1], g) : g;
    } else {  // block scales alone: the same bits as times 1
      m0 = lane[0];
      m1 = lane[1];
    }
    _mm512_storeu_ps(out, _mm512_fmadd_ps(_mm512_loadu_ps(in), m0, _mm512_loadu_ps(out)));
    _mm512_storeu_ps(out + 16, _mm512_fmadd_ps(_mm512_loadu_ps(in + 16), m1, _mm512_loadu_ps(out + 16)));
  }
}

// Writes tile `tile`'s outputs from its lane-order sums (one row of 32
// floats per virtual row): each output row's parts added, then scaled,
// biased, stored.
void store_tile(const LinearProblem& p, const Activations& a, int64_t tile, bool block, const float* tile_sums) {
  float mult[kTileN];
  fill_channel_mult(p, tile, block, mult);
  for (int64_t m = 0; m < a.M; ++m) {
    __m512 v0 = _mm512_loadu_ps(tile_sums + m * kTileN), v1 = _mm512_loadu_ps(tile_sums + m * kTileN + 16);
    for (int part_index = 1; part_index < a.parts; ++part_index) {
      v0 = _mm512_add_ps(v0, _mm512_loadu_ps(tile_sums + (part_index * a.M + m) * kTileN));
      v1 = _mm512_add_ps(v1, _mm512_loadu_ps(tile_sums + (part_index * a.M + m) * kTileN + 16));
    }
    store_lanes(p, m, tile, v0, v1, mult);
  }
}

// One row block (at most 16 virtual rows), activations in L2: tiles two at a
// time, [tile_begin, tile_end) an even count, so that each A tile load
// serves four products (both tiles' two halves) instead of two. Both tiles'
// C stay in tmm0-3 through a segment (all of K without block or group
// scales); tmm4 is A, tmm5-7 the B halves (tmm6 taken twice per step). Each
// tile's sums come from the same products and the same scaled adds, in the
// same order, as one tile at a time in tiles_amx, so the bits are the same
// whichever way the tiles are split among threads.
void tile_pairs_amx(const LinearProblem& p, const Activations& a, const Tables& tb, int64_t tile_begin,
                    int64_t tile_end) {
  const bool block = p.scale_kind == kScaleBlock;
  const bool scaled = block || p.group_scale;
  const int64_t pairs = p.Kp / 2, tile_bytes = pairs * kGroupBytes;
  const int64_t seg_steps = segment_steps(p, a);
  const int64_t tile_floats = 16 * kTileN;
  std::unique_ptr<float[], void (*)(void*)> acc{static_cast<float*>(huge_page_alloc(4 * tile_floats * 4)), std::free};
  std::unique_ptr<__m512i[], void (*)(void*)> panels{
      static_cast<__m512i*>(huge_page_alloc(2 * kPanelSlot * sizeof(__m512i))), std::free};
  if (!acc || !panels) throw std::bad_alloc();
  float* const sums = acc.get();                      // [2 tiles][rows][32]
  float* const done = acc.get() + 2 * tile_floats;  // a segment's C (both tiles), scaled into sums
  TileState state(a.rows, true);
  // A chunk of both tiles: steps [c0, c1) of the segment starting at seg.
  struct Chunk {
    int64_t t, seg, c0, c1;
  };
  auto segment_end = [&](int64_t seg) { return std::min(seg + seg_steps, a.steps); };
  auto make = [&](int64_t t, int64_t seg, int64_t c0) {
    return Chunk{t, seg, c0, std::min(c0 + kChunkSteps, segment_end(seg))};
  };
  auto following = [&](const Chunk& c, Chunk& out) {
    if (c.c1 < segment_end(c.seg)) {
      out = make(c.t, c.seg, c.c1);
    } else if (c.c1 < a.steps) {
      out = make(c.t, c.c1, c.c1);
    } else if (c.t + 2 < tile_end) {
      out = make(c.t + 2, 0, 0);
    } else {
      return false;
    }
    return true;
  };
  // Its two converters into panel slot `slot` (tile t's steps first, then tile t + 1's).
  auto converters = [&](const Chunk& c, int64_t slot, ChunkConverter (&out)[2]) {
    for (int h = 0; h < 2; ++h)
      out[h] = ChunkConverter{&tb, p.w + (c.t + h) * tile_bytes, pairs, c.c0, c.c1,
                              panels.get() + slot * kPanelSlot + h * kChunkSteps * 32};
  };
  Chunk it = make(tile_begin, 0, 0), after;
  {
    ChunkConverter first[2];
    converters(it, 0, first);
    for (const ChunkConverter& f : first) f.convert(0, f.groups());
  }
  for (int64_t i = 0;; ++i, it = after) {
    const bool has_next = following(it, after);
    if (it.c0 == 0 && scaled) std::fill(sums, sums + 2 * tile_floats, 0.0f);
    if (it.c0 == it.seg) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
    }
    const __m512i* panel = panels.get() + (i % 2) * kPanelSlot;
    ChunkConverter next[2];
    if (has_next) converters(after, (i + 1) % 2, next);
    const int64_t count = it.c1 - it.c0;
    const int64_t groups = has_next ? next[0].groups() : 0;
    const int64_t per = groups / count, extra = groups % count;
    int64_t at = 0;
    for (int64_t s = 0; s < count; ++s) {
      const int64_t to = at + per + (s < extra);
      if (has_next) {
        next[0].convert(at, to);
        next[1].convert(at, to);
      }
      at = to;
      const __m512i* b0 = panel + s * 32;
      const __m512i* b1 = panel + kChunkSteps * 32 + s * 32;
      _tile_loadd(4, a.block(0, it.c0 + s), 64);
      _tile_loadd(6, b0, 64);
      _tile_loadd(7, b0 + 16, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_loadd(5, b1, 64);
      _tile_dpbf16ps(2, 4, 5);
      _tile_loadd(6, b1 + 16, 64);
      _tile_dpbf16ps(3, 4, 6);
    }
    if (it.c1 == segment_end(it.seg)) {
      float* c = scaled ? done : sums;
      _tile_stored(0, c, 128);
      _tile_stored(1, c + 16, 128);
      _tile_stored(2, c + tile_floats, 128);
      _tile_stored(3, c + tile_floats + 16, 128);
      if (scaled) {  // the segment's C scaled into the sums, as tiles_amx does it
        for (int h = 0; h < 2; ++h) {
          __m512 lane[2];
          if (block) lane_block_scales(p, it.t + h, it.seg * kStepK, lane[0], lane[1]);
          scale_into_sums(p, a, block, lane, it.seg, 0, a.rows, c + h * tile_floats, sums + h * tile_floats);
        }
      }
    }
    if (it.c1 == a.steps) {
      store_tile(p, a, it.t, block, sums);
      store_tile(p, a, it.t + 1, block, sums + tile_floats);
    }
    if (!has_next) break;
  }
}

void tiles_amx(const LinearProblem& p, const Activations& a, int64_t tile_begin, int64_t tile_end) {
  static const Tables tables[3] = {make_tables(kE4M3FN), make_tables(kE5M2), make_tables(kE4M3FNUZ)};
  const Tables& tb = tables[p.format];
  const bool block = p.scale_kind == kScaleBlock;
  const bool scaled = block || p.group_scale;
  const int64_t rows16 = a.blocks * 16;
  const int64_t tile_floats = rows16 * kTileN;
  // One tile at a time (its weights read front to back) while the
  // activations stay in L2; else as many as keep their sums in kAccBytes, so
  // that each chunk of activations is read from L2 for all of them.
  const int64_t activation_bytes = rows16 * a.steps * kStepK * 2;
  const int64_t group = activation_bytes <= kCachedActivations
                            ? 1
                            : std::max<int64_t>(1, std::min(kAccBytes / (tile_floats * 4), tile_end - tile_begin));
  if (a.blocks == 1 && group == 1 && tile_end - tile_begin >= 2 && (!scaled || a.rows <= kScaledPairRows)) {
    const int64_t even = tile_begin + (tile_end - tile_begin) / 2 * 2;
    tile_pairs_amx(p, a, tb, tile_begin, even);
    if (even == tile_end) return;
    tile_begin = even;
  }
  const int64_t seg_steps = segment_steps(p, a);
  const int64_t pairs = p.Kp / 2;
  const int64_t tile_bytes = pairs * kGroupBytes;
  const int64_t second = a.steps * kBlockValues * sizeof(uint16_t);  // bytes from a 16-row block to the next

  const int64_t chunk = a.blocks >= kLongChunkBlocks ? kLongChunkSteps : kChunkSteps;
  const int64_t block_pairs = (a.blocks + 1) / 2;
  const ItemOrder order{tile_begin, tile_end, group, a.steps, seg_steps, chunk};
  // One block of up to 32 rows, one tile at a time, no segments: the tile's
  // C stays in the tile registers from its first chunk to its last.
  const bool resident = a.blocks <= 2 && group == 1 && !scaled;
  // Sums of the group's tiles; with scales also the current segment's
  // partial C (when a segment spans chunks) and the scaled add's input.
  std::unique_ptr<float[], void (*)(void*)> acc{static_cast<float*>(huge_page_alloc(group * tile_floats * 4)), std::free};
  std::unique_ptr<float[], void (*)(void*)> partial{
      static_cast<float*>(huge_page_alloc((scaled ? group * tile_floats : 1) * 4)), std::free};
  std::unique_ptr<__m512i[], void (*)(void*)> panels{
      static_cast<__m512i*>(huge_page_alloc(2 * kPanelSlot * sizeof(__m512i))), std::free};
  if (!acc || !partial || !panels) throw std::bad_alloc();
  alignas(64) float done[32 * kTileN];
  TileState state(a.rows);

  auto converter = [&](const Item& it, int64_t slot) {
    return ChunkConverter{&tb, p.w + (it.t0 + it.j) * tile_bytes, pairs, it.c0, it.c1, panels.get() + slot * kPanelSlot};
  };
  {
    const ChunkConverter first = converter(order.first(), 0);
    first.convert(0, first.groups());
  }
  Item it = order.first(), following;
  for (int64_t i = 0;; ++i, it = following) {
    const bool has_next = order.next(it, following);
    const int64_t t = it.t0 + it.j;
    if (scaled && it.j == 0 && it.c0 == 0) std::fill(acc.get(), acc.get() + it.tiles * tile_floats, 0.0f);
    const __m512i* panel = panels.get() + (i % 2) * kPanelSlot;
    ChunkConverter next;
    if (has_next) next = converter(following, (i + 1) % 2);
    __m512 lane[2];
    if (block && it.last) lane_block_scales(p, t, it.seg * kStepK, lane[0], lane[1]);
    float* sums = acc.get() + it.j * tile_floats;
    float* part = partial.get() + (scaled ? it.j * tile_floats : 0);
    for (int64_t b = 0; b < a.blocks; b += 2) {
      const bool two = b + 1 < a.blocks;
      const uint16_t* ab = a.block(b, it.c0);
      float* c = (scaled ? part : sums) + b * 16 * kTileN;
      // Unscaled: the tile's sums go on through K. Scaled: C restarts at
      // each segment; its end lands in `done`, scaled into the sums.
      const float* from = scaled ? (it.first ? nullptr : c) : (it.c0 == 0 ? nullptr : c);
      float* to = scaled && it.last ? done : c;
      // The next chunk's conversion, its groups shared evenly among the blocks.
      const ChunkConverter* convert = has_next ? &next : nullptr;
      const int64_t g0 = has_next ? next.groups() * (b / 2) / block_pairs : 0;
      const int64_t g1 = has_next ? next.groups() * (b / 2 + 1) / block_pairs : 0;
      const bool kept = resident && it.c0 > 0, keep = resident && it.c1 < a.steps;
      if (two) {
        block_chunk<true>(ab, a.step_values(), second, panel, it.c1 - it.c0, convert, g0, g1, from, to, kept, keep);
      } else {
        block_chunk<false>(ab, a.step_values(), second, panel, it.c1 - it.c0, convert, g0, g1, from, to, kept, keep);
      }
      if (!(scaled && it.last)) continue;
      scale_into_sums(p, a, block, lane, it.seg, b * 16, std::min(b * 16 + (two ? 32 : 16), a.rows), done, sums);
    }
    if (has_next && following.t0 == it.t0) continue;
    // The group's last chunk: each output row's parts added, then scaled, biased, stored.
    for (int64_t j = 0; j < it.tiles; ++j) store_tile(p, a, it.t0 + j, block, acc.get() + j * tile_floats);
    if (!has_next) break;
  }
}

}  // namespace
}  // namespace amx

std::shared_ptr<const void> prepare_amx(const LinearProblem& p) {
  auto prepared = std::make_shared<amx::Prepared>();
  if ((p.scale_kind != kScaleBlock || p.bk % amx::kStepK == 0) && (p.M > 1 || !p.x_bf16)) {
    auto a = std::make_unique<amx::Activations>();
    const bool taken = p.x_bf16 ? amx::take_bf16(p, *a) : amx::split_float(p, *a);
    if (!taken) return nullptr;  // the float32 code (declined, as the avx512bf16 kernel would)
    if (a->rows > 1) {
      prepared->tiles = std::move(a);
      return prepared;
    }
  }
  // One virtual row, or block scales whose k-block is not a whole number of steps.
  prepared->fallback = prepare_avx512bf16(p);
  if (!prepared->fallback) return nullptr;
  return prepared;
}

void linear_tiles_amx(const LinearProblem& problem, int64_t tile_begin, int64_t tile_end) {
  const auto* prepared = static_cast<const amx::Prepared*>(problem.prepared);
  LinearProblem p = problem;
  if (prepared && prepared->tiles) {
    p.format_factor = 1.0f;  // the tables give the FP8 values themselves
    return amx::tiles_amx(p, *prepared->tiles, tile_begin, tile_end);
  }
  p.prepared = prepared ? prepared->fallback.get() : nullptr;
  linear_tiles_avx512bf16(p, tile_begin, tile_end);
}

}  // namespace qfp8
