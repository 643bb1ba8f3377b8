// Shared by the torch-binding translation units (isa.cpp, activations.cpp,
// linear.cpp, weights.cpp, attention.cpp, eager_entry.cpp, autograd.cpp);
// the kernels themselves include only kernel.h.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/function_schema.h>
#include <ATen/core/stack.h>
#include <c10/core/ScalarType.h>
#include <c10/util/string_view.h>

#include <optional>

#include "kernel.h"

namespace qfp8 {

// The WeightFormat of an FP8 dtype; any other dtype raises a torch error
// "<what> must be float8_e4m3fn, float8_e5m2 or float8_e4m3fnuz, got <dtype>".
int fp8_format(c10::ScalarType dtype, const char* what);

// ------------------------------------------------------------ ISA table (isa.cpp)

// The helpers beside an ISA's linear kernel (kernel.h). The row helpers read
// a row of x as given and are null for the ISAs that take W8A8 activations
// as float32.
struct IsaHelpers {
  DecodeAttentionFn decode_attention;
  GridErrorFn grid_error;
  QuantizeRowFn quantize_row;
  FiniteAmaxFn finite_amax;
  FiniteAmaxRowFn finite_amax_row;
  QuantizeRowBf16Fn quantize_row_bf16;
};

struct IsaEntry {
  const char* name;
  LinearTilesFn fn;  // null when not compiled into this build
  bool (*cpu_has)();
  LinearPrepareFn prepare;  // once per call, before the threads (kernel.h); null for none
  // The preparation from a convolution's patches read in place (kernel.h's
  // PatchRows); null for an ISA that takes them as a dense [M][K] matrix.
  LinearPrepareFn prepare_patches;
  const IsaHelpers* helpers;
  int64_t (*prepared_row_parts)(const void* prepared);  // kernel.h; null: the tiles alone are split
};

// The ISA the kernels use: the best the CPU has, or the one set by _cpu_set_isa.
const IsaEntry& current_isa();

// The decode-attention variant of the current ISA.
DecodeAttentionFn decode_attention_for_current_isa();

// ------------------------------------------------------------ activations (activations.cpp)

enum Activation { kNone, kToken, kTensor, kGroup, kStatic, kTokenMse };

// "none", "token", ...; anything else raises, naming the modes.
Activation parse_activation(c10::string_view activation);

// Fills buffer [M][Kp] (zero padded) and row_scale [M] from x [M][K] (T is
// float, c10::BFloat16 or c10::Half). With out_bf16 (a quantizing mode: FP8
// values, exact in bf16) the values go to out_bf16 [M][K] as bf16 bits
// instead, and buffer is unused. kGroup: with group_scale
// ([M][ceil(K / kActivationGroup)]) the values are the FP8 ones and each
// group's scale goes there; without, the scales multiply the values
// (q * scale in float32, as formats.dequantize_activation does); row_scale
// then holds each row's largest group scale.
template <typename T>
void prepare_activations(const T* x, int64_t M, int64_t K, int64_t Kp, Activation mode, at::ScalarType qdtype,
                         const float* input_scale, float* buffer, float* row_scale, uint16_t* out_bf16 = nullptr,
                         float* group_scale = nullptr);

// prepare_activations' token, tensor and static quantization into out_bf16
// [M][K], for an ISA with the row helpers, on a convolution's patches of x
// (the padded input, PatchRows' runs), run by run: the same values and
// scales as on the patch matrix. False, nothing written, for another ISA or
// mode.
template <typename T>
bool quantize_patches(const T* x, const PatchRows& patches, int64_t M, Activation mode, at::ScalarType qdtype,
                      const float* input_scale, float* row_scale, uint16_t* out_bf16);

// ------------------------------------------------------------ linear (linear.cpp)

at::Tensor scaled_linear_cpu(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& weight_scale,
                             const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& input_scale,
                             int64_t out_features, int64_t in_features, at::IntArrayRef block_size,
                             c10::string_view activation, at::ScalarType activation_dtype);

// A convolution's patch matrix (conv.cpp) as the activations of a linear
// call: read in place (PatchRows into `input`) by an ISA with a patch
// preparation step, else gathered into a dense [M][K] matrix by dense().
struct ConvPatches {
  at::Tensor input;  // the zero-padded channels-last input, contiguous
  PatchRows rows;
  int64_t M;
  at::Tensor dense() const;  // [M][K] in input's dtype
};

// scaled_linear_cpu's computation into out [M][N] on the patches x.
void scaled_linear_patches_into(at::Tensor& out, const ConvPatches& x, const at::Tensor& packed,
                                const at::Tensor& weight_scale, const std::optional<at::Tensor>& bias,
                                const std::optional<at::Tensor>& input_scale, int64_t N, int64_t K,
                                at::IntArrayRef block_size, Activation mode, at::ScalarType activation_dtype);

// AOTInductor's proxy executor hands an op an empty list argument as None;
// this puts the empty list back on the stack (linear.cpp).
void empty_lists_from_none(const c10::FunctionSchema& schema, torch::jit::Stack* stack);

// ------------------------------------------------------------ autograd (eager_entry.cpp)

// Whether x carries a forward-mode tangent (a dual tensor).
bool has_forward_grad(const at::Tensor& x);

}  // namespace qfp8
