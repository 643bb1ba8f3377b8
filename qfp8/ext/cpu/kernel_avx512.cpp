// AVX512F/BW/VL/DQ kernel (compiled with -mavx512f -mavx512bw -mavx512vl
// -mavx512dq -mfma -mf16c, called only when the CPU reports those features).
// Layout and arithmetic: see kernel_avx512_impl.h.
#define QFP8_AVX512_ENTRY linear_tiles_avx512
#include "kernel_avx512_impl.h"
