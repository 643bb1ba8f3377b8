// AVX512-BF16 kernel entry (compiled with the AVX512 flags plus -mavx512bf16,
// called only when the CPU reports avx512_bf16). Same layout and arithmetic
// as kernel_avx512_impl.h, which explains why vdpbf16ps is not used.
#define QFP8_AVX512_ENTRY linear_tiles_avx512bf16
#include "kernel_avx512_impl.h"
