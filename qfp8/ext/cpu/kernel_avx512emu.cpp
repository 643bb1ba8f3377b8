// The AVX512 kernel (kernel_avx512_impl.h) built for AVX2 machines (compiled
// with -mavx2 -mfma -mf16c): each 512-bit intrinsic the kernel uses is done
// on two 256-bit halves. It is never chosen by the CPU dispatch; the tests
// select it ("avx512emu") to run the AVX512 kernel's own code (tiles, lane
// order, tails, panel blocking, scale folding) on CPUs without AVX512. The
// halves compute what
// the 512-bit instructions compute: loads and stores move the same bytes,
// vcvtph2ps is exact, and vfmadd231ps stays fused, so the results are bitwise
// those of the real instructions. Only the instruction encoding and the
// compiler's register allocation for zmm registers go untested.
#include <immintrin.h>

namespace qfp8_avx512emu {

struct m512 {
  __m256 lo, hi;
};

inline m512 load_ps(const float* p) { return {_mm256_load_ps(p), _mm256_load_ps(p + 8)}; }
inline m512 loadu_ps(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void store_ps(float* p, m512 v) {
  _mm256_store_ps(p, v.lo);
  _mm256_store_ps(p + 8, v.hi);
}
inline void storeu_ps(float* p, m512 v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + 8, v.hi);
}
inline m512 set1_ps(float v) { return {_mm256_set1_ps(v), _mm256_set1_ps(v)}; }
inline m512 setzero_ps() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline m512 add_ps(m512 a, m512 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline m512 mul_ps(m512 a, m512 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline m512 fmadd_ps(m512 a, m512 b, m512 c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
// 16 fp16 values (a 256-bit integer vector) -> 16 float32 lanes, in order.
inline m512 cvtph_ps(__m256i h) {
  return {_mm256_cvtph_ps(_mm256_castsi256_si128(h)), _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1))};
}

}  // namespace qfp8_avx512emu

// <immintrin.h> is already included (its guard keeps the kernel's own
// include from declaring anything again), so these names only reach the
// kernel's code.
#define __m512 qfp8_avx512emu::m512
#define _mm512_load_ps qfp8_avx512emu::load_ps
#define _mm512_loadu_ps qfp8_avx512emu::loadu_ps
#define _mm512_store_ps qfp8_avx512emu::store_ps
#define _mm512_storeu_ps qfp8_avx512emu::storeu_ps
#define _mm512_set1_ps qfp8_avx512emu::set1_ps
#define _mm512_setzero_ps qfp8_avx512emu::setzero_ps
#define _mm512_add_ps qfp8_avx512emu::add_ps
#define _mm512_mul_ps qfp8_avx512emu::mul_ps
#define _mm512_fmadd_ps qfp8_avx512emu::fmadd_ps
#define _mm512_cvtph_ps qfp8_avx512emu::cvtph_ps

#define QFP8_AVX512_ENTRY linear_tiles_avx512emu
#include "kernel_avx512_impl.h"
