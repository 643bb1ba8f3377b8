"""A fused MoE experts layer on CPU: qfp8's FP8 experts against transformers' bf16 ones.

One Mixtral-shaped experts module (random weights; 8 experts, top-2 routing)
timed on its own, in one process, interleaved round by round, medians:
transformers' default ``grouped_mm`` and ``eager`` implementations in bf16,
and qfp8's FP8 experts (W8A16 per-channel and W8A8 dynamic per-token; they
run the eager implementation, one expert at a time, through the kernel).
Each method rotates among weight copies that together exceed the last-level
cache, so weights are read from memory as in a real model. Also prints the
output's SQNR against the float64 computation with the float weights.

    python bench/moe.py                        # hidden 2048, inter 5632, 1 thread
    python bench/moe.py --quick --json out.json  # CI: small shapes, seconds
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import random
import statistics
import sys
import time
import warnings

import torch

import qfp8
from qfp8 import formats

LLC_BYTES = 32 << 20


def build(hidden: int, inter: int, experts: int):
    import transformers

    config = transformers.MixtralConfig(
        hidden_size=hidden, intermediate_size=inter, num_local_experts=experts, num_experts_per_tok=2,
        num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=8, vocab_size=32,
    )  # fmt: skip
    model = transformers.MixtralForCausalLM(config).eval()
    module = model.model.layers[0].mlp.experts
    for param in module.parameters():
        param.data = torch.randn_like(param) / hidden**0.5
    return model, module


def routing(tokens: int, hidden: int, experts: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    index = torch.stack([torch.randperm(experts, generator=g)[:2] for _ in range(tokens)])
    return x, index, torch.rand(tokens, 2, generator=g).softmax(-1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes and few rounds (CI)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    hidden, inter, experts = (256, 512, 8) if args.quick else (2048, 5632, 8)
    rounds = 5 if args.quick else args.rounds
    tokens_list = [1, 16] if args.quick else [1, 4, 16, 64]

    model, module = build(hidden, inter, experts)
    float_weights = {name: p.detach().clone() for name, p in module.named_parameters()}
    bytes_bf16 = sum(p.numel() for p in float_weights.values()) * 2
    copies = max(2, -(-2 * LLC_BYTES // bytes_bf16) + 1)

    def variant(implementation: str, quantize_kwargs=None):
        built = []
        for _ in range(copies):
            m = copy.deepcopy(model)
            m.config._experts_implementation = implementation
            if quantize_kwargs is None:
                m.to(torch.bfloat16)
            else:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    qfp8.quantize(m, exclude=["*attn*", "lm_head", "*.gate"], **quantize_kwargs)
                m.to(torch.bfloat16)
            built.append(m.model.layers[0].mlp.experts)
        return built

    methods = {
        "bf16_grouped_mm": variant("grouped_mm"),
        "bf16_eager": variant("eager"),
        "qfp8_w8a16": variant("eager", {}),
        "qfp8_w8a8": variant("eager", {"activations": "dynamic"}),
    }
    rows = []
    for tokens in tokens_list:
        x, index, weights = routing(tokens, hidden, experts, seed=tokens)
        with torch.no_grad():
            exact = reference(module, float_weights, x, index, weights)
            sqnr = {
                name: formats.sqnr(exact, fns[0](x.bfloat16(), index, weights.bfloat16()).double())
                for name, fns in methods.items()
            }
        times = {name: [] for name in methods}
        order = list(methods)
        shuffle = random.Random(0)
        position = 0
        gc.collect()
        gc.disable()
        try:
            with torch.no_grad():
                for _ in range(rounds):
                    shuffle.shuffle(order)
                    for name in order:
                        fn = methods[name][position % copies]
                        t0 = time.perf_counter()
                        fn(x.bfloat16(), index, weights.bfloat16())
                        times[name].append(time.perf_counter() - t0)
                    position += 1
        finally:
            gc.enable()
        medians = {name: statistics.median(ts) for name, ts in times.items()}
        base = medians["bf16_grouped_mm"]
        for name, t in medians.items():
            rows.append({"tokens": tokens, "method": name, "ms": t * 1e3, "speedup": base / t, "sqnr_db": sqnr[name]})
    print(f"Mixtral-shaped experts: hidden {hidden}, inter {inter}, {experts} experts, top-2; {args.threads} thread(s)")
    print(f"{'tokens':>6}  {'method':<16} {'ms':>9} {'vs bf16 grouped_mm':>19} {'SQNR dB':>8}")
    for row in rows:
        print(
            f"{row['tokens']:>6}  {row['method']:<16} {row['ms']:>9.3f} {row['speedup']:>18.2f}x {row['sqnr_db']:>8.1f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"hidden": hidden, "inter": inter, "experts": experts, "threads": args.threads, "rows": rows}, f)
    return 0


def reference(module, float_weights, x, index, weights):
    """The experts' eager forward in float64 with the float weights."""
    clone = copy.copy(module)
    clone._parameters = {k: torch.nn.Parameter(v.double(), requires_grad=False) for k, v in float_weights.items()}
    return type(module).forward.__wrapped__(clone, x.double(), index, weights.double())


if __name__ == "__main__":
    sys.exit(main())
