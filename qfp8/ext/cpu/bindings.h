// Shared by the torch-binding translation units (ops.cpp, attention.cpp);
// the kernels themselves include only kernel.h.
#pragma once

#include <c10/core/ScalarType.h>

#include "kernel.h"

namespace qfp8 {

// The WeightFormat of an FP8 dtype; any other dtype raises a torch error
// "<what> must be float8_e4m3fn, float8_e5m2 or float8_e4m3fnuz, got <dtype>".
int fp8_format(c10::ScalarType dtype, const char* what);

// The decode-attention variant for the CPU kernel ISA in use: AVX2 for avx2
// and the AVX512 variants (whose CPUs have AVX2), scalar for scalar.
DecodeAttentionFn decode_attention_for_current_isa();

}  // namespace qfp8
