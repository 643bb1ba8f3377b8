// The table of CPU kernel ISAs: which were compiled into this build, which
// the CPU has, the one in use, and each one's linear kernel, preparation
// step and helpers (decode attention, the token-mse grid search, activation
// quantization). Every per-ISA function is reached through this table.
#include <torch/library.h>

#include <atomic>
#include <iterator>
#include <string>
#include <vector>

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#endif

#include "bindings.h"
#include "kernel.h"

namespace qfp8 {
namespace {

#if defined(__x86_64__) || defined(_M_X64)
// __builtin_cpu_supports also checks that the OS saves the vector state.
bool has_avx2() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"); }
bool has_avx512() {
  return has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}
// The bf16 kernel also looks up bytes with vpermt2b (AVX512-VBMI).
bool has_avx512bf16() {
  return has_avx512() && __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vbmi");
}
// AMX-BF16 and AMX-TILE (CPUID 7.0 EDX bits 22 and 24), the tile state
// enabled in XCR0 (bits 17 and 18), and, on Linux, this process granted
// the tile data (arch_prctl ARCH_REQ_XCOMP_PERM, once; kernels before 5.16
// refuse it, and then AMX is not used). Asked only on AVX512-BF16 CPUs.
bool amx_granted() {
#if defined(__linux__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 22) & 1u) || !((d >> 24) & 1u)) return false;
  if (!__get_cpuid(1, &a, &b, &c, &d) || !((c >> 27) & 1u)) return false;  // OSXSAVE
  unsigned lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  if (((lo >> 17) & 3u) != 3u) return false;
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}
bool has_amx() {
  static const bool granted = has_avx512bf16() && amx_granted();
  return granted;
}
#else
bool has_avx2() { return false; }
bool has_avx512() { return false; }
bool has_avx512bf16() { return false; }
bool has_amx() { return false; }
#endif
bool has_scalar() { return true; }

// The helpers come in a scalar and an AVX2 version; every vector ISA uses the
// AVX2 one. The activation helpers also come in an AVX512 version (in the
// avx512bf16 unit), which the avx512bf16 and amx ISAs use, with the row
// helpers that read x as given.
constexpr IsaHelpers kScalarHelpers = {decode_attention_scalar, grid_error_scalar, quantize_row_scalar,
                                       finite_amax_scalar, nullptr, nullptr};
#ifdef QFP8_HAVE_AVX2
constexpr IsaHelpers kAvx2Helpers = {decode_attention_avx2, grid_error_avx2, quantize_row_avx2,
                                     finite_amax_avx2, nullptr, nullptr};
#else
constexpr IsaHelpers kAvx2Helpers = kScalarHelpers;
#endif
#ifdef QFP8_HAVE_AVX512BF16
constexpr IsaHelpers kAvx512Helpers = {kAvx2Helpers.decode_attention, grid_error_avx512bf16,
                                       quantize_row_avx512bf16,          finite_amax_avx512bf16,
                                       finite_amax_row_avx512bf16,       quantize_row_bf16_avx512bf16};
#endif

// Best first. An ISA is usable when it was compiled (the build defines
// QFP8_HAVE_<ISA> only if its translation unit compiled) and the CPU has it.
const IsaEntry kIsas[] = {
#if defined(QFP8_HAVE_AMX) && defined(QFP8_HAVE_AVX512BF16)  // avx512bf16's code for odd block scales
    {"amx", linear_tiles_amx, has_amx, prepare_amx, nullptr, &kAvx512Helpers},
#else
    {"amx", nullptr, has_amx, nullptr, nullptr, &kScalarHelpers},
#endif
#ifdef QFP8_HAVE_AVX512BF16
    {"avx512bf16", linear_tiles_avx512bf16, has_avx512bf16, prepare_avx512bf16, prepare_patches_avx512bf16,
     &kAvx512Helpers, prepared_row_parts_avx512bf16},
#else
    {"avx512bf16", nullptr, has_avx512bf16, nullptr, nullptr, &kScalarHelpers},
#endif
#ifdef QFP8_HAVE_AVX512
    {"avx512", linear_tiles_avx512, has_avx512, nullptr, nullptr, &kAvx2Helpers},
#else
    {"avx512", nullptr, has_avx512, nullptr, nullptr, &kScalarHelpers},
#endif
#ifdef QFP8_HAVE_AVX2
    {"avx2", linear_tiles_avx2, has_avx2, nullptr, nullptr, &kAvx2Helpers},
#else
    {"avx2", nullptr, has_avx2, nullptr, nullptr, &kScalarHelpers},
#endif
    {"scalar", linear_tiles_scalar, has_scalar, nullptr, nullptr, &kScalarHelpers},
};

// Never dispatched to: the AVX512 kernel's code on AVX2, which the tests
// select by name (see kernel_avx512emu.cpp). Not in kIsas, so neither the
// automatic choice nor usable_isas() / compiled_isas() ever name it.
#ifdef QFP8_HAVE_AVX512EMU
const IsaEntry kAvx512Emulated = {"avx512emu", linear_tiles_avx512emu, has_avx2, nullptr, nullptr, &kAvx2Helpers};
#else
const IsaEntry kAvx512Emulated = {"avx512emu", nullptr, has_avx2, nullptr, nullptr, &kScalarHelpers};
#endif

const IsaEntry* best_isa() {
  for (const auto& isa : kIsas)
    if (isa.fn && isa.cpu_has()) return &isa;
  return &kIsas[std::size(kIsas) - 1];  // scalar
}

std::atomic<const IsaEntry*> g_isa{nullptr};

std::vector<std::string> usable_isas() {
  std::vector<std::string> names;
  for (const auto& isa : kIsas)
    if (isa.fn && isa.cpu_has()) names.emplace_back(isa.name);
  return names;
}

std::vector<std::string> compiled_isas() {
  std::vector<std::string> names;
  for (const auto& isa : kIsas)
    if (isa.fn) names.emplace_back(isa.name);
  return names;
}

std::vector<std::string> emulated_isas() {
  std::vector<std::string> names;
  if (kAvx512Emulated.fn && kAvx512Emulated.cpu_has()) names.emplace_back(kAvx512Emulated.name);
  return names;
}

const IsaEntry* isa_named(c10::string_view name) {
  for (const auto& isa : kIsas)
    if (name == isa.name) return &isa;
  return name == kAvx512Emulated.name ? &kAvx512Emulated : nullptr;
}

void set_isa(c10::string_view name) {
  const IsaEntry* isa = isa_named(name);
  TORCH_CHECK(isa, "qfp8: unknown CPU kernel ISA '", std::string(name), "'; expected amx, avx512bf16, avx512, avx2 or scalar");
  TORCH_CHECK(isa->fn, "qfp8: CPU kernel ISA '", std::string(name), "' was not compiled into this build");
  TORCH_CHECK(isa->cpu_has(), "qfp8: this CPU does not support the '", std::string(name), "' kernel");
  g_isa.store(isa);
}

std::string get_isa() { return current_isa().name; }

}  // namespace

const IsaEntry& current_isa() {
  const IsaEntry* isa = g_isa.load(std::memory_order_relaxed);
  if (!isa) {
    isa = best_isa();
    g_isa.store(isa);
  }
  return *isa;
}

DecodeAttentionFn decode_attention_for_current_isa() { return current_isa().helpers->decode_attention; }

}  // namespace qfp8

// Private helpers; the public schemas live in qfp8/library/cpu.py.
TORCH_LIBRARY_FRAGMENT(qfp8, m) {
  m.def("_cpu_usable_isas() -> str[]", &qfp8::usable_isas);
  m.def("_cpu_compiled_isas() -> str[]", &qfp8::compiled_isas);
  m.def("_cpu_emulated_isas() -> str[]", &qfp8::emulated_isas);
  m.def("_cpu_set_isa(str isa) -> ()", &qfp8::set_isa);
  m.def("_cpu_get_isa() -> str", &qfp8::get_isa);
}
