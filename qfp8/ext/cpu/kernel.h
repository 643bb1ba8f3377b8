// Shared declarations of the qfp8 CPU linear kernels (no torch headers, so
// that the per-ISA translation units compile in seconds with their own flags).
//
// Packed weight layout (built by qfp8.library.cpu.pack_weight_cpu, the same
// for every ISA):
//
//   packed[T][Kp / 2][64] bytes,  T = ceil(N / 32),  Kp = K rounded up to even
//   packed[t][p][2 * c + j] = W[32 * t + c][2 * p + j]   (zero where out of range)
//
// i.e. tiles of 32 output channels; inside a tile, one 64-byte group per pair
// of k values, channels in order, the two k of a pair side by side. The
// vector kernels split a group's even and odd bytes (k = 2p and k = 2p + 1)
// with vpmaddubsw (a multiply port, no shuffle), so one instruction yields
// the fp16 bits of 8 (16 for AVX512) consecutive channels at one k; each
// parity keeps its own float32 accumulators, added at the end of the tile.
//
// Arithmetic: y[m][n] = row_scale[m] * sum_k x[m][k] * W[n][k] * s(n, k) + bias[n],
// x in float32 (the op converts or quantizes the activations first), float32
// accumulation, then a round-to-nearest-even store to the output dtype.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>

namespace qfp8 {

constexpr int64_t kTileN = 32;       // output channels per tile
constexpr int64_t kGroupBytes = 64;  // bytes per (tile, k pair) group
constexpr int64_t kActivationGroup = 128;  // 1 x 128 activation groups (formats.ACTIVATION_GROUP_SIZE)

enum WeightFormat : int { kE4M3FN = 0, kE5M2 = 1, kE4M3FNUZ = 2 };
enum ScaleKind : int { kScaleTensor = 0, kScaleChannel = 1, kScaleBlock = 2 };
enum OutDtype : int { kOutFloat = 0, kOutBFloat16 = 1, kOutHalf = 2 };

// A convolution's patch matrix read in place from its zero-padded
// channels-last input (bf16): element k of row m is
//   x_bf16[row_offset[m] + segment_offset[k / segment_length] + k % segment_length],
// i.e. each row is `segments` contiguous runs of segment_length elements (a
// kernel row's kw * C values, or C values when the kernel is dilated along
// its width). K = segments * segment_length.
struct PatchRows {
  const int64_t* row_offset;      // [M]
  const int64_t* segment_offset;  // [segments]
  int64_t segments, segment_length;
};

struct LinearProblem {
  const float* x;  // [M][ldx] float32, columns K..Kp-1 are zero
  int64_t M, K, Kp, ldx;
  const uint8_t* w;  // packed, see above
  int64_t N;
  int format;          // WeightFormat
  float format_factor; // 2^8 (e4m3fn), 1 (e5m2), 2^7 (e4m3fnuz): see fp16 trick below
  const float* scale;  // weight scale, float32
  int scale_kind;      // ScaleKind
  int64_t bn, bk, scale_cols;
  const float* row_scale;  // [M] activation scale applied to the output rows, or null
  // Dynamic 1 x kActivationGroup activation scales, [M][group_cols], which the
  // tiles apply to each group's partial sums (x then holds the FP8 values
  // themselves); null otherwise. Only an ISA with a prepare step is given them.
  const float* group_scale;
  int64_t group_cols;
  const float* bias;       // [N] float32 or null
  void* out;               // [M][ldo]
  int out_dtype;           // OutDtype
  int64_t ldo;
  const void* prepared;    // what the ISA's prepare step made of x (see below), or null
  // Only while the prepare step runs, for an ISA that has one: bf16
  // activations [M][K], x as given or its quantized FP8 values (x is then
  // null). A prepare step that declines them (returns null) is not asked
  // again; the float32 x goes to its tiles without a prepared form.
  const uint16_t* x_bf16;
  // Only while an ISA's patch preparation step runs (prepare_patches): the
  // rows of x_bf16 are a convolution's patches (PatchRows), not [M][K].
  const PatchRows* patches;
  int64_t threads;  // how many threads share the call's tiles (a tuning hint)
  // With row parts (IsaEntry::prepared_row_parts, more than one): the part of
  // the prepared rows, row_part of row_parts, whose outputs the tiles compute.
  int64_t row_parts, row_part;
};

// Computes tiles [tile_begin, tile_end) of the problem. One per ISA; each is
// compiled in its own translation unit with its own -m flags.
using LinearTilesFn = void (*)(const LinearProblem&, int64_t tile_begin, int64_t tile_end);
void linear_tiles_scalar(const LinearProblem& p, int64_t tile_begin, int64_t tile_end);
void linear_tiles_avx2(const LinearProblem& p, int64_t tile_begin, int64_t tile_end);
void linear_tiles_avx512(const LinearProblem& p, int64_t tile_begin, int64_t tile_end);
void linear_tiles_avx512bf16(const LinearProblem& p, int64_t tile_begin, int64_t tile_end);
// An ISA may prepare the activations once per call, before the tiles are
// split over threads: linear.cpp keeps the result alive for the call and passes
// it as LinearProblem::prepared. Null means the ISA's tiles go without.
using LinearPrepareFn = std::shared_ptr<const void> (*)(const LinearProblem&);
std::shared_ptr<const void> prepare_avx512bf16(const LinearProblem& p);
// The same preparation from p.patches (bf16 x, activations as given): the
// im2col of a convolution done by the copy the preparation makes anyway.
// Null when it declines (few rows, an odd segment length, tiny magnitudes).
std::shared_ptr<const void> prepare_patches_avx512bf16(const LinearProblem& p);
// How many row parts the prepared activations are in (1: none): part r was
// laid out by the call's thread r and goes through every tile on it.
int64_t prepared_row_parts_avx512bf16(const void* prepared);
// AMX (kernel_amx.cpp): tile products; block scales whose k-block is not a
// multiple of 32 go to the avx512bf16 kernel, whose preparation it wraps.
void linear_tiles_amx(const LinearProblem& p, int64_t tile_begin, int64_t tile_end);
std::shared_ptr<const void> prepare_amx(const LinearProblem& p);

// Runs fn(context, begin, end) over ranges covering [0, count), of at least
// `grain` each, on the threads of the call (at::parallel_for, linear.cpp): in
// one range inline within a parallel region or below two grains. For an
// ISA's prepare step, whose ranges write disjoint memory.
using RangeFn = void (*)(void* context, int64_t begin, int64_t end);
void parallel_ranges_fn(int64_t count, int64_t grain, RangeFn fn, void* context);
// The threads a call's parallel_ranges and tiles get: 1 inside a parallel region.
int64_t call_threads();
template <typename F>
void parallel_ranges(int64_t count, int64_t grain, F&& f) {
  using Fn = std::remove_reference_t<F>;
  parallel_ranges_fn(
      count, grain, [](void* c, int64_t begin, int64_t end) { (*static_cast<Fn*>(c))(begin, end); },
      const_cast<void*>(static_cast<const void*>(&f)));
}

// nbytes of memory, not initialized; from 2 MiB up 2 MiB-aligned and advised
// for transparent huge pages (whole 2 MiB pages only) before its first
// touch, below that 64-byte aligned. Release with std::free. Null when it
// cannot be had. (allocator.cpp; used for packed weights and activation
// buffers, the avx512bf16 kernel's laid-out activations.)
void* huge_page_alloc(size_t nbytes);

// Memory for one call's activations (laid out for the kernel, quantized,
// converted): huge_page_alloc's, taken from and given back to a per-thread
// cache of freed buffers (allocator.cpp), not initialized. A fresh buffer of
// tens of MB costs its page faults on every call, and after other large
// allocations and frees far more (with transparent huge pages on madvise,
// the faults then compact memory first). Null `get()` when it cannot be had.
void* scratch_alloc(size_t nbytes, size_t* capacity);
void scratch_free(void* data, size_t capacity);

template <typename T>
class ScratchBuffer {
 public:
  ScratchBuffer() = default;
  explicit ScratchBuffer(size_t count) {  // in the body: capacity_'s initializer would run after data_'s
    data_ = static_cast<T*>(scratch_alloc(count * sizeof(T), &capacity_));
  }
  ScratchBuffer(ScratchBuffer&& other) noexcept : data_(other.data_), capacity_(other.capacity_) {
    other.data_ = nullptr;
  }
  ScratchBuffer& operator=(ScratchBuffer&& other) noexcept {
    if (this != &other) {
      reset();
      data_ = other.data_;
      capacity_ = other.capacity_;
      other.data_ = nullptr;
    }
    return *this;
  }
  ScratchBuffer(const ScratchBuffer&) = delete;
  ScratchBuffer& operator=(const ScratchBuffer&) = delete;
  ~ScratchBuffer() { reset(); }
  T* get() const { return data_; }
  void reset() {
    if (data_) scratch_free(data_, capacity_);
    data_ = nullptr;
  }

 private:
  T* data_ = nullptr;
  size_t capacity_ = 0;
};

// The AVX512 kernel's code on AVX2 (kernel_avx512emu.cpp): for tests only, never dispatched to.
void linear_tiles_avx512emu(const LinearProblem& p, int64_t tile_begin, int64_t tile_end);

// ------------------------------------------------------------ decode attention
// One query token per sequence against an FP8 K/V cache, grouped-query
// (G = Hq / Hkv query heads share a K/V head), for h = hq / G:
//   scores[s] = (q[b][hq] . k[b][h][s]) * k_scale + mask[b][s]
//   out[b][hq] = sum_s softmax(scores)[s] * v[b][h][s] * v_scale
// q is float32 and already multiplied by the softmax scaling. Positions whose
// mask is -inf (or below -1e30, transformers' finfo.min) are never read, so a
// static cache costs what its filled part costs. A row with every position
// masked gives zeros. One task = one (b, h): its G query heads read each K
// and V row once.
struct DecodeAttention {
  const float* q;   // [B][Hq][D]
  const uint8_t* k; // [B][Hkv][S][D] FP8 bytes
  const uint8_t* v; // [B][Hkv][S][D]
  int64_t B, Hq, Hkv, S, D;
  int format;             // WeightFormat of the cache
  const float* k_scale;   // [1] or [B * Hkv]
  const float* v_scale;   // [1] or [B * Hkv]
  bool per_head_scale;
  const float* mask;      // [B][S] additive, or null (every position valid)
  float* scores;          // scratch [B * Hkv][G][S]
  float* out;             // [B][Hq][D] float32
};

using DecodeAttentionFn = void (*)(const DecodeAttention&, int64_t task_begin, int64_t task_end);
void decode_attention_scalar(const DecodeAttention& a, int64_t task_begin, int64_t task_end);
void decode_attention_avx2(const DecodeAttention& a, int64_t task_begin, int64_t task_end);

// ------------------------------------------------------------ token-mse search
// The grid of an FP8 activation dtype, for the "token-mse" scale search
// (formats.token_mse_scale): a value is rounded to it as the c10 casts do,
// to nearest even. Normal magnitudes drop `dropped_bits` float32 mantissa
// bits with the add-half-minus-one-plus-odd-bit carry (which may carry into
// the exponent); below `min_normal`, (a + magic) - magic rounds to the
// subnormal step (magic = step * 2^23).
struct Fp8Grid {
  int dropped_bits;
  float min_normal, magic, fmax;
};

inline float round_to_grid(float v, const Fp8Grid& grid) {
  float a = v < 0.0f ? -v : v;
  if (a < grid.min_normal) {
    a = (a + grid.magic) - grid.magic;
  } else {
    uint32_t bits;
    std::memcpy(&bits, &a, sizeof bits);
    const uint32_t half = (1u << (grid.dropped_bits - 1)) - 1u;
    bits = (bits + half + ((bits >> grid.dropped_bits) & 1u)) & ~((1u << grid.dropped_bits) - 1u);
    std::memcpy(&a, &bits, sizeof bits);
  }
  return v < 0.0f ? -a : a;
}

// sum over k of (round_to_grid(u) - u)^2 with u = clamp(row[k] * inverse, +-fmax):
// float32 terms, float64 sum; row holds finite values.
using GridErrorFn = double (*)(const float* row, int64_t K, float inverse, const Fp8Grid& grid);
double grid_error_scalar(const float* row, int64_t K, float inverse, const Fp8Grid& grid);
double grid_error_avx2(const float* row, int64_t K, float inverse, const Fp8Grid& grid);
double grid_error_avx512bf16(const float* row, int64_t K, float inverse, const Fp8Grid& grid);

// ------------------------------------------------------------ activation quantization
// out[k] = round_to_grid(clamp(row[k] / scale, +-fmax)) * post, NaN where the
// quotient is not finite (formats.quantize_activation; row may be out).
using QuantizeRowFn = void (*)(const float* row, int64_t K, float scale, float post, const Fp8Grid& grid, float* out);
void quantize_row_scalar(const float* row, int64_t K, float scale, float post, const Fp8Grid& grid, float* out);
void quantize_row_avx2(const float* row, int64_t K, float scale, float post, const Fp8Grid& grid, float* out);
void quantize_row_avx512bf16(const float* row, int64_t K, float scale, float post, const Fp8Grid& grid, float* out);
// The largest finite |row[k]| (0 when there is none).
using FiniteAmaxFn = float (*)(const float* row, int64_t K);
float finite_amax_scalar(const float* row, int64_t K);
float finite_amax_avx2(const float* row, int64_t K);
float finite_amax_avx512bf16(const float* row, int64_t K);

// The same two on one row of x as given (float32, bf16 or fp16 values by
// RowKind), for the ISAs that take W8A8 activations as bf16: no float32 copy
// of the row, and the FP8 values written as bf16 bits (exact), post = 1.
enum RowKind { kRowFloat, kRowBFloat16, kRowHalf };
using FiniteAmaxRowFn = float (*)(const void* row, int kind, int64_t K);
using QuantizeRowBf16Fn = void (*)(const void* row, int kind, int64_t K, float scale, const Fp8Grid& grid,
                                   uint16_t* out);
float finite_amax_row_avx512bf16(const void* row, int kind, int64_t K);
void quantize_row_bf16_avx512bf16(const void* row, int kind, int64_t K, float scale, const Fp8Grid& grid,
                                  uint16_t* out);

// The FP8 -> fp16 bit trick every vector kernel uses: an e4m3 byte b becomes
// the fp16 with bits ((int16)(b << 8) >> 1) & 0xBFFF (sign kept in bit 15,
// exponent and mantissa one bit lower), whose value is the e4m3 value / 2^8
// (e4m3fnuz: / 2^7); an e5m2 byte is already the high byte of its fp16.
// Subnormal FP8 values become subnormal fp16 values, which vcvtph2ps
// converts exactly, independent of MXCSR's DAZ. The factor goes back in with
// the scale (never 2^120 folded into a scale: that overflows float32).
inline float format_factor(int format) {
  return format == kE4M3FN ? 256.0f : (format == kE4M3FNUZ ? 128.0f : 1.0f);
}

// The weight scale of (channel n, column k), without the format factor.
inline float weight_scale_at(const LinearProblem& p, int64_t n, int64_t k) {
  if (p.scale_kind == kScaleTensor) return p.scale[0];
  if (p.scale_kind == kScaleChannel) return p.scale[n];
  return p.scale[(n / p.bn) * p.scale_cols + k / p.bk];
}

// Fills lane_scale[64] with the scale (times the format factor) of each
// weight of the group of k pair `pair` in tile `tile`, in the order
// lane_scale[32 * j + c] for channel c and k = 2 * pair + j, for kernels that
// fold block scales into the weights. Returns the first k at which it must be
// recomputed, so a caller refreshes it only when a block boundary is crossed.
inline int64_t fill_lane_scales(const LinearProblem& p, int64_t tile, int64_t pair, float* lane_scale) {
  const int64_t k0 = 2 * pair;
  for (int64_t c = 0; c < kTileN; ++c) {
    int64_t n = tile * kTileN + c;
    if (n >= p.N) n = p.N - 1;  // padded channels have zero weights; any finite scale will do
    for (int64_t j = 0; j < 2; ++j) {
      int64_t k = k0 + j < p.K ? k0 + j : p.K - 1;
      lane_scale[kTileN * j + c] = weight_scale_at(p, n, k) * p.format_factor;
    }
  }
  if (p.scale_kind != kScaleBlock) return p.Kp;
  // Refresh at the pair holding the next block start (an odd bk puts a
  // boundary inside a pair, and then the next pair starts a new block too).
  int64_t next = (k0 / p.bk + 1) * p.bk;
  if (k0 + 1 < p.K && (k0 + 1) / p.bk != k0 / p.bk) next = k0 + 2;
  return next & ~int64_t(1);
}

// float32 -> bfloat16 bits, round to nearest even; NaN stays NaN (the plain
// rounding add would carry a low-payload NaN into Inf).
inline uint16_t float_to_bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// float32 -> IEEE fp16 bits, round to nearest even, overflow to Inf, NaN kept.
// Portable (no F16C) so that the scalar kernel runs anywhere.
inline uint16_t float_to_half_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((abs >> 13) & 0x3ffu));
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to >= 65520: Inf
  if (abs < 0x38800000u) {                                                  // fp16 subnormal or zero
    if (abs < 0x33000000u) return static_cast<uint16_t>(sign);            // below half the smallest subnormal
    const uint32_t exponent = abs >> 23;
    const uint32_t mantissa = (abs & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - exponent;  // 14 .. 24
    uint32_t half = mantissa >> shift;
    const uint32_t rest = mantissa & ((1u << shift) - 1);
    const uint32_t halfway = 1u << (shift - 1);
    if (rest > halfway || (rest == halfway && (half & 1u))) ++half;
    return static_cast<uint16_t>(sign | half);
  }
  uint32_t h = ((abs - 0x38000000u) >> 13);
  const uint32_t rest = abs & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;
  return static_cast<uint16_t>(sign | h);
}

// Writes one tile's finished channel sums (multiplied by channel_mult) for
// row m: applies the row scale and bias and stores the valid channels in the
// output dtype. Scalar on purpose: it runs M * N times, against M * N * K
// multiply-adds in the kernel.
inline void store_tile_row(const LinearProblem& p, int64_t m, int64_t tile, const float* sums,
                           const float* channel_mult) {
  const int64_t n0 = tile * kTileN;
  const int64_t count = p.N - n0 < kTileN ? p.N - n0 : kTileN;
  const float row = p.row_scale ? p.row_scale[m] : 1.0f;
  for (int64_t c = 0; c < count; ++c) {
    float v = sums[c] * channel_mult[c];
    if (p.row_scale) v *= row;
    if (p.bias) v += p.bias[n0 + c];
    if (p.out_dtype == kOutFloat) {
      static_cast<float*>(p.out)[m * p.ldo + n0 + c] = v;
    } else if (p.out_dtype == kOutBFloat16) {
      static_cast<uint16_t*>(p.out)[m * p.ldo + n0 + c] = float_to_bf16_bits(v);
    } else {
      static_cast<uint16_t*>(p.out)[m * p.ldo + n0 + c] = float_to_half_bits(v);
    }
  }
}

// The per-channel multiplier applied at the end of a tile when the weight
// scale is not folded into the weights (tensor and channel scales).
inline void fill_channel_mult(const LinearProblem& p, int64_t tile, bool folded, float* mult) {
  for (int64_t c = 0; c < kTileN; ++c) {
    const int64_t n = tile * kTileN + c < p.N ? tile * kTileN + c : p.N - 1;
    mult[c] = folded ? 1.0f : weight_scale_at(p, n, 0) * p.format_factor;
  }
}

}  // namespace qfp8
