// CPU ops over the host/device arithmetic of the CUDA kernel
// (qfp8/ext/cuda/fp8_layout.cuh), so that the layout and the FP8 bit
// conversion the GPU kernel relies on are tested on any machine:
//
//   qfp8::cuda_pack_weight_host(Tensor weight) -> Tensor
//       FP8 [N, K] -> packed [ceil(N/32), ceil(K/32), 1024] (same dtype), byte by
//       byte through layout::packed_source: the reference the Python pack
//       (qfp8.library.cuda.pack_weight_cuda, torch permutes) is tested against.
//   qfp8::cuda_unpack_weight_host(Tensor packed, int out_features, int in_features) -> Tensor
//       the inverse, through layout::packed_offset.
//   qfp8::fp8_to_half_bits_host(Tensor codes, ScalarType half_dtype) -> Tensor
//       FP8 codes -> int16 fp16/bf16 bits as the kernel computes them
//       (layout::fp8_to_half_bits: widen the bits, multiply by 2^bias gap).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include "../cuda/fp8_layout.cuh"

namespace qfp8 {
namespace {

namespace L = layout;

int host_fp8_format(at::ScalarType dtype, const char* op) {
  switch (dtype) {
    case at::kFloat8_e4m3fn:
      return L::kE4M3FN;
    case at::kFloat8_e5m2:
      return L::kE5M2;
    case at::kFloat8_e4m3fnuz:
      return L::kE4M3FNUZ;
    default:
      TORCH_CHECK(false, op, ": expected a float8_e4m3fn, float8_e5m2 or float8_e4m3fnuz tensor, got ", dtype);
  }
}

at::Tensor cuda_pack_weight_host(const at::Tensor& weight) {
  const char* op = "qfp8::cuda_pack_weight_host";
  host_fp8_format(weight.scalar_type(), op);
  TORCH_CHECK(weight.dim() == 2 && weight.device().is_cpu(), op, ": weight must be a 2-D CPU tensor [N, K], got ",
              weight.sizes(), " on ", weight.device());
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(N >= 1 && K >= 1, op, ": weight must be non-empty, got [", N, ", ", K, "]");
  const at::Tensor source = weight.contiguous();
  at::Tensor packed = at::empty({L::ceil_div(N, L::kTileN), L::ceil_div(K, L::kTileK), L::kTileBytes},
                                weight.options());
  const uint8_t* w = static_cast<const uint8_t*>(source.data_ptr());
  uint8_t* out = static_cast<uint8_t*>(packed.data_ptr());
  const int64_t tiles = packed.size(0) * packed.size(1);
  at::parallel_for(0, tiles, 16, [&](int64_t begin, int64_t end) {
    for (int64_t offset = begin * L::kTileBytes; offset < end * L::kTileBytes; ++offset) {
      int64_t n, k;
      L::packed_source(offset, K, &n, &k);
      out[offset] = (n < N && k < K) ? w[n * K + k] : 0;
    }
  });
  return packed;
}

at::Tensor cuda_unpack_weight_host(const at::Tensor& packed, int64_t N, int64_t K) {
  const char* op = "qfp8::cuda_unpack_weight_host";
  host_fp8_format(packed.scalar_type(), op);
  TORCH_CHECK(N >= 1 && K >= 1, op, ": out_features and in_features must be >= 1, got ", N, " and ", K);
  TORCH_CHECK(packed.device().is_cpu() && packed.numel() == L::packed_bytes(N, K), op, ": packed has shape ",
              packed.sizes(), ", expected ", L::packed_bytes(N, K), " bytes for out_features=", N,
              ", in_features=", K);
  const at::Tensor source = packed.contiguous();
  at::Tensor weight = at::empty({N, K}, packed.options());
  const uint8_t* p = static_cast<const uint8_t*>(source.data_ptr());
  uint8_t* w = static_cast<uint8_t*>(weight.data_ptr());
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      for (int64_t k = 0; k < K; ++k) w[n * K + k] = p[L::packed_offset(n, k, K)];
  });
  return weight;
}

at::Tensor fp8_to_half_bits_host(const at::Tensor& codes, at::ScalarType half_dtype) {
  const char* op = "qfp8::fp8_to_half_bits_host";
  const int format = host_fp8_format(codes.scalar_type(), op);
  TORCH_CHECK(half_dtype == at::kHalf || half_dtype == at::kBFloat16, op,
              ": half_dtype must be float16 or bfloat16, got ", half_dtype);
  TORCH_CHECK(codes.device().is_cpu(), op, ": codes must be on the CPU, got ", codes.device());
  const int kind = half_dtype == at::kBFloat16 ? L::kBFloat16 : L::kHalf;
  const at::Tensor source = codes.contiguous();
  at::Tensor bits = at::empty(codes.sizes(), codes.options().dtype(at::kShort));
  const uint8_t* c = static_cast<const uint8_t*>(source.data_ptr());
  int16_t* out = bits.data_ptr<int16_t>();
  for (int64_t i = 0; i < codes.numel(); ++i) out[i] = static_cast<int16_t>(L::fp8_to_half_bits(c[i], format, kind));
  return bits;
}

}  // namespace
}  // namespace qfp8

TORCH_LIBRARY_FRAGMENT(qfp8, m) {
  m.def("cuda_pack_weight_host(Tensor weight) -> Tensor");
  m.def("cuda_unpack_weight_host(Tensor packed, int out_features, int in_features) -> Tensor");
  m.def("fp8_to_half_bits_host(Tensor codes, ScalarType half_dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(qfp8, CPU, m) {
  m.impl("cuda_pack_weight_host", &qfp8::cuda_pack_weight_host);
  m.impl("cuda_unpack_weight_host", &qfp8::cuda_unpack_weight_host);
  m.impl("fp8_to_half_bits_host", &qfp8::fp8_to_half_bits_host);
}
