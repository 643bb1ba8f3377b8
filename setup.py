"""Builds qfp8._C, the CPU kernels, with torch's C++ extension tooling (ninja).

Sources are every ``qfp8/ext/cpu/*.cpp``. Files named ``kernel_<isa>.cpp`` for
an ISA of ``ISA_FLAGS`` are compiled first, each with its own ``-m`` flags, and
only on x86-64; an ISA whose file does not compile (an old compiler) is left
out with a warning, and the bindings learn which ISAs exist through
``QFP8_HAVE_<ISA>`` macros. Every other file (the bindings, the scalar kernel,
``cuda_host_*.cpp``) is compiled with the default flags. Which ISA runs
is decided at run time from the CPU's features. When torch has CUDA (and
nvcc is found), ``qfp8._C_cuda`` is built too from ``qfp8/ext/cuda``.

    pip install --no-build-isolation -e .
"""

from __future__ import annotations

import glob
import os
import platform
import sys
import warnings

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))
CPU_DIR = os.path.join("qfp8", "ext", "cpu")

# Flags per ISA translation unit; the bindings never get these flags, so the
# library loads on any x86-64 and picks a variant the CPU supports.
AVX512_FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"]
ISA_FLAGS = {
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "avx512": AVX512_FLAGS,
    "avx512bf16": AVX512_FLAGS + ["-mavx512bf16", "-mavx512vbmi"],
    "amx": AVX512_FLAGS + ["-mavx512bf16", "-mavx512vbmi", "-mamx-tile", "-mamx-bf16"],
    # The AVX512 kernel's code with its 512-bit intrinsics done on two 256-bit
    # halves, so the tests run it on CPUs without AVX512 (kernel_avx512emu.cpp).
    "avx512emu": ["-mavx2", "-mfma", "-mf16c"],
}
COMMON_FLAGS = ["-O3", "-std=c++17", "-fno-math-errno"]
OPENMP_FLAGS = [] if sys.platform == "darwin" else ["-fopenmp"]


def is_x86_64() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "x64")


def isa_of(path: str) -> str | None:
    name = os.path.splitext(os.path.basename(path))[0]
    isa = name[len("kernel_") :] if name.startswith("kernel_") else None
    return isa if isa in ISA_FLAGS else None


def extension_modules():
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    class BuildWithIsaFlags(BuildExtension):
        """Compiles the ISA translation units with their flags, then the rest."""

        def build_extension(self, ext):
            isa_sources = getattr(ext, "isa_sources", {})
            for isa, source in isa_sources.items():
                try:
                    objects = self.compiler.compile(
                        [source],
                        output_dir=self.build_temp,
                        include_dirs=ext.include_dirs,
                        extra_postargs=COMMON_FLAGS + ["-fPIC", "-Wno-maybe-uninitialized"] + ISA_FLAGS[isa],
                    )
                except Exception as error:  # a compiler without this ISA: build the others
                    warnings.warn(f"qfp8: the {isa} kernel did not compile and is left out: {error}", stacklevel=1)
                    continue
                ext.extra_objects.extend(objects)
                ext.define_macros.append((f"QFP8_HAVE_{isa.upper()}", "1"))
            super().build_extension(ext)

    sources = sorted(glob.glob(os.path.join(CPU_DIR, "*.cpp")))
    isa_sources = {}
    plain_sources = []
    for source in sources:
        isa = isa_of(source)
        if isa is None:
            plain_sources.append(source)
        elif is_x86_64() and sys.platform != "win32":
            isa_sources[isa] = source
    ext = CppExtension(
        name="qfp8._C",
        sources=plain_sources,
        include_dirs=[os.path.join(ROOT, CPU_DIR)],
        # at::parallel_for is inline OpenMP code: without -fopenmp it runs on one thread.
        # The extension then shares the libgomp.so.1 that torch has already loaded.
        extra_compile_args={"cxx": COMMON_FLAGS + OPENMP_FLAGS},
        extra_link_args=OPENMP_FLAGS,
    )
    ext.isa_sources = isa_sources
    return [ext, *cuda_extension_modules()], {"build_ext": BuildWithIsaFlags.with_options(use_ninja=True)}


CUDA_DIR = os.path.join("qfp8", "ext", "cuda")
# sm80/86 (weight-only kernel only), sm89 and sm90 (also _scaled_mm, which is torch's);
# TORCH_CUDA_ARCH_LIST, when set, replaces this list.
CUDA_ARCHES = ("80", "86", "89", "90")


def cuda_extension_modules():
    """qfp8._C_cuda (qfp8/ext/cuda: the .cu kernels + binding.cpp), only when torch has CUDA and nvcc exists."""
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, CUDAExtension

    if torch.version.cuda is None or CUDA_HOME is None or os.environ.get("QFP8_NO_CUDA_EXTENSION", "") == "1":
        return []
    nvcc_flags = ["-O3", "-std=c++17"]
    if not os.environ.get("TORCH_CUDA_ARCH_LIST"):
        nvcc_flags += [f"-gencode=arch=compute_{a},code=sm_{a}" for a in CUDA_ARCHES]
    sources = sorted(glob.glob(os.path.join(CUDA_DIR, "*.cu"))) + [os.path.join(CUDA_DIR, "binding.cpp")]
    return [
        CUDAExtension(
            name="qfp8._C_cuda",
            sources=sources,
            include_dirs=[os.path.join(ROOT, CUDA_DIR)],
            extra_compile_args={"cxx": COMMON_FLAGS, "nvcc": nvcc_flags},
        )
    ]


def main():
    ext_modules, cmdclass = [], {}
    if os.environ.get("QFP8_NO_EXTENSION", "") != "1":
        ext_modules, cmdclass = extension_modules()
    setup(ext_modules=ext_modules, cmdclass=cmdclass)


if __name__ == "__main__":
    main()
