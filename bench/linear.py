"""Linear-layer kernels on CPU: qfp8 against torch's bf16/fp32/FP8/INT8 paths.

Every method runs in the same process, interleaved round by round, on cold
weights: each method rotates among enough copies of its weights to touch
more than the last-level cache between two of its calls. Reports medians,
ratios against torch's bf16 ``F.linear`` and, at M = 1, the weight-read rate
next to a plain streaming read (``torch.sum``) of as many bytes held in the
same kind of memory as the packed weights, and that read's own speed-up over
bf16 ("read alone"): the most an FP8 kernel bound by reading its weights can
reach at M = 1 in that run. Methods within 4x of bf16's time get 5x the
rounds of the slow baselines, so that their medians hold still.

The qfp8 columns call the kernel through the entry ``QLinear`` calls in eager
mode (``LinearKernel.eager_op``), as a quantized model does. At M = 1 the row
also gives the same W8A16 call through ``torch.ops.qfp8.scaled_linear_cpu``
(the dispatcher's boxed call, what a compiled graph makes), which costs
more per call when cold, after the other methods have run.

    python bench/linear.py                 # full table, 1 thread
    python bench/linear.py --threads 2
    python bench/linear.py --quick --json out.json   # CI: < 60 s
    python bench/linear.py --weight-scale block      # qfp8 with 128 x 128 block scales

``--weight-scale block`` gives qfp8's columns 128 x 128 block weight scales
(DeepSeek-V3 / Qwen3-FP8 checkpoints) and its W8A8 column dynamic 1 x 128
activation groups, as such checkpoints use; the baselines are unchanged.
"""

from __future__ import annotations

import argparse
import gc
import glob
import json
import math
import random
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from qfp8 import formats
from qfp8.library import cpu, routing

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (576, 576), (576, 1536), (1536, 576)]  # (K, N)
QUICK_SHAPES = [(4096, 4096), (576, 1536)]
MS = [1, 4, 16, 64, 256]
QUICK_MS = [1, 16]
COLUMNS = ["bf16", "fp32", "qfp8_w8a16", "qfp8_w8a8", "dequant_bf16", "scaled_mm", "int8pack_mm"]
FAST_ROUNDS = 5  # rounds multiplier of the methods within FAST_FACTOR of bf16
FAST_FACTOR = 4.0
SLOW_CALL_S = 3.0  # a method whose first call takes longer is timed by that call alone (marked *)


def last_level_cache_bytes() -> int:
    """The largest CPU cache Linux reports (sysfs), capped at 512 MB; 32 MB when it says nothing.

    Cold means more than twice this many bytes touched between two calls of a
    method. A VM may report a host's whole L3 (480 MB on one machine here,
    whose streaming reads slowed from 27 to 17 GB/s only past 64-128 MB): the
    reported size is taken anyway, so that the weights are cold for sure.
    """
    sizes = []
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text and text[-1] in units and text[:-1].isdigit():
            sizes.append(int(text[:-1]) * units[text[-1]])
        elif text.isdigit():
            sizes.append(int(text))
    return min(max(sizes), 512 << 20) if sizes else 32 << 20


LLC_BYTES = last_level_cache_bytes()
QUICK_LLC_BYTES = 32 << 20  # --quick: it only has to run, so it rotates over less memory


def copies_for(nbytes: int, cold_bytes: int) -> int:
    return max(2, math.ceil(2 * cold_bytes / max(nbytes, 1)) + 1)


BLOCK_SIZE = [128, 128]  # --weight-scale block


def make_methods(k: int, n: int, cold_bytes: int, weight_scale: str = "channel"):
    """name -> (list of callables taking x_bf16, one per weight copy: enough to touch 2 x cold_bytes)."""
    w = torch.randn(n, k) / math.sqrt(k)
    q, scale = formats.quantize_weight(w, torch.float8_e4m3fn, "channel")  # the FP8 baselines'
    block_size = BLOCK_SIZE if weight_scale == "block" else []
    qfp8_q, qfp8_scale = (
        (q, scale) if weight_scale == "channel" else formats.quantize_weight(w, q.dtype, "block", block_size)
    )
    act = torch.float8_e4m3fn
    methods = {}

    def rotate(build, nbytes):
        return [build() for _ in range(copies_for(nbytes, cold_bytes))]

    def bf16_fn():
        wb = w.to(torch.bfloat16)
        return lambda x: F.linear(x, wb)

    def fp32_fn():
        wf = w.clone()
        return lambda x: F.linear(x.float(), wf)

    def qfp8_fn(activation, op=None):
        # By default the entry QLinear's eager fast path calls (the one a
        # quantized model runs); ``op`` = torch.ops.qfp8.scaled_linear_cpu
        # is the dispatcher's boxed call, what a compiled graph makes.
        op = op or routing.kernel_by_name(f"cpu-{cpu.cpu_kernel_isa()}").eager_op

        def build():
            packed = torch.ops.qfp8.pack_weight_cpu(qfp8_q)
            return lambda x: op(x, packed, qfp8_scale, None, None, n, k, block_size, activation, act)

        return build

    def dequant_fn():
        qc = q.clone()
        return lambda x: F.linear(x, (qc.to(torch.bfloat16) * scale.to(torch.bfloat16)))

    def scaled_mm_fn():
        qt = q.clone().t()  # column-major second operand, as _scaled_mm wants
        one = torch.ones((), dtype=torch.float32)

        def run(x):
            xq, xs = formats.quantize_activation(x, act, "tensor")
            return torch._scaled_mm(xq, qt, scale_a=xs.reshape(()), scale_b=one, out_dtype=torch.bfloat16)

        return run

    def int8_fn():
        wi = torch.clamp(torch.round(w / (w.abs().amax(1, keepdim=True) / 127)), -127, 127).to(torch.int8)
        s = (w.abs().amax(1) / 127).to(torch.bfloat16)
        return lambda x: torch._weight_int8pack_mm(x, wi, s)

    methods["bf16"] = rotate(bf16_fn, 2 * n * k)
    methods["fp32"] = rotate(fp32_fn, 4 * n * k)
    methods["qfp8_w8a16"] = rotate(qfp8_fn("none"), n * k)
    methods["qfp8_w8a8"] = rotate(qfp8_fn("group" if weight_scale == "block" else "token"), n * k)
    methods["dequant_bf16"] = rotate(dequant_fn, n * k)
    methods["scaled_mm"] = rotate(scaled_mm_fn, n * k)
    methods["int8pack_mm"] = rotate(int8_fn, n * k)

    def stream_fn():
        # The same bytes in the same kind of memory as a packed weight (huge
        # pages from 2 MiB up where the system allows them), summed as int64.
        t = cpu._packed_buffer(n * k // 8 * 8).view(torch.int64)
        t.copy_(torch.randint(0, 100, t.shape, dtype=torch.int64))
        return lambda x: t.sum()

    m1_extras = {
        "stream_read": rotate(stream_fn, n * k),
        "w8a16_torch_ops": rotate(qfp8_fn("none", torch.ops.qfp8.scaled_linear_cpu), n * k),
    }
    return methods, m1_extras


def measure(calls: dict, x, rounds: int, budget_s: float, burst: int = 1, rounds_of: dict | None = None) -> dict:
    """Interleaved medians (seconds) of each method; stops early when over budget.

    ``rounds_of`` gives some methods more rounds than ``rounds`` (a round
    then runs only the methods that still have rounds left).

    The order is shuffled each round (seeded), so that every method follows
    every other about equally often. With ``burst`` > 1 each method makes
    that many calls in a row per round (each on the next weight copy, so the
    weights stay cold), as a model's layers do: a lone small call after
    other methods have streamed tens of MB finds Python, the dispatcher and
    the kernel's code and data evicted too, which can cost more than a whole
    call at the SmolLM2 shapes. Garbage collection is off
    while timing, as in timeit.
    """
    times = {name: [] for name in calls}
    position = {name: 0 for name in calls}
    names = list(calls)
    order = random.Random(0)
    start = time.perf_counter()
    gc.collect()
    gc.disable()
    try:
        rounds_of = {name: (rounds_of or {}).get(name, rounds) for name in names}
        for r in range(max(rounds_of.values())):
            order.shuffle(names)
            for name in (n for n in names if rounds_of[n] > r):
                fns = calls[name]
                for _ in range(burst):
                    fn = fns[position[name] % len(fns)]
                    position[name] += 1
                    t0 = time.perf_counter()
                    fn(x)
                    times[name].append(time.perf_counter() - t0)
            gc.collect()
            if r >= 2 and time.perf_counter() - start > budget_s:
                break
    finally:
        gc.enable()
    return {name: statistics.median(ts) for name, ts in times.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="two shapes, M in (1, 16), few rounds (CI)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--shapes", nargs="*", metavar="KxN", help="only these shapes, e.g. 4096x4096")
    parser.add_argument("--ms", nargs="*", type=int, metavar="M", help="only these M")
    parser.add_argument(
        "--weight-scale", choices=["channel", "block"], default="channel", help="qfp8's weight scales (see above)"
    )
    args = parser.parse_args(argv)
    cold_bytes = min(LLC_BYTES, QUICK_LLC_BYTES) if args.quick else LLC_BYTES
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    shapes, ms = (QUICK_SHAPES, QUICK_MS) if args.quick else (SHAPES, MS)
    if args.shapes:
        shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.shapes]
    if args.ms:
        ms = args.ms
    rounds = args.rounds or (3 if args.quick else 9)
    budget = 2.0 if args.quick else 30.0
    rows = []
    print(
        f"qfp8 CPU kernel: {cpu.cpu_kernel_isa()}, threads: {args.threads}, torch {torch.__version__}, "
        f"qfp8 weight scales: {args.weight_scale}"
        + (" (W8A8: 1 x 128 activation groups)" if args.weight_scale == "block" else "")
    )
    header = f"{'K':>6} {'N':>6} {'M':>4} | " + " | ".join(f"{c:>15}" for c in COLUMNS) + " | GB/s w8a16 / stream"
    print(header)
    print("-" * len(header))
    for k, n in shapes:
        methods, m1_extras = make_methods(k, n, cold_bytes, args.weight_scale)
        too_slow = set()  # methods over SLOW_CALL_S a call at a smaller M of this shape: not run again
        for m in sorted(ms):
            x = torch.randn(m, k, dtype=torch.bfloat16)
            calls = {name: fns for name, fns in methods.items() if name not in too_slow}
            if m == 1:
                calls.update(m1_extras)
            warm = {}
            for name, fns in calls.items():  # warm-up: first call of each (allocations, lazy init)
                t0 = time.perf_counter()
                fns[0](x)
                warm[name] = time.perf_counter() - t0
            # Methods within FAST_FACTOR of bf16 get FAST_ROUNDS x the rounds:
            # their medians steady, at little cost beside the slow baselines
            # (dequantize-then-bf16 and _scaled_mm take 20-50x as long).
            rounds_of = {name: FAST_ROUNDS * rounds for name, t in warm.items() if t <= FAST_FACTOR * warm["bf16"]}
            # A baseline slower than SLOW_CALL_S a call (torch._scaled_mm on
            # CPU took 334 s at M = 256 on one machine here) is timed by its
            # first call alone, marked * in the table.
            single = {name for name, t in warm.items() if t > SLOW_CALL_S and name != "bf16"}
            # Small layers: bursts of calls (see measure); large ones: one call
            # per method per round (a burst of slow baselines would take minutes).
            timed = {name: fns for name, fns in calls.items() if name not in single}
            med = measure(timed, x, rounds, budget, burst=8 if n * k < (4 << 20) else 1, rounds_of=rounds_of)
            med.update({name: warm[name] for name in single})
            too_slow |= single
            row = {"K": k, "N": n, "M": m, "threads": args.threads, "isa": cpu.cpu_kernel_isa()}
            row["weight_scale"] = args.weight_scale
            cells = []
            for c in COLUMNS:
                if c not in med:  # over SLOW_CALL_S at a smaller M
                    row[f"{c}_ms"] = row[f"{c}_vs_bf16"] = None
                    cells.append(f"{'(slow)':>15}")
                    continue
                row[f"{c}_ms"] = med[c] * 1e3
                row[f"{c}_vs_bf16"] = med["bf16"] / med[c]
                if c in single:
                    row[f"{c}_single_call"] = True
                cells.append(f"{med[c] * 1e3:8.2f}{'*' if c in single else ' '}{med['bf16'] / med[c]:5.2f}x")
            extra = ""
            if m == 1:
                row["w8a16_gbps"] = n * k / med["qfp8_w8a16"] / 1e9
                row["stream_gbps"] = n * k / med["stream_read"] / 1e9
                # The speed-up a kernel that only read the FP8 bytes, as fast
                # as the plain read, would have: the bound at M = 1.
                row["stream_vs_bf16"] = med["bf16"] / med["stream_read"]
                row["w8a16_torch_ops_ms"] = med["w8a16_torch_ops"] * 1e3
                row["w8a16_torch_ops_vs_bf16"] = med["bf16"] / med["w8a16_torch_ops"]
                extra = (
                    f"{row['w8a16_gbps']:6.1f} / {row['stream_gbps']:5.1f} (read alone {row['stream_vs_bf16']:.2f}x;"
                    f" torch.ops {row['w8a16_torch_ops_vs_bf16']:.2f}x)"
                )
            print(f"{k:>6} {n:>6} {m:>4} | " + " | ".join(cells) + " | " + extra, flush=True)
            rows.append(row)
        del methods, m1_extras
    print("cells: median ms and speed-up over torch bf16 F.linear (higher is better); * one call only (slower than")
    print(f"{SLOW_CALL_S:g} s; not run at larger M: (slow)); cold: each method rotates over more than 2 x")
    print(f"{cold_bytes >> 20} MB of weights")
    if args.json:
        from provenance import collect  # bench/provenance.py, beside this script

        with open(args.json, "w") as f:
            json.dump({"provenance": collect(), "columns": COLUMNS, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
