// Host interface of the qfp8 CUDA weight-only linear (fp8_linear.cu).
//
// Torch-free on purpose: the kernel translation unit compiles with plain nvcc
// (the CI compile-only check, tests/library/test_cuda_compile.py), and only
// the binding (binding.cpp, built when torch has CUDA) knows about tensors.
//
//     y[M, N] = x[M, K] @ dequant(W)[N, K]^T (+ bias)
//
// x and y are fp16 or bf16 (same dtype), row-major, x with row stride lda
// (elements, a multiple of 8, 16-byte aligned base). W is the packed FP8
// weight described in fp8_layout.cuh; scales are float32.
#pragma once

#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

namespace qfp8 {

enum BiasKind : int { kNoBias = 0, kBiasFloat = 1, kBiasSameAsOutput = 2 };

struct Fp8LinearProblem {
  // Inputs.
  const void* x = nullptr;  // [M, lda] fp16/bf16; columns >= x_cols are never read
  int64_t lda = 0;
  int64_t x_cols = 0;  // readable columns of x: K rounded up to 8 (the binding pads x when K % 8 != 0)
  int64_t M = 0, N = 0, K = 0;
  const uint8_t* packed = nullptr;  // packed_bytes(N, K) bytes
  int format = 0;                   // layout::Fp8Format
  int half_kind = 0;                // layout::HalfKind of x and y
  const float* scale = nullptr;
  int scale_kind = 0;  // layout::ScaleKind
  int bn = 1, bk = 1;  // block size (scale_kind == kScaleBlock)
  int64_t scale_cols = 1;
  const void* bias = nullptr;  // [N]
  int bias_kind = kNoBias;
  void* y = nullptr;  // [M, ldy]
  int64_t ldy = 0;
  // Filled by fp8_linear_plan.
  int m_tiles = 0;      // 16-row MMA tiles per warp (1, 2 or 4): the configuration
  int splits = 1;       // K split over blockIdx.y; > 1 needs the workspace
  int kt_per_split = 0;  // 32-wide K tiles per split
  float* workspace = nullptr;  // splits * M * N float32 when splits > 1
};

// Checks the sizes and pointers; returns 0, or 1 with a message naming the
// offending sizes written to `message`.
int fp8_linear_check(const Fp8LinearProblem& problem, char* message, size_t message_size);

// Chooses the configuration and the K split for `sm_count` multiprocessors.
void fp8_linear_plan(Fp8LinearProblem& problem, int sm_count);

// Number of float32 the workspace needs after fp8_linear_plan (0 if none).
int64_t fp8_linear_workspace_floats(const Fp8LinearProblem& problem);

// Launches on `stream` (after check and plan, with the workspace set).
cudaError_t fp8_linear_launch(const Fp8LinearProblem& problem, cudaStream_t stream);

// Dense [N, K] fp16/bf16 weight from the packed one: value * scale in
// float32, rounded once (the large-M route feeds it to cuBLAS).
cudaError_t fp8_dequantize_packed_launch(const Fp8LinearProblem& problem, void* out, cudaStream_t stream);

// The device's conversion of FP8 codes to fp16/bf16 bits, through the same
// code path the kernel uses (gpu_check compares it with the host one).
cudaError_t fp8_codes_to_half_bits_launch(const uint8_t* codes, int64_t count, int format, int half_kind,
                                          uint16_t* out, cudaStream_t stream);

}  // namespace qfp8
