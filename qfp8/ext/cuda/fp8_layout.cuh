// Arithmetic of the qfp8 CUDA weight-only kernel that needs no GPU: the FP8 ->
// fp16/bf16 bit conversion, the packed weight layout (and its inverse) and
// the scale layout. Compiled by nvcc into the kernel (fp8_linear.cu) and by
// the host C++ compiler into the CPU extension (qfp8/ext/cpu/cuda_host_layout.cpp),
// where it is unit-tested against the reference (tests/library/test_cuda_host.py).
//
// Packed weight layout
// --------------------
// The canonical weight is FP8 [N, K] (row n = output channel). It is cut
// into tiles of 32 output channels by 32 input channels; the tiles are
// stored tile-row by tile-row, K fastest:
//
//     packed[nt][kt][lane][s][j][e]   (bytes; NT = ceil(N/32), KT = ceil(K/32))
//     nt in [0, NT), kt in [0, KT), lane in [0, 32), s, j, e in [0, 4) x [0, 4) x [0, 4) with s < 2
//
// holds weight[n][k] with
//
//     n = 32 nt + 8 j + lane / 4,   k = 32 kt + 8 (lane % 4) + 4 s + e,
//
// zero where n >= N or k >= K. One tile is 1024 contiguous bytes; lane L of a
// warp reads bytes [32 L, 32 L + 32) of it with two 16-byte loads, so a warp
// streams each tile in one fully coalesced 1 KiB transaction.
//
// Why this order: mma.sync.m16n8k16 wants, in lane L (g = L / 4, t = L % 4),
// the B fragment b0 = B[k-slot 2t, 2t+1][col g], b1 = B[k-slot 2t+8, 2t+9][col g].
// The kernel maps the 16 k-slots of MMA step s (two steps per 32-wide tile)
// onto real k as   slot 2t+i -> 8t + 4s + i,   slot 2t+8+i -> 8t + 4s + 2 + i
// (a sum over k does not care about order, only A and B must agree). The
// 32-bit word (s, j) of a lane then holds the 4 bytes k = 8t+4s+{0,1,2,3} of
// column 8j+g: bytes 0,1 are b0 and bytes 2,3 are b1 of n8-tile j. The A
// fragment of row r for step s is x[r][32 kt + 8t + 4s .. +4): both steps
// come from one 16-byte load of x[r][32 kt + 8t .. +8).
//
// FP8 -> fp16/bf16 conversion
// ---------------------------
// An FP8 byte b (sign, E exponent bits, M mantissa bits, bias B8) is widened
// by moving its 7 exponent+mantissa bits so that its mantissa lines up with
// the target's (fp16: 10 bits, bf16: 7): bits = (b & 0x80) << 8 | (b & 0x7f) << (TM - M).
// That is the exact FP8 value times 2^(B8 - B16) for normals AND subnormals
// (an FP8 subnormal becomes a target subnormal). Multiplying by 2^(B16 - B8)
// (exact: a power of two, and every FP8 value fits the target) restores the
// value: one fp16x2/bf16x2 multiply per pair (per-channel/tensor scales),
// or, with block scales, a float32 multiply by factor * scale rounded once
// to fp16/bf16 (so w = q * s carries one fp16/bf16 rounding, like a bf16
// weight would). Subnormal FP8 codes widen to subnormal bf16 (e4m3 -> 2^-129):
// the device multiply must keep them (gpu_check compares all 256 codes). Non-finite codes are
// not preserved (e4m3fn NaN 0x7f -> 480, e5m2 Inf -> 65536 in bf16): weights
// are refused at quantize time if non-finite, so such codes never occur.
//
// Scales
// ------
// weight_scale is float32, [1] (tensor), [N, 1] (channel) or
// [ceil(N/bn), ceil(K/bk)] (block, row-major). Tensor and channel scales are
// applied to the float32 accumulator in the epilogue (exact scale). Block
// scales vary along K, so they multiply the weights before the MMA (see
// above): the kernel requires bk % 32 == 0 so that a 32-wide tile lies in one
// block. The scale of weight[n][k] is weight_scale[scale_index(...)].
#pragma once

#include <stdint.h>

#ifdef __CUDACC__
#define QFP8_HD __host__ __device__ __forceinline__
#else
#define QFP8_HD inline
#endif

namespace qfp8 {
namespace layout {

constexpr int kTileN = 32;       // output channels per packed tile (one warp's columns)
constexpr int kTileK = 32;       // input channels per packed tile (two m16n8k16 steps)
constexpr int kTileBytes = 1024;  // kTileN * kTileK bytes
constexpr int kLaneBytes = 32;    // bytes one lane reads per tile

// FP8 formats, the same codes as the CPU kernel (qfp8/ext/cpu/kernel.h).
enum Fp8Format : int { kE4M3FN = 0, kE5M2 = 1, kE4M3FNUZ = 2 };
// Output (and activation) precision of the kernel.
enum HalfKind : int { kHalf = 0, kBFloat16 = 1 };

QFP8_HD int ceil_div(int64_t a, int64_t b) { return static_cast<int>((a + b - 1) / b); }

QFP8_HD int fp8_mantissa_bits(int format) { return format == kE5M2 ? 2 : 3; }
QFP8_HD int fp8_exponent_bias(int format) { return format == kE5M2 ? 15 : (format == kE4M3FNUZ ? 8 : 7); }
QFP8_HD int half_mantissa_bits(int kind) { return kind == kBFloat16 ? 7 : 10; }
QFP8_HD int half_exponent_bias(int kind) { return kind == kBFloat16 ? 127 : 15; }

// Left shift that puts the FP8 exponent+mantissa bits at the target's place.
QFP8_HD int widen_shift(int format, int kind) { return half_mantissa_bits(kind) - fp8_mantissa_bits(format); }

// log2 of the exact factor that turns widened bits into the FP8 value.
QFP8_HD int widen_exponent(int format, int kind) { return half_exponent_bias(kind) - fp8_exponent_bias(format); }

// The widened bits of one FP8 code (value = FP8 value * 2^-widen_exponent).
QFP8_HD uint16_t widen_bits(uint8_t code, int format, int kind) {
  return static_cast<uint16_t>(((code & 0x80u) << 8) | ((code & 0x7fu) << widen_shift(format, kind)));
}

// The device does the same on two codes at once: each code sits in the high
// byte of a 16-bit lane (c << 8, from a byte permute); this is the bit
// arithmetic it then applies to the 32-bit word.
QFP8_HD uint32_t widen_pair_from_high_bytes(uint32_t word, int format, int kind) {
  const int right = 8 - widen_shift(format, kind);  // 1 (e4m3->fp16), 0 (e5m2->fp16), 4, 3 (bf16)
  return (word & 0x80008000u) | ((word & 0x7f007f00u) >> right);
}

// float <-> fp16/bf16 bits, round to nearest even (host reference for the
// multiply the device does in fp16/bf16 arithmetic).
QFP8_HD float bits_to_float(uint16_t bits, int kind) {
  if (kind == kBFloat16) {
    union {
      uint32_t u;
      float f;
    } v;
    v.u = static_cast<uint32_t>(bits) << 16;
    return v.f;
  }
  const uint32_t sign = (bits >> 15) & 1u, exponent = (bits >> 10) & 0x1fu, mantissa = bits & 0x3ffu;
  float magnitude;
  if (exponent == 0) {
    magnitude = static_cast<float>(mantissa) * (1.0f / 16777216.0f);  // m * 2^-24
  } else if (exponent == 31) {
    union {
      uint32_t u;
      float f;
    } v;
    v.u = mantissa ? 0x7fc00000u : 0x7f800000u;
    magnitude = v.f;
  } else {
    union {
      uint32_t u;
      float f;
    } v;
    v.u = ((exponent + 112u) << 23) | (mantissa << 13);
    magnitude = v.f;
  }
  return sign ? -magnitude : magnitude;
}

QFP8_HD uint16_t float_to_bits(float value, int kind) {
  union {
    float f;
    uint32_t u;
  } v;
  v.f = value;
  const uint32_t u = v.u;
  if (kind == kBFloat16) {
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
    const uint32_t rounded = u + 0x7fffu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(rounded >> 16);
  }
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to >= 65520: Inf
  if (abs < 0x38800000u) {  // below 2^-14: fp16 subnormal (or zero), units of 2^-24
    union {
      uint32_t u;
      float f;
    } a;
    a.u = abs;
    const float units = a.f * 16777216.0f;  // exact: a power-of-two scaling
    uint32_t whole = static_cast<uint32_t>(units);
    const float rest = units - static_cast<float>(whole);
    if (rest > 0.5f || (rest == 0.5f && (whole & 1u))) ++whole;
    return static_cast<uint16_t>(sign | whole);
  }
  const uint32_t rebased = abs - (112u << 23);  // exponent 127 -> 15
  const uint32_t rounded = rebased + 0xfffu + ((rebased >> 13) & 1u);
  return static_cast<uint16_t>(sign | (rounded >> 13));
}

// The exact fp16/bf16 bits of an FP8 code as the kernel computes them:
// widen, then multiply by 2^widen_exponent (in fp16/bf16; exact).
QFP8_HD uint16_t fp8_to_half_bits(uint8_t code, int format, int kind) {
  const float widened = bits_to_float(widen_bits(code, format, kind), kind);
  float factor = 1.0f;
  for (int i = 0; i < widen_exponent(format, kind); ++i) factor *= 2.0f;
  return float_to_bits(widened * factor, kind);
}

// --------------------------------------------------------------- packing

QFP8_HD int64_t packed_bytes(int64_t n, int64_t k) {
  return static_cast<int64_t>(ceil_div(n, kTileN)) * ceil_div(k, kTileK) * kTileBytes;
}

// Offset in the packed buffer of weight[n][k] (n < N, k < K).
QFP8_HD int64_t packed_offset(int64_t n, int64_t k, int64_t K) {
  const int64_t kt_count = ceil_div(K, kTileK);
  const int64_t nt = n / kTileN, kt = k / kTileK;
  const int j = static_cast<int>((n % kTileN) / 8), g = static_cast<int>(n % 8);
  const int t = static_cast<int>((k % kTileK) / 8), s = static_cast<int>((k % 8) / 4), e = static_cast<int>(k % 4);
  const int lane = 4 * g + t;
  return (nt * kt_count + kt) * kTileBytes + lane * kLaneBytes + s * 16 + j * 4 + e;
}

// The inverse: which weight[n][k] the packed byte at `offset` holds (it may
// lie in the zero padding: n >= N or k >= K).
QFP8_HD void packed_source(int64_t offset, int64_t K, int64_t* n, int64_t* k) {
  const int64_t kt_count = ceil_div(K, kTileK);
  const int64_t tile = offset / kTileBytes;
  const int within = static_cast<int>(offset % kTileBytes);
  const int lane = within / kLaneBytes, s = (within % kLaneBytes) / 16, j = (within % 16) / 4, e = within % 4;
  *n = (tile / kt_count) * kTileN + 8 * j + lane / 4;
  *k = (tile % kt_count) * kTileK + 8 * (lane % 4) + 4 * s + e;
}

// Offset of the 32 bytes lane `lane` reads from tile (nt, kt).
QFP8_HD int64_t lane_tile_offset(int64_t nt, int64_t kt, int64_t kt_count, int lane) {
  return (nt * kt_count + kt) * kTileBytes + static_cast<int64_t>(lane) * kLaneBytes;
}

// ---------------------------------------------------------------- scales

enum ScaleKind : int { kScaleTensor = 0, kScaleChannel = 1, kScaleBlock = 2 };

// Index into weight_scale of the scale of weight[n][k].
QFP8_HD int64_t scale_index(int kind, int64_t n, int64_t k, int bn, int bk, int64_t scale_cols) {
  if (kind == kScaleTensor) return 0;
  if (kind == kScaleChannel) return n;
  return (n / bn) * scale_cols + k / bk;
}

}  // namespace layout
}  // namespace qfp8
