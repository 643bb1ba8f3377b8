// The avx512bf16 kernel's activations (included by kernel_avx512bf16.cpp
// and compiled with its flags): bf16 pairs row by row, and for more than
// kFewRows virtual rows laid out by register block (Activations), the layout
// shared out among the call's threads by ranges of blocks.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <new>
#include <utility>
#include <vector>

#include "kernel.h"
#include "kernel_bf16_common.h"

namespace qfp8 {
namespace bf16 {
namespace {

constexpr int64_t kChunkPairs = 512;  // k pairs per converted panel chunk: 512 x 128 bytes = 64 KB (in L2)
constexpr int kMaxRows = 12;          // virtual rows per register block: 24 zmm accumulators
constexpr int kFewRows = 4;           // up to this many virtual rows: the fused loop (tile_few_rows)

// Rows rows x `count` pairs (row r's from in[r], bf16 pairs, not necessarily 4-byte aligned) into `out`,
// [pair][row], 16 pairs at a time through transpose16. Returns the lanes
// (of 32 bf16 values) that hold a nonzero magnitude below kTinyActivation.
template <int Rows>
__mmask32 interleave_rows(const uint16_t* const* in, int64_t count, uint32_t* out) {
  const __m512i magnitude = _mm512_set1_epi16(0x7fff);
  const __m512i tiny = _mm512_set1_epi16(static_cast<short>((127 - 80) << 7));  // bf16 bits of 2^-80
  __mmask32 too_small = 0;
  for (int64_t i = 0; i < count; i += 16) {
    const int64_t n = std::min<int64_t>(16, count - i);
    const __mmask16 valid = n == 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
    __m512i r[16];
    for (int k = 0; k < 16; ++k) r[k] = k < Rows ? _mm512_maskz_loadu_epi32(valid, in[k] + 2 * i) : _mm512_setzero_si512();
    for (int k = 0; k < Rows; ++k) {
      const __m512i v = _mm512_and_si512(r[k], magnitude);
      too_small |= _mm512_mask_cmplt_epu16_mask(_mm512_test_epi16_mask(v, v), v, tiny);
    }
    transpose16(r);
    for (int64_t j = 0; j < n; ++j) _mm512_mask_storeu_epi32(out + (i + j) * Rows, __mmask16((1u << Rows) - 1), r[j]);
  }
  return too_small;
}

using InterleaveRowsFn = __mmask32 (*)(const uint16_t* const*, int64_t, uint32_t*);
template <size_t... Rows>
constexpr std::array<InterleaveRowsFn, kMaxRows + 1> interleave_rows_fns(std::index_sequence<Rows...>) {
  return {nullptr, interleave_rows<Rows + 1>...};
}
constexpr std::array<InterleaveRowsFn, kMaxRows + 1> kInterleaveRows =
    interleave_rows_fns(std::make_index_sequence<kMaxRows>());  // [rows of a register block]

// The activations as bf16 pairs, [virtual row][pair] (one uint32 = the bf16
// of k = 2p and 2p + 1); virtual row v = part * M + m. Register blocks of
// rows are as even as they can be (11 and 12 rows rather than 12 and 4).
struct Activations {
  int parts = 1;     // 1, 2 or 3 bf16 parts per value
  int64_t rows = 0;  // M * parts
  int64_t pairs = 0;
  int64_t blocks = 1;
  // Row parts (one part only): part r, register blocks [part_block(r),
  // part_block(r + 1)), is laid out by the call's thread r, which then takes
  // it through every tile (row_parts_for), so that its rows stay in its cache.
  int64_t row_parts = 1;
  // The pairs, unless x (bf16, even K) is used as it is; like `blocked`
  // below, scratch memory (kernel.h), not zeroed (allocate).
  ScratchBuffer<uint32_t> data;
  const uint32_t* base = nullptr;   // data or x
  std::vector<int64_t> output_row;  // [rows]: the row of x (and of y) of virtual row v
  // More than kFewRows rows: [chunk][block][pair][row], each register block's
  // rows side by side at each pair, so that the block's broadcasts at one pair
  // read one cache line (row by row, the rows of a block lie K * 2 bytes
  // apart and fall in the same few L1 sets). Not zeroed first: page faults
  // and zeroing cost more than the copy; scratch memory, reused from call to
  // call (kernel.h).
  ScratchBuffer<uint32_t> blocked;

  static ScratchBuffer<uint32_t> allocate(int64_t count) {
    ScratchBuffer<uint32_t> buffer(count);
    if (!buffer.get()) throw std::bad_alloc();
    return buffer;
  }

  int64_t block_start(int64_t b) const { return b * rows / blocks; }
  int64_t part_block(int64_t r) const { return r * blocks / row_parts; }
  int rows_in(int64_t b) const { return static_cast<int>(block_start(b + 1) - block_start(b)); }
  const uint32_t* row(int64_t v) const { return base + v * pairs; }
  // Register block b's pairs from `pair` (a multiple of kChunkPairs) on,
  // rows_in(b) values a pair. Chunk by chunk, then block by block: the
  // blocks follow each other in memory in the order they are multiplied.
  const uint32_t* block(int64_t b, int64_t pair) const {
    const int64_t count = std::min(kChunkPairs, pairs - pair);
    return blocked.get() + pair * rows + block_start(b) * count;
  }

  // Lays the row-by-row pairs out by chunk and block (more than kFewRows rows
  // only), block by block: each block's rows are read front to back. With
  // `patches`, the rows are a convolution's patches of the bf16 input `x`
  // (kernel.h), read in place segment by segment, rather than row(v).
  // Returns false when `check` and a nonzero magnitude is below
  // kTinyActivation (bf16 x, checked as it is copied: a pass of its own
  // would cost about as much as the copy). The blocks are shared out among
  // the call's threads: by row part, else at least 256 KB of copying each.
  bool interleave(bool check, const uint16_t* x = nullptr, const PatchRows* patches = nullptr) {
    blocked = allocate(rows * pairs);
    const int64_t run = patches ? patches->segment_length / 2 : pairs;  // pairs read from one place
    std::atomic<uint32_t> too_small{0};
    const auto lay_out = [&](int64_t b0, int64_t b1) {
      const uint16_t* in[kMaxRows];
      __mmask32 small = 0;
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t v0 = block_start(b);
        const int count_rows = rows_in(b);
        for (int64_t c0 = 0; c0 < pairs; c0 += kChunkPairs) {
          const int64_t c1 = std::min(c0 + kChunkPairs, pairs);
          uint32_t* out = const_cast<uint32_t*>(block(b, c0));
          for (int64_t q0 = c0, q1; q0 < c1; q0 = q1) {  // pieces within one segment
            q1 = std::min(c1, (q0 / run + 1) * run);
            for (int r = 0; r < count_rows; ++r) {
              in[r] = patches ? x + patches->row_offset[v0 + r] + patches->segment_offset[q0 / run] + 2 * (q0 % run)
                              : reinterpret_cast<const uint16_t*>(row(v0 + r) + q0);
            }
            small |= kInterleaveRows[count_rows](in, q1 - q0, out + (q0 - c0) * count_rows);
          }
        }
      }
      too_small.fetch_or(small);
    };
    if (row_parts > 1) {
      parallel_ranges(row_parts, 1, [&](int64_t r0, int64_t r1) { lay_out(part_block(r0), part_block(r1)); });
    } else {
      parallel_ranges(blocks, std::max<int64_t>(1, (int64_t(1) << 18) / (kMaxRows * pairs * 4)), lay_out);
    }
    data.reset();
    base = nullptr;
    return !(check && too_small.load());
  }

  void shape(int parts_, int64_t M, int64_t Kp) {
    parts = parts_;
    rows = M * parts;
    blocks = (rows + kMaxRows - 1) / kMaxRows;
    pairs = Kp / 2;
    output_row.resize(rows);
    for (int64_t v = 0; v < rows; ++v) output_row[v] = v % M;
  }
};

// Writes the first `parts` bf16 parts of x into a (laid out for that many)
// and returns how many parts x needs (1 to 3), or 0 when a nonzero |x| is
// below kTinyActivation or a finite |x| above bf16's largest value.
int split_activations(const LinearProblem& p, int parts, Activations& a) {
  const int64_t M = p.M, Kp = p.Kp;
  a.shape(parts, M, Kp);
  a.data = Activations::allocate(a.rows * a.pairs);  // every pair is written below
  a.base = a.data.get();
  SplitCheck check;
  for (int64_t m = 0; m < M; ++m) {
    const float* x = p.x + m * p.ldx;
    for (int64_t k = 0; k < Kp; k += 32) {  // 32 values (16 pairs); Kp is even, so a tail ends on a pair
      __m512 lo[3], hi[3];
      split32(x + k, Kp - k, lo, hi, check);
      const __mmask16 pairs_valid = lanes_below((Kp - k) / 2);
      for (int part = 0; part < parts; ++part) {
        // Each part is exact in bf16, so the conversion only packs it.
        const __m512i bf = (__m512i)_mm512_cvtne2ps_pbh(hi[part], lo[part]);
        _mm512_mask_storeu_epi32(a.data.get() + (part * M + m) * a.pairs + k / 2, pairs_valid, bf);
      }
    }
  }
  return check.out_of_range ? 0 : check.parts();
}

// bf16 x ([M][K], K even or odd) as the one part: used as it is when K is
// even and x is 4-byte aligned, else copied with a zero pad. False when a
// nonzero |x| is below kTinyActivation; with more than kFewRows rows that is
// left to Activations::interleave, which reads x anyway.
bool take_bf16_activations(const LinearProblem& p, Activations& a) {
  const int64_t M = p.M, K = p.K, Kp = p.Kp;
  const uint16_t* x = p.x_bf16;
  const int64_t total = M <= kFewRows ? M * K : 0;
  const __m512i magnitude = _mm512_set1_epi16(0x7fff);
  const __m512i tiny = _mm512_set1_epi16(static_cast<short>((127 - 80) << 7));  // bf16 bits of 2^-80
  __mmask32 too_small = 0;
  for (int64_t i = 0; i < total; i += 32) {
    const __mmask32 valid = total - i >= 32 ? __mmask32(0xFFFFFFFF) : __mmask32((1ull << (total - i)) - 1);
    const __m512i v = _mm512_and_si512(_mm512_maskz_loadu_epi16(valid, x + i), magnitude);
    too_small |= _mm512_mask_cmplt_epu16_mask(_mm512_test_epi16_mask(v, v), v, tiny);
  }
  if (too_small) return false;
  a.shape(1, M, Kp);
  if (K == Kp && reinterpret_cast<uintptr_t>(x) % 4 == 0) {
    a.base = reinterpret_cast<const uint32_t*>(x);
    return true;
  }
  a.data = Activations::allocate(a.rows * a.pairs);
  for (int64_t m = 0; m < M; ++m) {
    uint16_t* row = reinterpret_cast<uint16_t*>(a.data.get() + m * a.pairs);
    std::memcpy(row, x + m * K, K * sizeof(uint16_t));
    if (Kp > K) row[K] = 0;  // the pad of an odd K
  }
  a.base = a.data.get();
  return true;
}

// Row parts for a's rows on the call's threads: one per thread when a has one
// part and at least kMinPartRows rows a thread (each thread then reads every
// weight, at 2 x kMinPartRows multiply-adds or more a byte, rather than every
// row, most of them laid out by other threads and in their caches); else 1.
constexpr int64_t kMinPartRows = 96;
inline int64_t row_parts_for(const Activations& a) {
  const int64_t threads = call_threads();
  if (a.parts != 1 || threads < 2 || a.rows < threads * kMinPartRows) return 1;
  return std::min(threads, a.blocks);
}

}  // namespace
}  // namespace bf16
}  // namespace qfp8
