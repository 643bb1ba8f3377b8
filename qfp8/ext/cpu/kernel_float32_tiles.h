// The float32 tile kernel, written once for the AVX2 and the AVX512 units
// and templated on the vector width: each unit includes it with its own -m
// flags and a vector type V (below).
//
// Layout: the packed tiles of kernel.h, [T][Kp/2][64] bytes; 2 * V::kLanes
// bytes of a group hold V::kLanes consecutive channels x a k pair.
//
// Arithmetic: V::convert turns those bytes into the fp16 bits of the even
// (k = 2p) and odd (k = 2p + 1) weights and then float32 lanes (vcvtph2ps,
// exact, subnormals included; the value is the FP8 value / format factor,
// see kernel.h). vfmadd231ps with a broadcast x[k] accumulates, one
// accumulator set per parity of k. The format factor and the weight scale
// are applied per channel at the end (tensor and channel scales at M = 1) or
// folded into the weights (block scales, and every scale in the M > 1 panel).
//
// Two schedules:
// - M == 1: the tile is streamed once, its weights converted in registers.
// - M > 1: a panel of 128 k x 32 channels is converted once into a 16 KB
//   float32 buffer (L1-resident) with the scale folded in, then a
//   V::kRows-row register-blocked loop runs every row over it, 2 * V::kLanes
//   channels at a time, so the conversion is paid once per weight, not once
//   per row.
//
// V provides: Float (a vector of kLanes float32), kLanes, kRows, zero(),
// broadcast(const float*), load / loadu / store / storeu, add, mul,
// fmadd(a, b, c) = a * b + c, and convert<Format>(const uint8_t*, Float& even,
// Float& odd).
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <utility>
#include <vector>

#include "kernel.h"

namespace qfp8 {
namespace float32 {
namespace {

constexpr int64_t kPanelPairs = 64;  // k pairs per converted panel: 128 k x 32 floats = 16 KB

// M == 1: stream the tile once, converting in registers.
template <typename V, int Format, bool Folded>
void tile_single_row(const LinearProblem& p, int64_t t, const float* x, float* sums) {
  using Float = typename V::Float;
  constexpr int kVectors = kTileN / V::kLanes;  // per parity of k
  const uint8_t* g = p.w + t * (p.Kp / 2) * kGroupBytes;
  const int64_t pairs = p.Kp / 2;
  Float acc_even[kVectors], acc_odd[kVectors], scale[2 * kVectors];
  for (int j = 0; j < kVectors; ++j) acc_even[j] = acc_odd[j] = V::zero();
  for (auto& s : scale) s = V::zero();
  alignas(64) float lane_scale[kGroupBytes] = {};
  int64_t refresh = 0;
  for (int64_t pair = 0; pair < pairs; ++pair, g += kGroupBytes) {
    if (Folded && 2 * pair >= refresh) {
      refresh = fill_lane_scales(p, t, pair, lane_scale);
      for (int j = 0; j < 2 * kVectors; ++j) scale[j] = V::load(lane_scale + V::kLanes * j);
    }
    const Float x0 = V::broadcast(x + 2 * pair);
    const Float x1 = V::broadcast(x + 2 * pair + 1);
    for (int j = 0; j < kVectors; ++j) {
      Float e, o;
      V::template convert<Format>(g + 2 * V::kLanes * j, e, o);
      if (Folded) {
        e = V::mul(e, scale[j]);
        o = V::mul(o, scale[kVectors + j]);
      }
      acc_even[j] = V::fmadd(e, x0, acc_even[j]);
      acc_odd[j] = V::fmadd(o, x1, acc_odd[j]);
    }
  }
  for (int j = 0; j < kVectors; ++j) V::storeu(sums + V::kLanes * j, V::add(acc_even[j], acc_odd[j]));
}

// Converts `count` groups from k pair `pair0` into panel[k][32] float32 with
// the lane scales folded in (refreshed at block boundaries). Kept out of
// line: inlined into the tile loop, it made the AVX2 panel path slower on
// short K (576 x 1536 at M = 16, docs/cpu-kernels-measurements.md).
template <typename V, int Format>
__attribute__((noinline)) void convert_panel(const LinearProblem& p, int64_t t, int64_t pair0, int64_t count, float* panel,
                   float* lane_scale, int64_t& refresh) {
  using Float = typename V::Float;
  constexpr int kVectors = kTileN / V::kLanes;
  const uint8_t* g = p.w + (t * (p.Kp / 2) + pair0) * kGroupBytes;
  Float scale[2 * kVectors];
  for (int j = 0; j < 2 * kVectors; ++j) scale[j] = V::load(lane_scale + V::kLanes * j);
  for (int64_t i = 0; i < count; ++i, g += kGroupBytes) {
    const int64_t pair = pair0 + i;
    if (2 * pair >= refresh) {
      refresh = fill_lane_scales(p, t, pair, lane_scale);
      for (int j = 0; j < 2 * kVectors; ++j) scale[j] = V::load(lane_scale + V::kLanes * j);
    }
    float* row = panel + 2 * i * kTileN;
    for (int j = 0; j < kVectors; ++j) {
      Float e, o;
      V::template convert<Format>(g + 2 * V::kLanes * j, e, o);
      V::store(row + V::kLanes * j, V::mul(e, scale[j]));
      V::store(row + kTileN + V::kLanes * j, V::mul(o, scale[kVectors + j]));
    }
  }
}

// Rows x a converted panel of `depth` k, two vectors of channels at a time,
// accumulating into acc_rows (32 channels per row).
template <typename V, int Rows>
void panel_rows(const float* panel, int64_t depth, const float* const* x, float* const* acc_rows) {
  using Float = typename V::Float;
  for (int c0 = 0; c0 < kTileN; c0 += 2 * V::kLanes) {
    Float acc[Rows][2];
    for (int r = 0; r < Rows; ++r) {
      acc[r][0] = V::loadu(acc_rows[r] + c0);
      acc[r][1] = V::loadu(acc_rows[r] + c0 + V::kLanes);
    }
    const float* w = panel + c0;
    for (int64_t k = 0; k < depth; ++k, w += kTileN) {
      const Float w0 = V::load(w);
      const Float w1 = V::load(w + V::kLanes);
      for (int r = 0; r < Rows; ++r) {
        const Float xk = V::broadcast(x[r] + k);
        acc[r][0] = V::fmadd(w0, xk, acc[r][0]);
        acc[r][1] = V::fmadd(w1, xk, acc[r][1]);
      }
    }
    for (int r = 0; r < Rows; ++r) {
      V::storeu(acc_rows[r] + c0, acc[r][0]);
      V::storeu(acc_rows[r] + c0 + V::kLanes, acc[r][1]);
    }
  }
}

using PanelRowsFn = void (*)(const float*, int64_t, const float* const*, float* const*);

template <typename V, size_t... Rows>
constexpr std::array<PanelRowsFn, V::kRows + 1> panel_rows_fns(std::index_sequence<Rows...>) {
  return {nullptr, panel_rows<V, Rows + 1>...};
}

template <typename V, int Format>
void tile_many_rows(const LinearProblem& p, int64_t t, float* panel, float* acc) {
  static constexpr std::array<PanelRowsFn, V::kRows + 1> kPanelRows =
      panel_rows_fns<V>(std::make_index_sequence<V::kRows>());
  const int64_t pairs = p.Kp / 2;
  std::fill(acc, acc + p.M * kTileN, 0.0f);
  alignas(64) float lane_scale[kGroupBytes] = {};
  int64_t refresh = 0;
  for (int64_t pair0 = 0; pair0 < pairs; pair0 += kPanelPairs) {
    const int64_t count = std::min(kPanelPairs, pairs - pair0);
    convert_panel<V, Format>(p, t, pair0, count, panel, lane_scale, refresh);
    for (int64_t m0 = 0; m0 < p.M; m0 += V::kRows) {
      const int rows = static_cast<int>(std::min<int64_t>(V::kRows, p.M - m0));
      const float* x[V::kRows];
      float* acc_rows[V::kRows];
      for (int r = 0; r < rows; ++r) {
        x[r] = p.x + (m0 + r) * p.ldx + 2 * pair0;
        acc_rows[r] = acc + (m0 + r) * kTileN;
      }
      kPanelRows[rows](panel, 2 * count, x, acc_rows);
    }
  }
}

// Tiles [tile_begin, tile_end) of the problem, float32 x.
template <typename V, int Format>
void linear_tiles(const LinearProblem& p, int64_t tile_begin, int64_t tile_end) {
  alignas(64) float sums[kTileN];
  float mult[kTileN];
  if (p.M == 1) {
    const bool folded = p.scale_kind == kScaleBlock;
    for (int64_t t = tile_begin; t < tile_end; ++t) {
      fill_channel_mult(p, t, folded, mult);
      if (folded) {
        tile_single_row<V, Format, true>(p, t, p.x, sums);
      } else {
        tile_single_row<V, Format, false>(p, t, p.x, sums);
      }
      store_tile_row(p, 0, t, sums, mult);
    }
    return;
  }
  // Panel and accumulators per call (one call per thread chunk).
  std::vector<float> panel_storage(2 * kPanelPairs * kTileN + 16);
  float* panel = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(panel_storage.data()) + 63) & ~uintptr_t(63));
  std::vector<float> acc(p.M * kTileN);
  for (int64_t t = tile_begin; t < tile_end; ++t) {
    fill_channel_mult(p, t, true, mult);
    tile_many_rows<V, Format>(p, t, panel, acc.data());
    for (int64_t m = 0; m < p.M; ++m) store_tile_row(p, m, t, acc.data() + m * kTileN, mult);
  }
}

// The entry of a unit: e4m3fn and e4m3fnuz share the bits; only the format factor differs.
template <typename V>
void linear_tiles_any_format(const LinearProblem& p, int64_t tile_begin, int64_t tile_end) {
  if (p.format == kE5M2) return linear_tiles<V, kE5M2>(p, tile_begin, tile_end);
  linear_tiles<V, kE4M3FN>(p, tile_begin, tile_end);
}

}  // namespace
}  // namespace float32
}  // namespace qfp8
