// torch binding of the qfp8 CUDA weight-only kernel (fp8_linear.cu).
//
// Built only when torch has CUDA: by setup.py as qfp8._C_cuda, or at run time
// by bench/gpu_check.py with torch.utils.cpp_extension.load. The schemas and
// fake implementations of the ops below are defined in Python
// (qfp8/library/cuda.py) so that they exist, and torch.compile traces them,
// without this file; here only their CUDA implementations are registered:
//
//   qfp8::_fp8_linear_cuda(x [M, K'] fp16/bf16, packed, weight_scale, bias?,
//                          out_features, in_features, block_size) -> [M, N]
//   qfp8::_fp8_dequantize_packed_cuda(packed, weight_scale, out_features,
//                          in_features, block_size, dtype) -> [N, K]
//   qfp8::_fp8_codes_to_half_bits_cuda(codes uint8, fp8_dtype, half_dtype) -> int16
//
// The Python wrapper pads x to K' = a multiple of 8 and makes it contiguous;
// the checks here are cheap and their messages name the sizes.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <Python.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <array>
#include <atomic>

#include "fp8_layout.cuh"
#include "fp8_linear.h"

namespace qfp8 {
namespace {

int fp8_format_of(at::ScalarType dtype, const char* op) {
  switch (dtype) {
    case at::kFloat8_e4m3fn:
      return layout::kE4M3FN;
    case at::kFloat8_e5m2:
      return layout::kE5M2;
    case at::kFloat8_e4m3fnuz:
      return layout::kE4M3FNUZ;
    default:
      TORCH_CHECK(false, op, ": expected a float8_e4m3fn, float8_e5m2 or float8_e4m3fnuz weight, got ", dtype);
  }
}

int half_kind_of(at::ScalarType dtype, const char* op) {
  TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16, op, ": expected float16 or bfloat16, got ", dtype);
  return dtype == at::kBFloat16 ? layout::kBFloat16 : layout::kHalf;
}

// (compute capability major, multiprocessors) of `device`, cached: the
// attribute queries are cheap but this runs on every call.
struct DeviceInfo {
  int major;
  int sm_count;
};

DeviceInfo device_info(c10::DeviceIndex device) {
  static std::array<std::atomic<int>, 64> cache{};  // major * 65536 + sm_count, 0 = unknown
  const int slot = device >= 0 && device < 64 ? device : -1;
  if (slot >= 0) {
    const int cached = cache[slot].load(std::memory_order_relaxed);
    if (cached) return {cached >> 16, cached & 0xffff};
  }
  int major = 0, sm_count = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device));
  if (slot >= 0) cache[slot].store((major << 16) | (sm_count & 0xffff), std::memory_order_relaxed);
  return {major, sm_count};
}

cudaStream_t current_stream(const at::Tensor& tensor) {
  return c10::cuda::getCurrentCUDAStream(tensor.device().index()).stream();
}

// Fills the weight and scale fields shared by the linear and the dequantize.
Fp8LinearProblem weight_problem(const at::Tensor& packed, const at::Tensor& weight_scale, int64_t N, int64_t K,
                                at::IntArrayRef block_size, const char* op) {
  TORCH_CHECK(N >= 1 && K >= 1, op, ": out_features and in_features must be >= 1, got ", N, " and ", K);
  TORCH_CHECK(packed.is_cuda() && packed.is_contiguous() && packed.numel() == layout::packed_bytes(N, K), op,
              ": packed weight has shape ", packed.sizes(), " on ", packed.device(), ", expected ",
              layout::packed_bytes(N, K), " contiguous bytes on a CUDA device for out_features=", N,
              ", in_features=", K, " (pack it with qfp8::pack_weight_cuda)");
  TORCH_CHECK(weight_scale.is_cuda() && weight_scale.scalar_type() == at::kFloat && weight_scale.is_contiguous(), op,
              ": weight_scale must be contiguous float32 on the GPU, got ", weight_scale.scalar_type(), " on ",
              weight_scale.device());
  Fp8LinearProblem p;
  p.N = N;
  p.K = K;
  p.packed = static_cast<const uint8_t*>(packed.data_ptr());
  p.format = fp8_format_of(packed.scalar_type(), op);
  p.scale = weight_scale.data_ptr<float>();
  if (!block_size.empty()) {
    TORCH_CHECK(block_size.size() == 2 && block_size[0] > 0 && block_size[1] > 0, op,
                ": block_size must be [bn, bk] or [], got ", block_size);
    const int64_t rows = (N + block_size[0] - 1) / block_size[0], cols = (K + block_size[1] - 1) / block_size[1];
    TORCH_CHECK(weight_scale.dim() == 2 && weight_scale.size(0) == rows && weight_scale.size(1) == cols, op,
                ": block weight_scale has shape ", weight_scale.sizes(), ", expected [", rows, ", ", cols,
                "] for out_features=", N, ", in_features=", K, ", block_size=", block_size);
    p.scale_kind = layout::kScaleBlock;
    p.bn = static_cast<int>(block_size[0]);
    p.bk = static_cast<int>(block_size[1]);
    p.scale_cols = cols;
  } else if (weight_scale.numel() == 1) {
    p.scale_kind = layout::kScaleTensor;
  } else {
    TORCH_CHECK(weight_scale.numel() == N, op, ": weight_scale has shape ", weight_scale.sizes(),
                ", expected [1] or [", N, ", 1] for out_features=", N);
    p.scale_kind = layout::kScaleChannel;
  }
  return p;
}

at::Tensor fp8_linear_cuda(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& weight_scale,
                           const std::optional<at::Tensor>& bias, int64_t out_features, int64_t in_features,
                           at::IntArrayRef block_size) {
  const char* op = "qfp8::_fp8_linear_cuda";
  const c10::cuda::CUDAGuard guard(x.device());
  Fp8LinearProblem p = weight_problem(packed, weight_scale, out_features, in_features, block_size, op);
  TORCH_CHECK(x.is_cuda() && x.dim() == 2 && x.is_contiguous(), op, ": x must be a contiguous 2-D CUDA tensor, got ",
              x.sizes(), " on ", x.device());
  const int64_t x_cols = (in_features + 7) / 8 * 8;
  TORCH_CHECK(x.size(1) == in_features || x.size(1) == x_cols, op, ": x has shape ", x.sizes(), ", expected ",
              in_features, " columns (or ", x_cols, ", zero padded) for in_features=", in_features);
  p.half_kind = half_kind_of(x.scalar_type(), op);
  p.x = x.data_ptr();
  p.M = x.size(0);
  p.lda = x.size(1);
  p.x_cols = x.size(1) % 8 == 0 ? x.size(1) : 0;  // rejected by the check, which names the sizes
  at::Tensor y = at::empty({p.M, out_features}, x.options());
  p.y = y.data_ptr();
  p.ldy = out_features;
  at::Tensor bias_buffer;
  if (bias.has_value()) {
    TORCH_CHECK(bias->is_cuda() && bias->numel() == out_features && bias->is_contiguous(), op, ": bias has shape ",
                bias->sizes(), " on ", bias->device(), ", expected [", out_features, "] on the GPU");
    if (bias->scalar_type() == at::kFloat) {
      p.bias_kind = kBiasFloat;
      bias_buffer = *bias;
    } else {
      p.bias_kind = kBiasSameAsOutput;
      bias_buffer = bias->scalar_type() == x.scalar_type() ? *bias : bias->to(x.scalar_type());
    }
    p.bias = bias_buffer.data_ptr();
  }
  char message[512];
  TORCH_CHECK(fp8_linear_check(p, message, sizeof(message)) == 0, message);
  const DeviceInfo info = device_info(x.device().index());
  TORCH_CHECK(info.major >= 8, op, ": needs compute capability 8.0 or newer, this GPU has major version ",
              info.major);
  fp8_linear_plan(p, info.sm_count);
  at::Tensor workspace;
  const int64_t workspace_floats = fp8_linear_workspace_floats(p);
  if (workspace_floats > 0) {
    workspace = at::empty({workspace_floats}, x.options().dtype(at::kFloat));
    p.workspace = workspace.data_ptr<float>();
  }
  const cudaError_t error = fp8_linear_launch(p, current_stream(x));
  TORCH_CHECK(error == cudaSuccess, op, ": launch failed for M=", p.M, ", N=", p.N, ", K=", p.K, ": ",
              cudaGetErrorString(error));
  return y;
}

at::Tensor fp8_dequantize_packed_cuda(const at::Tensor& packed, const at::Tensor& weight_scale, int64_t out_features,
                                      int64_t in_features, at::IntArrayRef block_size, at::ScalarType dtype) {
  const char* op = "qfp8::_fp8_dequantize_packed_cuda";
  const c10::cuda::CUDAGuard guard(packed.device());
  Fp8LinearProblem p = weight_problem(packed, weight_scale, out_features, in_features, block_size, op);
  p.half_kind = half_kind_of(dtype, op);
  at::Tensor out = at::empty({out_features, in_features}, packed.options().dtype(dtype));
  const cudaError_t error = fp8_dequantize_packed_launch(p, out.data_ptr(), current_stream(packed));
  TORCH_CHECK(error == cudaSuccess, op, ": launch failed for N=", out_features, ", K=", in_features, ": ",
              cudaGetErrorString(error));
  return out;
}

at::Tensor fp8_codes_to_half_bits_cuda(const at::Tensor& codes, at::ScalarType fp8_dtype, at::ScalarType half_dtype) {
  const char* op = "qfp8::_fp8_codes_to_half_bits_cuda";
  const c10::cuda::CUDAGuard guard(codes.device());
  TORCH_CHECK(codes.is_cuda() && codes.scalar_type() == at::kByte && codes.is_contiguous(), op,
              ": codes must be contiguous uint8 on the GPU, got ", codes.scalar_type(), " on ", codes.device());
  at::Tensor out = at::empty(codes.sizes(), codes.options().dtype(at::kShort));
  const cudaError_t error = fp8_codes_to_half_bits_launch(
      codes.data_ptr<uint8_t>(), codes.numel(), fp8_format_of(fp8_dtype, op), half_kind_of(half_dtype, op),
      reinterpret_cast<uint16_t*>(out.data_ptr<int16_t>()), current_stream(codes));
  TORCH_CHECK(error == cudaSuccess, op, ": launch failed: ", cudaGetErrorString(error));
  return out;
}

}  // namespace
}  // namespace qfp8

TORCH_LIBRARY_IMPL(qfp8, CUDA, m) {
  m.impl("_fp8_linear_cuda", &qfp8::fp8_linear_cuda);
  m.impl("_fp8_dequantize_packed_cuda", &qfp8::fp8_dequantize_packed_cuda);
  m.impl("_fp8_codes_to_half_bits_cuda", &qfp8::fp8_codes_to_half_bits_cuda);
}

// The module is empty: importing it runs the registrations above (the
// schemas must already exist: import qfp8.library.cuda first).
#ifndef TORCH_EXTENSION_NAME
#define TORCH_EXTENSION_NAME _C_cuda
#endif
#define QFP8_CONCAT_(a, b) a##b
#define QFP8_CONCAT(a, b) QFP8_CONCAT_(a, b)
#define QFP8_STRINGIFY_(a) #a
#define QFP8_STRINGIFY(a) QFP8_STRINGIFY_(a)

static struct PyModuleDef qfp8_cuda_module = {PyModuleDef_HEAD_INIT, QFP8_STRINGIFY(TORCH_EXTENSION_NAME),
                                              "qfp8 CUDA kernels, registered as torch.ops.qfp8.*", -1, nullptr};

PyMODINIT_FUNC QFP8_CONCAT(PyInit_, TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&qfp8_cuda_module); }
