// AVX512F/BW/VL kernel body, included by kernel_avx512.cpp,
// kernel_avx512bf16.cpp and kernel_avx512emu.cpp (each compiled with its own
// -m flags and defining QFP8_AVX512_ENTRY, the name of its entry point).
//
// The float32 tile kernel (kernel_float32_tiles.h) on 512-bit vectors: 32
// bytes of a group hold 16 consecutive channels x a k pair; vpmaddubsw with
// (128, 0) / (0, 128) gives 128 * (int8)b of the even / odd bytes as 16
// words in channel order, an AND with 0xBFFF the fp16 bits (e5m2: shift /
// AND), one vcvtph2ps 16 float32 lanes. The M > 1 panel runs 8 rows x 32
// channels per register block (16 zmm accumulators, x broadcast from memory).
//
// kernel_avx512bf16.cpp includes this body as its float32 fallback
// (activations too small for vdpbf16ps or beyond bf16's range, odd k blocks);
// kernel_avx512emu.cpp with the 512-bit intrinsics done on 256-bit halves.
#include <immintrin.h>

#include "kernel.h"
#include "kernel_float32_tiles.h"

namespace qfp8 {
namespace {

struct Avx512Vector {
  using Float = __m512;
  static constexpr int kLanes = 16;
  static constexpr int kRows = 8;  // rows per register block: 8 x 2 accumulators of the 32 registers

  static Float zero() { return _mm512_setzero_ps(); }
  static Float broadcast(const float* p) { return _mm512_set1_ps(*p); }
  static Float load(const float* p) { return _mm512_load_ps(p); }
  static Float loadu(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, Float v) { _mm512_store_ps(p, v); }
  static void storeu(float* p, Float v) { _mm512_storeu_ps(p, v); }
  static Float add(Float a, Float b) { return _mm512_add_ps(a, b); }
  static Float mul(Float a, Float b) { return _mm512_mul_ps(a, b); }
  static Float fmadd(Float a, Float b, Float c) { return _mm512_fmadd_ps(a, b, c); }

  // 32 packed bytes (16 channels x a k pair) -> float32 lanes of the 16
  // channels at k = 2p (even) and k = 2p + 1 (odd).
  template <int Format>
  static void convert(const uint8_t* src, Float& even, Float& odd) {
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
};

}  // namespace

void QFP8_AVX512_ENTRY(const LinearProblem& p, int64_t tile_begin, int64_t tile_end) {
  float32::linear_tiles_any_format<Avx512Vector>(p, tile_begin, tile_end);
}

}  // namespace qfp8
