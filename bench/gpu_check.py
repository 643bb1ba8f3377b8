"""The one prepared check for a lent GPU: correctness of every CUDA route, then timings.

Run on a CUDA machine (under 8 minutes on an H100/H200; ``--budget-s``
stops the timings early if the build was slow):

    python bench/gpu_check.py --json bench/results/gpu_check-<gpu>.json

1. Builds ``qfp8/ext/cuda`` (kernel + binding) for this GPU's architecture
   with ``torch.utils.cpp_extension.load`` (unless ``qfp8._C_cuda`` is
   installed), and turns the qfp8 CUDA routes on (``QFP8_CUDA_KERNELS=1``).
2. Correctness against the reference op (``torch.ops.qfp8.scaled_linear``):
   the device FP8 -> fp16/bf16 conversion of all 256 codes of each FP8 dtype
   against the host one; pack on the GPU against the host pack; the
   weight-only kernel (``scaled_linear_cuda``: every tile configuration, the
   K split, the large-M dequantize + cuBLAS path, odd K and N, 8192/28672
   sizes, tensor/channel/block scales, all FP8 dtypes, bias, W8A8 via
   quantize-dequantize); ``_scaled_mm`` (tensorwise and rowwise, aligned and
   padded shapes); ``QLinear`` routing end to end. A route passes when its
   error ``mean|y - ref| / mean|ref|`` is within ``ERROR_FACTOR`` times that of
   the same product done by cuBLAS in bf16 (``bf16_error``), plus a floor.
3. Timings (CUDA events, medians, interleaved with the baselines): M in
   1, 16, 64, 256, 4096 on (K, N) = (8192, 8192), (8192, 28672), (28672, 8192):
   cuBLAS fp16 and bf16 ``F.linear``, the weight-only route (fp16, bf16), and
   ``_scaled_mm`` W8A8 (rowwise per-token x per-channel, and tensorwise) on
   sm89+; ratios = baseline time / route time (> 1: faster than cuBLAS).

Exit status 0 only if every correctness check passed. ``--cpu-dry-run``
(also ``--quick``) runs here without a GPU: argument parsing, the shape lists,
and the same correctness code on tiny shapes on the CPU (the reference route,
``_scaled_mm`` on CPU and the emulated weight-only kernel); CI runs it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import qfp8  # noqa: E402
from qfp8 import formats  # noqa: E402
from qfp8.library import cuda as cuda_routes  # noqa: E402

TIMING_MS = (1, 16, 64, 256, 4096)
TIMING_SHAPES = ((8192, 8192), (8192, 28672), (28672, 8192))  # (K, N)
ERROR_FACTOR = 2.0  # a route may be this much worse than cuBLAS bf16 on the same product
ERROR_FLOOR = 2e-3  # and always passes below this relative error
# Weight-only correctness: (M, N, K). Every M tile configuration (1, 2, 4 MMA
# tiles), split and unsplit K, the large-M path, odd N and K.
WEIGHT_ONLY_SHAPES = [
    (1, 8192, 8192),
    (7, 4104, 4101),
    (16, 28672, 8192),
    (17, 8192, 28672),
    (33, 37, 70),
    (64, 96, 64),
    (100, 1000, 2056),
    (256, 8192, 8192),
    (cuda_routes.LARGE_M, 8192, 8192),
    (3, 1, 8),
]
SCALED_MM_SHAPES = [(1, 8192, 8192), (64, 28672, 8192), (256, 4100, 4101), (4096, 8192, 8192), (5, 37, 70)]
DRY_RUN_WEIGHT_ONLY_SHAPES = [(1, 40, 64), (7, 37, 70), (17, 64, 96), (cuda_routes.LARGE_M, 40, 64)]
DRY_RUN_SCALED_MM_SHAPES = [(1, 48, 64), (5, 37, 70)]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--cpu-dry-run", action="store_true", help="no GPU: tiny shapes on the CPU, no timings")
    parser.add_argument("--quick", action="store_true", help="same as --cpu-dry-run (what CI runs)")
    parser.add_argument("--budget-s", type=float, default=420.0, help="skip remaining timings after this long")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per measurement")
    parser.add_argument("--no-timings", action="store_true")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile check")
    parser.add_argument("--build-dir", type=Path, default=None, help="where the CUDA extension is built")
    args = parser.parse_args(argv)
    args.cpu_dry_run = args.cpu_dry_run or args.quick
    return args


# ------------------------------------------------------------------ setup


def build_extension(build_dir: Path | None) -> dict:
    """Loads qfp8._C_cuda, or builds the kernel for this GPU; returns what happened."""
    start = time.perf_counter()
    if cuda_routes.load_cuda_extension():
        return {"built": False, "source": "qfp8._C_cuda", "seconds": time.perf_counter() - start}
    from torch.utils.cpp_extension import load

    major, minor = torch.cuda.get_device_capability()
    cuda_dir = ROOT / "qfp8" / "ext" / "cuda"
    build_dir = build_dir or Path(os.environ.get("TMPDIR", "/tmp")) / "qfp8_gpu_check_build"
    build_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 4))
    load(
        name="qfp8_cuda_gpu_check",
        sources=[str(cuda_dir / "fp8_linear.cu"), str(cuda_dir / "binding.cpp")],
        extra_cflags=["-O3", "-std=c++17"],
        extra_cuda_cflags=["-O3", "-std=c++17", f"-gencode=arch=compute_{major}{minor},code=sm_{major}{minor}"],
        extra_include_paths=[str(cuda_dir)],
        build_directory=str(build_dir),
        is_python_module=False,
        verbose=False,
    )
    if not cuda_routes.cuda_extension_loaded():
        raise RuntimeError("the CUDA extension was built but registered no CUDA kernel for qfp8::_fp8_linear_cuda")
    return {"built": True, "source": str(build_dir), "seconds": time.perf_counter() - start}


# ------------------------------------------------------------ correctness


def relative_error(reference: torch.Tensor, y: torch.Tensor) -> float:
    ref = reference.to(torch.float64)
    return float((y.to(torch.float64) - ref).abs().mean() / ref.abs().mean().clamp(min=1e-30))


def bf16_error(x: torch.Tensor, q: torch.Tensor, scale, block, bias, reference: torch.Tensor, activation="none"):
    """Error of the same product by cuBLAS in bf16 (dequantized bf16 weights and activations)."""
    x2d = x.reshape(-1, x.shape[-1])
    values = formats.dequantize_weight(q, scale, block or None, torch.bfloat16)
    if activation != "none":
        x2d = qfp8.library.ops.reference_activation(x2d, activation, torch.float8_e4m3fn, None)
    y = F.linear(x2d.to(torch.bfloat16), values, None if bias is None else bias.to(torch.bfloat16))
    return relative_error(reference.reshape(y.shape), y)


class Checks:
    def __init__(self):
        self.rows: list[dict] = []

    def record(self, route: str, case: str, error: float, limit: float, extra: dict | None = None) -> None:
        passed = bool(error <= limit) and math.isfinite(error)
        self.rows.append(
            {"route": route, "case": case, "error": error, "limit": limit, "passed": passed, **(extra or {})}
        )
        print(f"  {'ok  ' if passed else 'FAIL'} {route:<24} {case:<58} err {error:.2e} (limit {limit:.2e})")

    def fail(self, route: str, case: str, error: BaseException) -> None:
        self.rows.append({"route": route, "case": case, "passed": False, "exception": repr(error)})
        print(f"  FAIL {route:<24} {case:<58} {error!r}")
        traceback.print_exc(limit=3)

    @property
    def passed(self) -> bool:
        return all(row["passed"] for row in self.rows)


def short(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "").replace("float8_", "")


def check_conversion(checks: Checks, device: torch.device) -> None:
    if device.type == "cpu" and not hasattr(torch.ops.qfp8, "fp8_to_half_bits_host"):
        print("  (qfp8._C has no fp8_to_half_bits_host: conversion not checked on the CPU)")
        return
    for fp8 in formats.FP8_DTYPES.values():
        codes = torch.arange(256, dtype=torch.uint8)
        finite = torch.isfinite(codes.view(fp8).to(torch.float32))
        for half in (torch.float16, torch.bfloat16):
            case = f"{short(fp8)} -> {short(half)}, 256 codes"
            try:
                expected = codes.view(fp8).to(half).view(torch.int16)
                if hasattr(torch.ops.qfp8, "fp8_to_half_bits_host"):
                    host = torch.ops.qfp8.fp8_to_half_bits_host(codes.view(fp8), half)
                    if not torch.equal(host, expected.where(finite, host)):
                        raise AssertionError("host conversion differs from torch's on finite codes")
                if device.type == "cuda":
                    got = torch.ops.qfp8._fp8_codes_to_half_bits_cuda(codes.to(device), fp8, half).cpu()
                else:
                    got = torch.ops.qfp8.fp8_to_half_bits_host(codes.view(fp8), half)
                wrong = int(((got != expected) & finite).sum())
                checks.record("fp8-conversion", case, float(wrong), 0.0)
            except Exception as error:  # noqa: BLE001  (recorded as a failure; the other checks still run)
                checks.fail("fp8-conversion", case, error)


def check_pack(checks: Checks, device: torch.device) -> None:
    for n, k in ((37, 70), (4104, 4101)):
        case = f"pack {n}x{k}"
        try:
            q = torch.randn(n, k).to(torch.float8_e4m3fn)
            packed = cuda_routes.pack_weight_cuda(q.to(device)).cpu()
            mismatches = 0.0
            if hasattr(torch.ops.qfp8, "cuda_pack_weight_host"):
                host = torch.ops.qfp8.cuda_pack_weight_host(q)
                mismatches += float((host.view(torch.uint8) != packed.view(torch.uint8)).sum())
            back = cuda_routes.unpack_weight_cuda(packed.to(device), n, k).cpu()
            mismatches += float((back.view(torch.uint8) != q.view(torch.uint8)).sum())
            checks.record("pack", case, mismatches, 0.0)
        except Exception as error:  # noqa: BLE001
            checks.fail("pack", case, error)


def weight_only_cases(shapes):
    """(M, N, K, fp8, granularity, block, x dtype, bias, activation): a spread, not the full product."""
    fp8s = list(formats.FP8_DTYPES.values())
    grans = [("channel", ()), ("tensor", ()), ("block", (128, 128))]
    for i, (m, n, k) in enumerate(shapes):
        granularity, block = grans[i % 3]
        yield (m, n, k, fp8s[i % 3], granularity, block, (torch.bfloat16, torch.float16)[i % 2], i % 2 == 0, "none")
    m, n, k = shapes[1]
    yield (m, n, k, torch.float8_e4m3fn, "channel", (), torch.bfloat16, True, "token")  # W8A8 on the kernel
    yield (m, n, k, torch.float8_e4m3fn, "block", (128, 128), torch.float16, False, "group")


def check_weight_only(checks: Checks, device: torch.device, shapes) -> None:
    route = "weight-only" if device.type == "cuda" else "weight-only(emulated)"
    for m, n, k, fp8, granularity, block, xdtype, with_bias, activation in weight_only_cases(shapes):
        case = f"M={m} N={n} K={k} {short(fp8)} {granularity} {short(xdtype)}{' bias' if with_bias else ''}"
        case += f" a={activation}" if activation != "none" else ""
        try:
            q, scale = formats.quantize_weight(torch.randn(n, k, device=device) * 0.05, fp8, granularity, block or None)
            x = torch.randn(m, k, device=device).to(xdtype)
            bias = torch.randn(n, device=device) if with_bias else None
            packed = cuda_routes.pack_weight_cuda(q)
            args = (packed, scale, bias, None, n, k, list(block), activation, torch.float8_e4m3fn)
            y = torch.ops.qfp8.scaled_linear_cuda(x, *args)
            reference = torch.ops.qfp8.scaled_linear(
                x.float(), q, scale, bias, None, list(block), activation, torch.float8_e4m3fn
            )
            baseline = bf16_error(x, q, scale, block, bias, reference, activation)
            checks.record(
                route,
                case,
                relative_error(reference, y),
                max(ERROR_FACTOR * baseline, ERROR_FLOOR),
                {"bf16_error": baseline},
            )
        except Exception as error:  # noqa: BLE001
            checks.fail(route, case, error)


def check_scaled_mm(checks: Checks, device: torch.device, shapes) -> None:
    combos = [("token", "channel"), ("tensor", "tensor"), ("static", "channel"), ("token", "tensor")]
    for i, (m, n, k) in enumerate(shapes):
        activation, granularity = combos[i % len(combos)]
        xdtype = (torch.bfloat16, torch.float16)[i % 2]
        case = f"M={m} N={n} K={k} a={activation} w={granularity} {short(xdtype)}"
        try:
            q, scale = formats.quantize_weight(
                torch.randn(n, k, device=device) * 0.05, torch.float8_e4m3fn, granularity
            )
            x = torch.randn(m, k, device=device).to(xdtype)
            input_scale = formats.scale_from_amax(x.abs().amax().reshape(1), torch.float8_e4m3fn)
            input_scale = input_scale if activation == "static" else None
            bias = torch.randn(n, device=device).to(xdtype)
            packed = cuda_routes.pack_weight_scaled_mm(q)
            y = torch.ops.qfp8.scaled_mm_linear(
                x, packed, scale, bias, input_scale, n, k, activation, torch.float8_e4m3fn
            )
            reference = torch.ops.qfp8.scaled_linear(
                x.float(), q, scale, bias, input_scale, [], activation, torch.float8_e4m3fn
            )
            # Same FP8 products as the reference: only the output rounding differs.
            values = formats.dequantize_weight(q, scale, None, torch.bfloat16)
            xq = qfp8.library.ops.reference_activation(x.reshape(-1, k), activation, torch.float8_e4m3fn, input_scale)
            baseline = relative_error(reference, F.linear(xq.to(torch.bfloat16), values, bias.to(torch.bfloat16)))
            checks.record(
                "scaled-mm",
                case,
                relative_error(reference, y),
                max(ERROR_FACTOR * baseline, ERROR_FLOOR),
                {"bf16_error": baseline},
            )
        except Exception as error:  # noqa: BLE001
            checks.fail("scaled-mm", case, error)


def check_qlinear(checks: Checks, device: torch.device, compile_check: bool) -> None:
    """quantize() on the device: the kernel each scheme gets, and its output against QFP8_KERNEL=reference."""
    schemes = [
        ("w8a16-channel", {"weight_scale": "channel"}),
        ("w8a16-block", {"weight_scale": "block"}),
        ("w8a8-token", {"weight_scale": "channel", "activations": "dynamic", "activation_scale": "token"}),
        ("w8a8-tensor", {"weight_scale": "tensor", "activations": "dynamic", "activation_scale": "tensor"}),
    ]
    for name, kwargs in schemes:
        case = f"QLinear {name} 2x[256->200->256]"
        try:
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(256, 200), torch.nn.Linear(200, 256)).to(device, torch.bfloat16)
            x = torch.randn(4, 256, device=device, dtype=torch.bfloat16)
            os.environ["QFP8_KERNEL"] = "reference"
            reference_model, _ = qfp8.quantize(__import__("copy").deepcopy(model), exclude=(), **kwargs)
            reference = reference_model(x)
            del os.environ["QFP8_KERNEL"]
            quantized, _ = qfp8.quantize(model, exclude=(), **kwargs)
            kernels = sorted({m.packing for m in quantized.modules() if hasattr(m, "packing")})
            y = quantized(x)
            if compile_check and name == "w8a16-channel":
                compiled = torch.compile(quantized, fullgraph=True)
                checks.record("qlinear-compile", case, relative_error(y, compiled(x)), ERROR_FLOOR)
            checks.record(
                f"qlinear[{','.join(kernels)}]", case, relative_error(reference, y), 2e-2, {"kernels": kernels}
            )
        except Exception as error:  # noqa: BLE001
            os.environ.pop("QFP8_KERNEL", None)
            checks.fail("qlinear", case, error)


# ----------------------------------------------------------------- timing


def median_ms(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def timings(device: torch.device, repeats: int, deadline: float) -> list[dict]:
    capability = torch.cuda.get_device_capability(device)
    rows = []
    print(f"\n{'K':>6} {'N':>6} {'M':>5}  {'route':<26} {'ms':>8} {'vs fp16':>8} {'vs bf16':>8}")
    for k, n in TIMING_SHAPES:
        q, scale = formats.quantize_weight(torch.randn(n, k, device=device) * 0.05, torch.float8_e4m3fn, "channel")
        packed = cuda_routes.pack_weight_cuda(q)
        mm_weight = cuda_routes.pack_weight_scaled_mm(q)
        _, tensor_scale = formats.quantize_weight(torch.randn(16, 16, device=device), torch.float8_e4m3fn, "tensor")
        w16 = formats.dequantize_weight(q, scale, None, torch.float16)
        wbf = w16.to(torch.bfloat16)
        for m in TIMING_MS:
            if time.perf_counter() > deadline:
                print("  time budget spent: remaining timings skipped")
                return rows
            x16 = torch.randn(m, k, device=device, dtype=torch.float16)
            xbf = x16.to(torch.bfloat16)
            linear_cuda = torch.ops.qfp8.scaled_linear_cuda
            scaled_mm = torch.ops.qfp8.scaled_mm_linear
            e4m3 = torch.float8_e4m3fn
            routes = {
                "cublas-fp16": partial(F.linear, x16, w16),
                "cublas-bf16": partial(F.linear, xbf, wbf),
                "weight-only-fp16": partial(linear_cuda, x16, packed, scale, None, None, n, k, [], "none", e4m3),
                "weight-only-bf16": partial(linear_cuda, xbf, packed, scale, None, None, n, k, [], "none", e4m3),
            }
            if capability >= cuda_routes.SCALED_MM_MIN_CAPABILITY:
                routes["scaled-mm-tensorwise-bf16"] = partial(
                    scaled_mm, xbf, mm_weight, tensor_scale, None, None, n, k, "tensor", e4m3
                )
                if capability >= cuda_routes.ROWWISE_MIN_CAPABILITY:
                    routes["scaled-mm-rowwise-bf16"] = partial(
                        scaled_mm, xbf, mm_weight, scale, None, None, n, k, "token", e4m3
                    )
            results = {name: [] for name in routes}
            for _ in range(3):  # interleaved rounds; the median of the round medians is reported
                for name, fn in routes.items():
                    try:
                        results[name].append(median_ms(fn, repeats))
                    except Exception as error:  # noqa: BLE001
                        results[name].append(float("nan"))
                        print(f"  {name} failed at M={m}: {error!r}")
            medians = {name: statistics.median(values) for name, values in results.items()}
            for name, ms in medians.items():
                row = {
                    "K": k,
                    "N": n,
                    "M": m,
                    "route": name,
                    "ms": ms,
                    "speedup_vs_cublas_fp16": medians["cublas-fp16"] / ms,
                    "speedup_vs_cublas_bf16": medians["cublas-bf16"] / ms,
                }
                rows.append(row)
                print(
                    f"{k:>6} {n:>6} {m:>5}  {name:<26} {ms:8.4f} {row['speedup_vs_cublas_fp16']:8.2f}x "
                    f"{row['speedup_vs_cublas_bf16']:8.2f}x"
                )
    return rows


# ------------------------------------------------------------------- main


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    result = {
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "python": platform.python_version(),
        "mode": "cpu-dry-run" if args.cpu_dry_run else "gpu",
        "timing_ms": list(TIMING_MS),
        "timing_shapes_kn": [list(s) for s in TIMING_SHAPES],
    }
    checks = Checks()
    if args.cpu_dry_run:
        device = torch.device("cpu")
        weight_only_shapes, scaled_mm_shapes = DRY_RUN_WEIGHT_ONLY_SHAPES, DRY_RUN_SCALED_MM_SHAPES
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: run with --cpu-dry-run on a machine without a GPU", file=sys.stderr)
            return 2
        device = torch.device("cuda")
        result["device"] = torch.cuda.get_device_name(device)
        result["capability"] = list(torch.cuda.get_device_capability(device))
        weight_only_shapes, scaled_mm_shapes = WEIGHT_ONLY_SHAPES, SCALED_MM_SHAPES
        os.environ[cuda_routes.CUDA_KERNELS_ENV] = "1"
        try:
            result["extension"] = build_extension(args.build_dir)
            print(f"CUDA extension: {result['extension']}")
        except Exception as error:  # noqa: BLE001
            checks.fail("build", "qfp8/ext/cuda with torch.utils.cpp_extension.load", error)
    print(f"correctness on {result.get('device', 'cpu')} ({result['mode']})")
    check_conversion(checks, device)
    check_pack(checks, device)
    if device.type == "cpu" or cuda_routes.cuda_extension_loaded():
        check_weight_only(checks, device, weight_only_shapes)
    check_scaled_mm(checks, device, scaled_mm_shapes)
    check_qlinear(checks, device, compile_check=not args.no_compile and device.type == "cuda")
    result["checks"] = checks.rows
    result["passed"] = checks.passed
    if device.type == "cuda" and not args.no_timings:
        result["timings"] = timings(device, args.repeats, start + args.budget_s)
    result["seconds"] = time.perf_counter() - start
    print(f"\n{sum(r['passed'] for r in checks.rows)}/{len(checks.rows)} checks passed in {result['seconds']:.1f} s")
    if args.json:
        from provenance import collect  # bench/provenance.py, beside this script

        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"provenance": collect(), **result}, indent=2, default=str))
        print(f"wrote {args.json}")
    return 0 if checks.passed else 1


if __name__ == "__main__":
    sys.exit(main())
