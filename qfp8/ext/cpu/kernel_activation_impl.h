// The vector activation helpers of kernel.h (grid_error, quantize_row,
// finite_amax), written once for the AVX2 and the AVX512 units and templated
// on the vector width: each unit includes this with its own -m flags and an
// operations type V (below). They compute what the scalar helpers
// (kernel_scalar.cpp) compute, with the same IEEE operations per value, so
// quantize_row and finite_amax give the same bits; grid_error sums its
// float32 terms in another order (the last bits of a float64).
//
// V provides: Float (kLanes float32), Int (kLanes int32), Double (kLanes / 2
// float64), Mask (a lane mask), kLanes; set1, set1_int, zero, zero_double,
// loadu, storeu, add, sub, mul, div, min, max, abs; as_int, as_float,
// and_int, andnot_int (~a & b), or_int, add_int, srli<N>; less, less_equal
// (Mask), select(mask, if_true, if_false), keep(mask, a) (zero elsewhere);
// low_double, high_double (the halves as float64), fmadd_double, add_double,
// reduce_add_double, reduce_max.
#pragma once

#include <cmath>
#include <cstdint>

#include "kernel.h"

namespace qfp8 {
namespace activation {
namespace {

// round_to_grid (kernel.h) of kLanes finite values u (already clamped).
template <typename V, int Dropped>
inline typename V::Float round_to_grid(typename V::Float u, typename V::Float min_normal, typename V::Float magic) {
  using Int = typename V::Int;
  const Int sign = V::set1_int(static_cast<int>(0x80000000u));
  const Int half = V::set1_int((1 << (Dropped - 1)) - 1);
  const Int keep = V::set1_int(~((1 << Dropped) - 1));
  const Int bits = V::andnot_int(sign, V::as_int(u));
  const typename V::Float a = V::as_float(bits);
  const typename V::Float sub = V::sub(V::add(a, magic), magic);
  const Int odd = V::and_int(V::template srli<Dropped>(bits), V::set1_int(1));
  const typename V::Float normal = V::as_float(V::and_int(V::add_int(V::add_int(bits, half), odd), keep));
  const typename V::Float rounded = V::select(V::less(a, min_normal), sub, normal);
  return V::as_float(V::or_int(V::as_int(rounded), V::and_int(sign, V::as_int(u))));
}

// The squared rounding errors of kLanes values u (already clamped), added to
// two float64 accumulators. Dropped is the grid's dropped_bits (an immediate
// shift count).
template <typename V, int Dropped>
inline void add_grid_error(typename V::Float u, typename V::Float min_normal, typename V::Float magic,
                           typename V::Double& acc0, typename V::Double& acc1) {
  const typename V::Float d = V::sub(round_to_grid<V, Dropped>(u, min_normal, magic), u);
  const typename V::Double d0 = V::low_double(d), d1 = V::high_double(d);
  acc0 = V::fmadd_double(d0, d0, acc0);
  acc1 = V::fmadd_double(d1, d1, acc1);
}

// grid_error_scalar, 2 * kLanes values at a time, into four float64 accumulators.
template <typename V, int Dropped>
double grid_error(const float* row, int64_t K, float inverse, const Fp8Grid& grid) {
  using Float = typename V::Float;
  const Float s = V::set1(inverse);
  const Float hi = V::set1(grid.fmax), lo = V::set1(-grid.fmax);
  const Float min_normal = V::set1(grid.min_normal), magic = V::set1(grid.magic);
  typename V::Double acc[4] = {V::zero_double(), V::zero_double(), V::zero_double(), V::zero_double()};
  int64_t k = 0;
  for (; k + 2 * V::kLanes <= K; k += 2 * V::kLanes) {
    const Float u0 = V::min(V::max(V::mul(V::loadu(row + k), s), lo), hi);
    const Float u1 = V::min(V::max(V::mul(V::loadu(row + k + V::kLanes), s), lo), hi);
    add_grid_error<V, Dropped>(u0, min_normal, magic, acc[0], acc[1]);
    add_grid_error<V, Dropped>(u1, min_normal, magic, acc[2], acc[3]);
  }
  double error = V::reduce_add_double(V::add_double(V::add_double(acc[0], acc[1]), V::add_double(acc[2], acc[3])));
  for (; k < K; ++k) {
    const float u = std::fmin(std::fmax(row[k] * inverse, -grid.fmax), grid.fmax);
    const float d = qfp8::round_to_grid(u, grid) - u;
    error += static_cast<double>(d) * d;
  }
  return error;
}

// quantize_row_scalar, kLanes values at a time: the same division, clamp and
// rounding, so the same values.
template <typename V, int Dropped>
void quantize_row(const float* row, int64_t K, float scale, float post, const Fp8Grid& grid, float* out) {
  using Float = typename V::Float;
  const Float s = V::set1(scale), p = V::set1(post);
  const Float hi = V::set1(grid.fmax), lo = V::set1(-grid.fmax);
  const Float min_normal = V::set1(grid.min_normal), magic = V::set1(grid.magic);
  const Float largest = V::set1(3.40282347e38f), nan = V::set1(NAN);
  int64_t k = 0;
  for (; k + V::kLanes <= K; k += V::kLanes) {
    const Float q = V::div(V::loadu(row + k), s);  // a division, as the scalar code
    const typename V::Mask finite = V::less_equal(V::abs(q), largest);
    const Float u = V::min(V::max(q, lo), hi);
    Float value = V::select(finite, round_to_grid<V, Dropped>(u, min_normal, magic), nan);
    if (post != 1.0f) value = V::mul(value, p);
    V::storeu(out + k, value);
  }
  if (k < K) quantize_row_scalar(row + k, K - k, scale, post, grid, out + k);
}

// finite_amax_scalar, kLanes values at a time (max is exact in any order).
template <typename V>
float finite_amax(const float* row, int64_t K) {
  const typename V::Float largest = V::set1(3.40282347e38f);
  typename V::Float amax = V::zero();
  int64_t k = 0;
  for (; k + V::kLanes <= K; k += V::kLanes) {
    const typename V::Float a = V::abs(V::loadu(row + k));
    amax = V::max(amax, V::keep(V::less_equal(a, largest), a));  // Inf and NaN count as 0
  }
  return std::fmax(V::reduce_max(amax), finite_amax_scalar(row + k, K - k));
}

// The entries for either grid (dropped_bits 21 for e5m2, else 20).
template <typename V>
double grid_error_any(const float* row, int64_t K, float inverse, const Fp8Grid& grid) {
  return grid.dropped_bits == 21 ? grid_error<V, 21>(row, K, inverse, grid) : grid_error<V, 20>(row, K, inverse, grid);
}

template <typename V>
void quantize_row_any(const float* row, int64_t K, float scale, float post, const Fp8Grid& grid, float* out) {
  if (grid.dropped_bits == 21) return quantize_row<V, 21>(row, K, scale, post, grid, out);
  quantize_row<V, 20>(row, K, scale, post, grid, out);
}

}  // namespace
}  // namespace activation
}  // namespace qfp8
