"""Compile-only check of the CUDA sources, for machines without a GPU.

``nvcc -c`` of ``qfp8/ext/cuda/fp8_linear.cu`` for sm_80 and sm_90 (every
instantiated kernel configuration, no torch headers needed), so that a
syntax or template error cannot land; ptxas must report no register spills.
The torch binding (``binding.cpp``) is syntax-checked with the host compiler
against torch's headers when they include the CUDA ones. About 30-60 s on
two shared cores.
"""

import os
import re
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
import torch
import torch.utils.cpp_extension

ROOT = Path(__file__).resolve().parents[2]
CUDA_DIR = ROOT / "qfp8" / "ext" / "cuda"
ARCHES = ("80", "90")


def find_nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and (Path(home) / "bin" / "nvcc").exists():
            return str(Path(home) / "bin" / "nvcc")
    return None


NVCC = find_nvcc()
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc is not installed (set CUDA_HOME); nothing to compile with")


def cuda_include_dir() -> Path | None:
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    candidates = [Path(home) / "include" for home in homes if home]
    if NVCC:  # nvcc may be a wrapper script; ask it where its headers are
        candidates.append(Path(NVCC).resolve().parents[1] / "include")
        dryrun = subprocess.run([NVCC, "--dryrun", "--version"], capture_output=True, text=True, timeout=60)
        candidates += [Path(path) for path in re.findall(r"-I\"?([^\s\"]+)", dryrun.stderr)]
    return next((path for path in candidates if (path / "cuda_runtime.h").exists()), None)


def nice(command: list[str]) -> list[str]:
    return (["nice", "-n", "10"] if shutil.which("nice") else []) + command


@needs_nvcc
def test_kernel_compiles_for_sm80_and_sm90(tmp_path):
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in ARCHES]
    command = [NVCC, "-c", "-std=c++17", "-O1", "--threads", "2", "-Xptxas", "-v", "-Werror", "all-warnings"]
    command += [*gencode, str(CUDA_DIR / "fp8_linear.cu"), "-o", str(tmp_path / "fp8_linear.o")]
    result = subprocess.run(nice(command), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{' '.join(command)}\n{result.stdout}\n{result.stderr}"
    report = result.stdout + result.stderr
    entries = re.findall(r"Compiling entry function '(\w+)' for 'sm_(\d+)'", report)
    linear = {(name, arch) for name, arch in entries if "fp8_linear_kernel" in name}
    assert len(linear) == 6 * len(ARCHES), sorted(linear)  # 3 configurations x fp16/bf16 per arch
    spills = [
        line for line in report.splitlines() if "spill" in line and not re.search(r"\b0 bytes spill stores", line)
    ]
    assert not spills, "\n".join(spills)


@pytest.mark.skipif(
    not (Path(torch.utils.cpp_extension.include_paths()[0]) / "c10" / "cuda" / "CUDAStream.h").exists(),
    reason="this torch ships no c10/cuda headers to check the binding against",
)
@needs_nvcc
def test_binding_is_valid_cpp(tmp_path):
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no host C++ compiler (c++ or g++) to syntax-check the binding")
    cuda_include = cuda_include_dir()
    if cuda_include is None:
        pytest.skip("cuda_runtime.h not found next to nvcc, in CUDA_HOME or /usr/local/cuda")
    # CPU builds of torch omit this generated header; its one macro only matters when linking.
    stub = tmp_path / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
    stub.parent.mkdir(parents=True)
    stub.write_text("#pragma once\n")
    includes = [str(tmp_path), *torch.utils.cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    command = [cxx, "-std=c++17", "-fsyntax-only", "-DTORCH_EXTENSION_NAME=_C_cuda", f"-I{cuda_include}"]
    command += [f"-I{path}" for path in includes] + [str(CUDA_DIR / "binding.cpp")]
    result = subprocess.run(nice(command), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{' '.join(command)}\n{result.stderr[-4000:]}"
