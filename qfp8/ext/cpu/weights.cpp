// Helpers on FP8 weights: the format of an FP8 dtype, a huge-page byte
// buffer for a packed weight, and the scan for NaN/Inf codes a checkpoint's
// weights get on load.
#include <ATen/core/Tensor.h>
#include <ATen/ops/from_blob.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>

#include "bindings.h"
#include "kernel.h"

namespace qfp8 {

int fp8_format(c10::ScalarType dtype, const char* what) {
  switch (dtype) {
    case at::kFloat8_e4m3fn:
      return kE4M3FN;
    case at::kFloat8_e5m2:
      return kE5M2;
    case at::kFloat8_e4m3fnuz:
      return kE4M3FNUZ;
    default:
      TORCH_CHECK(false, what, " must be float8_e4m3fn, float8_e5m2 or float8_e4m3fnuz, got ", dtype);
  }
}

namespace {

// A byte buffer for a packed weight (huge_page_alloc). A matrix-vector product
// streams the whole weight once per call; with 4 KiB pages every page costs a
// TLB miss and the hardware prefetchers stop at each page boundary. Only the
// whole 2 MiB pages are advised, so the tail never faults in a page past the
// data. Where THP is disabled the advice is ignored and the buffer is an
// ordinary aligned allocation.
at::Tensor empty_hugepage(int64_t nbytes) {
  TORCH_CHECK(nbytes >= 0, "qfp8::_cpu_empty_hugepage: nbytes must be non-negative, got ", nbytes);
  void* data = huge_page_alloc(static_cast<size_t>(nbytes));
  TORCH_CHECK(data != nullptr, "qfp8::_cpu_empty_hugepage: could not allocate ", nbytes, " bytes");
  return at::from_blob(data, {nbytes}, [](void* p) { std::free(p); }, at::TensorOptions().dtype(at::kByte));
}

// Flat index of the first NaN/Inf code of an FP8 tensor, or -1: e4m3fn
// codes 0x7F/0xFF are NaN, e5m2 codes with all exponent bits set are Inf or
// NaN, e4m3fnuz code 0x80 is NaN. A checkpoint's weights are scanned on load,
// so the scan runs at memory speed: each 64 KiB block is first tested as a
// whole (a loop the compiler vectorizes), and only a block that holds such a
// code is searched for its position.
int64_t fp8_first_nonfinite(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu(), "qfp8::_cpu_fp8_first_nonfinite: the tensor must be on the CPU, got ",
              weight.device());
  const int format = fp8_format(weight.scalar_type(), "qfp8::_cpu_fp8_first_nonfinite: the tensor");
  const at::Tensor w = weight.contiguous();
  const uint8_t* bytes = static_cast<const uint8_t*>(w.data_ptr());
  const int64_t n = w.numel();
  const uint8_t mask = format == kE4M3FN ? 0x7F : (format == kE5M2 ? 0x7C : 0xFF);
  const uint8_t code = format == kE4M3FN ? 0x7F : (format == kE5M2 ? 0x7C : 0x80);
  constexpr int64_t kBlock = int64_t{1} << 16;
  for (int64_t start = 0; start < n; start += kBlock) {
    const int64_t end = std::min(n, start + kBlock);
    uint8_t found = 0;
    for (int64_t i = start; i < end; ++i) found |= static_cast<uint8_t>((bytes[i] & mask) == code);
    if (!found) continue;
    for (int64_t i = start; i < end; ++i)
      if ((bytes[i] & mask) == code) return i;
  }
  return -1;
}

}  // namespace
}  // namespace qfp8

TORCH_LIBRARY_FRAGMENT(qfp8, m) {
  m.def("_cpu_empty_hugepage(int nbytes) -> Tensor", &qfp8::empty_hugepage);
  m.def("_cpu_fp8_first_nonfinite(Tensor weight) -> int", &qfp8::fp8_first_nonfinite);
}
