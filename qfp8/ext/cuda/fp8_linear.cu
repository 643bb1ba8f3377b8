// qfp8 CUDA weight-only FP8 linear, Marlin-style: y = x @ dequant(W_fp8)^T.
//
// Layout and arithmetic: see fp8_layout.cuh (packed tiles of 32 x 32 FP8
// bytes, FP8 -> fp16/bf16 by bit moves plus one exact multiply) and
// fp8_linear.h (the problem). sm80+ (mma.sync m16n8k16 with fp16/bf16
// inputs and float32 accumulators).
//
// Work split: a warp owns one tile column of 32 output channels and
// 16 * MT rows of x, over a range of K tiles. Four warps per block take four
// neighbouring tile columns (the same x rows and K range, so x is read once
// into L1 and served to the other three). blockIdx.y splits K so that small
// M still fills the GPU (decode: N / 32 warps alone are too few to saturate
// HBM); the float32 partial sums then go through a workspace and a second,
// small reduce kernel that applies scale and bias. blockIdx.z walks M in
// 16 * MT row blocks.
//
// Per 32-wide K tile a lane does: two 16-byte weight loads (prefetched G
// tiles ahead, in registers: no shared memory and no __syncthreads), one
// 16-byte x load per 8 rows, 16 byte-permutes + 16 fp16x2/bf16x2 multiplies
// (block scales: float32 multiplies instead), and 8 * MT MMAs.
//
// Instantiated configurations (fp16 and bf16 each, 6 kernels in all):
//   MT = 1, G = 4: M <= 16 (decode). 16 rows per warp; weight bandwidth is
//                  everything, so four tiles (4 KiB per warp) are in flight.
//   MT = 2, G = 4: 16 < M <= 32.
//   MT = 4, G = 2: M > 32, in blocks of 64 rows. Twice the accumulators,
//                  half the prefetch, to stay under ~128 registers.
// Larger M (>= the binding's large-M threshold) does not use this kernel:
// the binding dequantizes the weight once (fp8_dequantize_packed_launch) and
// calls cuBLAS, which is compute-bound there anyway.
// FP8 format, scale granularity and bias are run-time arguments (uniform
// branches), not template parameters, to keep the instantiations (and the
// compile time) small.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdio.h>

#include <algorithm>

#include "fp8_layout.cuh"
#include "fp8_linear.h"

namespace qfp8 {
namespace {

constexpr int kWarps = 4;  // warps per block, each on its own 32-channel tile column
constexpr int kThreads = 32 * kWarps;

template <typename T>
struct HalfTraits;
template <>
struct HalfTraits<__half> {
  using Pair = __half2;
  static constexpr int kind = layout::kHalf;
  static __device__ __forceinline__ Pair pair(float v) { return __float2half2_rn(v); }
  static __device__ __forceinline__ __half from_float(float v) { return __float2half_rn(v); }
  static __device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
  static __device__ __forceinline__ float2 to_float2(Pair v) { return __half22float2(v); }
  static __device__ __forceinline__ Pair from_float2(float2 v) { return __float22half2_rn(v); }
};
template <>
struct HalfTraits<__nv_bfloat16> {
  using Pair = __nv_bfloat162;
  static constexpr int kind = layout::kBFloat16;
  static __device__ __forceinline__ Pair pair(float v) { return __float2bfloat162_rn(v); }
  static __device__ __forceinline__ __nv_bfloat16 from_float(float v) { return __float2bfloat16_rn(v); }
  static __device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
  static __device__ __forceinline__ float2 to_float2(Pair v) { return __bfloat1622float2(v); }
  static __device__ __forceinline__ Pair from_float2(float2 v) { return __float22bfloat162_rn(v); }
};

// Weight stream: read once, so it should not evict x from L1
// (L1::no_allocate); .nc because the weight is read-only for the kernel.
__device__ __forceinline__ uint4 load_weight_16(const uint8_t* address) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(address));
  return v;
}

// x is re-read by the four warps of a block (and by every block of the same
// rows): keep the default caching so that L1 serves the repeats.
__device__ __forceinline__ uint4 load_x_16(const void* address) {
  return __ldg(reinterpret_cast<const uint4*>(address));
}

// Four FP8 codes (bytes 0..3 of `word`) to two fp16x2/bf16x2 pairs of
// widened bits (value * 2^-widen_exponent). prmt puts each code in the high
// byte of a 16-bit lane (selector 0x1404: lanes <- bytes 0, 1; 0x3424: bytes
// 2, 3); the masks then move exponent+mantissa into place (fp8_layout.cuh,
// widen_pair_from_high_bytes). Bytes 0, 1 are B fragment b0, bytes 2, 3 b1.
template <typename Pair>
__device__ __forceinline__ void widen_four(uint32_t word, int right, Pair& low, Pair& high) {
  uint32_t lo = __byte_perm(word, 0u, 0x1404);
  uint32_t hi = __byte_perm(word, 0u, 0x3424);
  lo = (lo & 0x80008000u) | ((lo & 0x7f007f00u) >> right);
  hi = (hi & 0x80008000u) | ((hi & 0x7f007f00u) >> right);
  low = *reinterpret_cast<Pair*>(&lo);
  high = *reinterpret_cast<Pair*>(&hi);
}

// Per-channel/tensor scales: only the exact 2^widen_exponent factor, one
// fp16x2/bf16x2 multiply per pair.
template <typename Pair>
__device__ __forceinline__ void restore_pairs(Pair factor, Pair& low, Pair& high) {
  low = __hmul2(low, factor);
  high = __hmul2(high, factor);
}

// Block scales: value = widened * factor * scale in float32, rounded once to
// fp16/bf16 (a scale folded into a half multiplier would be rounded too, and
// e5m2 block scales, ~amax / 57344, are fp16 subnormals).
template <typename Traits>
__device__ __forceinline__ void scale_pairs(float factor, float scale, typename Traits::Pair& low,
                                            typename Traits::Pair& high) {
  float2 l = Traits::to_float2(low), h = Traits::to_float2(high);
  l.x = l.x * factor * scale;
  l.y = l.y * factor * scale;
  h.x = h.x * factor * scale;
  h.y = h.y * factor * scale;
  low = Traits::from_float2(l);
  high = Traits::from_float2(h);
}

// D += A * B on a 16x8x16 tile; the fp16 and bf16 variants differ only in
// the input type (float32 accumulation in both).
template <typename T>
__device__ __forceinline__ void mma_16816(float* c, const uint32_t* a, uint32_t b0, uint32_t b1);

template <>
__device__ __forceinline__ void mma_16816<__half>(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <typename T>
__device__ __forceinline__ float load_bias(const Fp8LinearProblem& p, int64_t n) {
  if (p.bias_kind == kBiasFloat) return static_cast<const float*>(p.bias)[n];
  if (p.bias_kind == kBiasSameAsOutput) return HalfTraits<T>::to_float(static_cast<const T*>(p.bias)[n]);
  return 0.0f;
}

// Scale applied to the float32 accumulator of column n (block scales were
// applied to the weights already).
__device__ __forceinline__ float epilogue_scale(const Fp8LinearProblem& p, int64_t n) {
  if (p.scale_kind == layout::kScaleBlock) return 1.0f;
  return p.scale[layout::scale_index(p.scale_kind, n, 0, p.bn, p.bk, p.scale_cols)];
}

// MT: 16-row MMA tiles per warp. G: weight tiles prefetched per group.
template <typename T, int MT, int G>
__global__ void __launch_bounds__(kThreads) fp8_linear_kernel(const Fp8LinearProblem p) {
  using Traits = HalfTraits<T>;
  using Pair = typename Traits::Pair;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int g = lane / 4, t = lane % 4;
  // 32-bit tile and row indices (N, K, M < 2^31 by far); addresses in 64 bits.
  const int nt_count = layout::ceil_div(p.N, layout::kTileN);
  const int kt_count = layout::ceil_div(p.K, layout::kTileK);
  const int nt = static_cast<int>(blockIdx.x) * kWarps + warp;
  if (nt >= nt_count) return;  // no block-wide synchronization follows
  const int m0 = static_cast<int>(blockIdx.z) * 16 * MT;
  const int kt_begin = static_cast<int>(blockIdx.y) * p.kt_per_split;
  const int kt_end = min(kt_count, kt_begin + p.kt_per_split);
  const int rows = static_cast<int>(p.M), x_cols = static_cast<int>(p.x_cols);

  const int right = 8 - layout::widen_shift(p.format, Traits::kind);
  const float factor = exp2f(static_cast<float>(layout::widen_exponent(p.format, Traits::kind)));
  const Pair factor_pair = Traits::pair(factor);
  const bool block_scale = p.scale_kind == layout::kScaleBlock;
  // Scale rows of this lane's four columns (8 j + g), clamped into range:
  // the padded columns have zero weights, any finite scale will do.
  int scale_row[4];
#pragma unroll
  for (int j = 0; j < 4; ++j)
    scale_row[j] = (min(nt * 32 + 8 * j + g, static_cast<int>(p.N) - 1) / p.bn) * static_cast<int>(p.scale_cols);

  float acc[MT][4][4];
#pragma unroll
  for (int mi = 0; mi < MT; ++mi)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[mi][j][c] = 0.0f;

  const T* x = static_cast<const T*>(p.x);
  auto load_group = [&](uint4 (&b)[G][2], int kt0) {
#pragma unroll
    for (int i = 0; i < G; ++i) {
      if (kt0 + i < kt_end) {
        const uint8_t* address = p.packed + layout::lane_tile_offset(nt, kt0 + i, kt_count, lane);
        b[i][0] = load_weight_16(address);
        b[i][1] = load_weight_16(address + 16);
      } else {
        b[i][0] = b[i][1] = make_uint4(0, 0, 0, 0);
      }
    }
  };

  uint4 current[G][2], next[G][2];
  load_group(current, kt_begin);
  for (int kt0 = kt_begin; kt0 < kt_end; kt0 += G) {
    if (kt0 + G < kt_end) load_group(next, kt0 + G);
#pragma unroll
    for (int i = 0; i < G; ++i) {
      const int kt = kt0 + i;
      if (kt >= kt_end) break;
      // x rows g and g + 8 of each MMA tile, columns 32 kt + 8 t .. + 8.
      const int column = kt * layout::kTileK + 8 * t;
      uint4 x_low[MT], x_high[MT];
#pragma unroll
      for (int mi = 0; mi < MT; ++mi) {
        const int row = m0 + 16 * mi + g;
        const bool in_cols = column < x_cols;
        const T* x_row = x + static_cast<int64_t>(row) * p.lda + column;
        x_low[mi] = (in_cols && row < rows) ? load_x_16(x_row) : make_uint4(0, 0, 0, 0);
        x_high[mi] = (in_cols && row + 8 < rows) ? load_x_16(x_row + 8 * p.lda) : make_uint4(0, 0, 0, 0);
      }
      float block[4];  // this tile's block scale of each of the lane's four columns
#pragma unroll
      for (int j = 0; j < 4; ++j)
        block[j] = block_scale ? __ldg(p.scale + scale_row[j] + (kt * layout::kTileK) / p.bk) : 1.0f;
#pragma unroll
      for (int s = 0; s < 2; ++s) {
        const uint32_t words[4] = {current[i][s].x, current[i][s].y, current[i][s].z, current[i][s].w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          Pair b0, b1;
          widen_four(words[j], right, b0, b1);
          if (block_scale) {
            scale_pairs<Traits>(factor, block[j], b0, b1);
          } else {
            restore_pairs(factor_pair, b0, b1);
          }
          const uint32_t b0_bits = *reinterpret_cast<uint32_t*>(&b0);
          const uint32_t b1_bits = *reinterpret_cast<uint32_t*>(&b1);
#pragma unroll
          for (int mi = 0; mi < MT; ++mi) {
            const uint32_t* lo = reinterpret_cast<const uint32_t*>(&x_low[mi]);
            const uint32_t* hi = reinterpret_cast<const uint32_t*>(&x_high[mi]);
            const uint32_t a[4] = {lo[2 * s], hi[2 * s], lo[2 * s + 1], hi[2 * s + 1]};
            mma_16816<T>(acc[mi][j], a, b0_bits, b1_bits);
          }
        }
      }
    }
#pragma unroll
    for (int i = 0; i < G; ++i) {
      current[i][0] = next[i][0];
      current[i][1] = next[i][1];
    }
  }

  // Accumulator c of n8 tile j: rows g (c 0, 1) and g + 8 (c 2, 3), columns 2 t, 2 t + 1.
  T* y = static_cast<T*>(p.y);
#pragma unroll
  for (int mi = 0; mi < MT; ++mi) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int64_t m = m0 + 16 * mi + g + (c >= 2 ? 8 : 0);
        const int64_t n = static_cast<int64_t>(nt) * 32 + 8 * j + 2 * t + (c & 1);
        if (m >= p.M || n >= p.N) continue;
        if (p.splits == 1) {
          y[m * p.ldy + n] = Traits::from_float(acc[mi][j][c] * epilogue_scale(p, n) + load_bias<T>(p, n));
        } else {
          p.workspace[(static_cast<int64_t>(blockIdx.y) * p.M + m) * p.N + n] = acc[mi][j][c];
        }
      }
    }
  }
}

// Sums the K splits in a fixed order (deterministic), then scale and bias.
template <typename T>
__global__ void splitk_reduce_kernel(const Fp8LinearProblem p) {
  const int64_t total = p.M * p.N;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float sum = 0.0f;
    for (int s = 0; s < p.splits; ++s) sum += p.workspace[s * total + i];
    const int64_t m = i / p.N, n = i % p.N;
    static_cast<T*>(p.y)[m * p.ldy + n] = HalfTraits<T>::from_float(sum * epilogue_scale(p, n) + load_bias<T>(p, n));
  }
}

// One thread per packed 4-byte word: coalesced reads; the 4 codes are
// consecutive k of one channel.
template <typename T>
__global__ void dequantize_packed_kernel(const Fp8LinearProblem p, T* out) {
  const int64_t words = layout::packed_bytes(p.N, p.K) / 4;
  for (int64_t w = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; w < words;
       w += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t n, k;
    layout::packed_source(4 * w, p.K, &n, &k);
    if (n >= p.N) continue;
    const uint32_t word = reinterpret_cast<const uint32_t*>(p.packed)[w];
    for (int e = 0; e < 4 && k + e < p.K; ++e) {
      const uint8_t code = static_cast<uint8_t>(word >> (8 * e));
      const float value = layout::bits_to_float(layout::fp8_to_half_bits(code, p.format, layout::kHalf), layout::kHalf);
      const float scale = p.scale[layout::scale_index(p.scale_kind, n, k + e, p.bn, p.bk, p.scale_cols)];
      out[n * p.K + k + e] = HalfTraits<T>::from_float(value * scale);
    }
  }
}

template <typename T>
__global__ void codes_to_half_bits_kernel(const uint8_t* codes, int64_t count, int format, uint16_t* out) {
  using Pair = typename HalfTraits<T>::Pair;
  const int64_t first = 4 * (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x);
  if (first >= count) return;
  uint32_t word = 0;
  for (int e = 0; e < 4 && first + e < count; ++e) word |= static_cast<uint32_t>(codes[first + e]) << (8 * e);
  const int right = 8 - layout::widen_shift(format, HalfTraits<T>::kind);
  const float factor = exp2f(static_cast<float>(layout::widen_exponent(format, HalfTraits<T>::kind)));
  Pair low, high;
  widen_four(word, right, low, high);
  restore_pairs(HalfTraits<T>::pair(factor), low, high);
  const uint16_t bits[4] = {reinterpret_cast<const uint16_t*>(&low)[0], reinterpret_cast<const uint16_t*>(&low)[1],
                            reinterpret_cast<const uint16_t*>(&high)[0], reinterpret_cast<const uint16_t*>(&high)[1]};
  for (int e = 0; e < 4 && first + e < count; ++e) out[first + e] = bits[e];
}

template <typename T, int MT, int G>
cudaError_t launch_config(const Fp8LinearProblem& p, cudaStream_t stream) {
  const int64_t nt_count = layout::ceil_div(p.N, layout::kTileN);
  const dim3 grid(static_cast<unsigned>(layout::ceil_div(nt_count, kWarps)), static_cast<unsigned>(p.splits),
                  static_cast<unsigned>(layout::ceil_div(p.M, 16 * MT)));
  fp8_linear_kernel<T, MT, G><<<grid, kThreads, 0, stream>>>(p);
  cudaError_t error = cudaGetLastError();
  if (error != cudaSuccess || p.splits == 1) return error;
  const int64_t total = p.M * p.N;
  const int blocks = static_cast<int>(std::min<int64_t>((total + 255) / 256, 65535));
  splitk_reduce_kernel<T><<<blocks, 256, 0, stream>>>(p);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_typed(const Fp8LinearProblem& p, cudaStream_t stream) {
  switch (p.m_tiles) {
    case 1:
      return launch_config<T, 1, 4>(p, stream);
    case 2:
      return launch_config<T, 2, 4>(p, stream);
    default:
      return launch_config<T, 4, 2>(p, stream);
  }
}

}  // namespace

int fp8_linear_check(const Fp8LinearProblem& p, char* message, size_t size) {
  if (p.M < 0 || p.N < 1 || p.K < 1) {
    snprintf(message, size, "qfp8 fp8_linear: need M >= 0, N >= 1, K >= 1, got M=%lld, N=%lld, K=%lld",
             (long long)p.M, (long long)p.N, (long long)p.K);
    return 1;
  }
  if (p.x_cols < p.K || p.x_cols % 8 != 0 || p.lda < p.x_cols || p.lda % 8 != 0) {
    snprintf(message, size,
             "qfp8 fp8_linear: x must have K=%lld columns readable in 16-byte chunks (x_cols=%lld a multiple of 8, "
             ">= K; row stride lda=%lld a multiple of 8, >= x_cols)",
             (long long)p.K, (long long)p.x_cols, (long long)p.lda);
    return 1;
  }
  if (p.M > 0 && (reinterpret_cast<uintptr_t>(p.x) % 16 != 0 || reinterpret_cast<uintptr_t>(p.packed) % 16 != 0)) {
    snprintf(message, size, "qfp8 fp8_linear: x and the packed weight must be 16-byte aligned (M=%lld, K=%lld)",
             (long long)p.M, (long long)p.K);
    return 1;
  }
  if (p.format < layout::kE4M3FN || p.format > layout::kE4M3FNUZ || p.half_kind < 0 || p.half_kind > 1) {
    snprintf(message, size, "qfp8 fp8_linear: unknown FP8 format %d or half kind %d", p.format, p.half_kind);
    return 1;
  }
  if (p.scale_kind == layout::kScaleBlock) {
    const int64_t rows = layout::ceil_div(p.N, p.bn), cols = layout::ceil_div(p.K, p.bk);
    if (p.bn < 1 || p.bk < 32 || p.bk % 32 != 0 || p.scale_cols != cols) {
      snprintf(message, size,
               "qfp8 fp8_linear: block scales need bn >= 1 and bk a multiple of 32, with [%lld, %lld] scales for "
               "N=%lld, K=%lld; got block_size [%d, %d] and %lld scale columns",
               (long long)rows, (long long)cols, (long long)p.N, (long long)p.K, p.bn, p.bk, (long long)p.scale_cols);
      return 1;
    }
  } else if (p.scale_kind != layout::kScaleTensor && p.scale_kind != layout::kScaleChannel) {
    snprintf(message, size, "qfp8 fp8_linear: unknown scale kind %d", p.scale_kind);
    return 1;
  }
  if (p.ldy < p.N) {
    snprintf(message, size, "qfp8 fp8_linear: y row stride %lld is smaller than N=%lld", (long long)p.ldy,
             (long long)p.N);
    return 1;
  }
  return 0;
}

void fp8_linear_plan(Fp8LinearProblem& p, int sm_count) {
  p.m_tiles = p.M <= 16 ? 1 : (p.M <= 32 ? 2 : 4);
  const int64_t nt_count = layout::ceil_div(p.N, layout::kTileN);
  const int64_t kt_count = layout::ceil_div(p.K, layout::kTileK);
  const int64_t m_blocks = layout::ceil_div(p.M > 0 ? p.M : 1, 16 * p.m_tiles);
  // Enough warps for ~16 per multiprocessor (4 blocks of 4), each with at
  // least 8 K tiles (8 KiB of weights) so that the split is worth its reduce.
  const int64_t warps = nt_count * m_blocks;
  const int64_t wanted = static_cast<int64_t>(sm_count > 0 ? sm_count : 1) * 16;
  int64_t splits = (wanted + warps - 1) / warps;
  splits = std::max<int64_t>(1, std::min<int64_t>(splits, std::min<int64_t>(16, kt_count / 8)));
  p.kt_per_split = static_cast<int>((kt_count + splits - 1) / splits);
  p.splits = static_cast<int>((kt_count + p.kt_per_split - 1) / p.kt_per_split);
}

int64_t fp8_linear_workspace_floats(const Fp8LinearProblem& p) { return p.splits > 1 ? p.splits * p.M * p.N : 0; }

cudaError_t fp8_linear_launch(const Fp8LinearProblem& p, cudaStream_t stream) {
  if (p.M == 0) return cudaSuccess;
  return p.half_kind == layout::kBFloat16 ? launch_typed<__nv_bfloat16>(p, stream) : launch_typed<__half>(p, stream);
}

cudaError_t fp8_dequantize_packed_launch(const Fp8LinearProblem& p, void* out, cudaStream_t stream) {
  const int64_t words = layout::packed_bytes(p.N, p.K) / 4;
  const int blocks = static_cast<int>(std::min<int64_t>((words + 255) / 256, 65535));
  if (p.half_kind == layout::kBFloat16) {
    dequantize_packed_kernel<__nv_bfloat16><<<blocks, 256, 0, stream>>>(p, static_cast<__nv_bfloat16*>(out));
  } else {
    dequantize_packed_kernel<__half><<<blocks, 256, 0, stream>>>(p, static_cast<__half*>(out));
  }
  return cudaGetLastError();
}

cudaError_t fp8_codes_to_half_bits_launch(const uint8_t* codes, int64_t count, int format, int half_kind,
                                          uint16_t* out, cudaStream_t stream) {
  if (count <= 0) return cudaSuccess;
  const int threads = 128;
  const int blocks = static_cast<int>((count + 4 * threads - 1) / (4 * threads));
  if (half_kind == layout::kBFloat16) {
    codes_to_half_bits_kernel<__nv_bfloat16><<<blocks, threads, 0, stream>>>(codes, count, format, out);
  } else {
    codes_to_half_bits_kernel<__half><<<blocks, threads, 0, stream>>>(codes, count, format, out);
  }
  return cudaGetLastError();
}

}  // namespace qfp8
