"""A fused MoE experts layer on CPU: qfp8's FP8 experts against transformers' bf16 ones.

One experts module (random weights) timed on its own, in one process,
interleaved round by round, medians: transformers' default ``grouped_mm``
and ``eager`` implementations in bf16, and qfp8's FP8 experts (W8A16
per-channel and W8A8 dynamic per-token) through the ``"qfp8"`` experts
implementation that ``qfp8.quantize`` selects, plus W8A16 through
transformers' eager loop (what the FP8 experts cost without it). Shapes:
``mixtral`` (hidden 2048, intermediate 5632, 8 experts, top-2) and
``fine`` (Qwen3-30B-A3B's experts: hidden 2048, intermediate 768, 128
experts, top-8). Every round draws a new routing, the same for every
method; a method's calls are separated by the other methods' calls, each
of which streams more than the last-level cache, so weights come from
memory as in a real model. Also prints the output's SQNR against the
float64 computation with the float weights.

    python bench/moe.py                          # Mixtral-shaped, 1 thread
    python bench/moe.py --shape fine             # 128 experts, top-8
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

SHAPES = {  # hidden, intermediate, experts, top-k
    "mixtral": (2048, 5632, 8, 2),
    "fine": (2048, 768, 128, 8),
    "quick": (256, 512, 8, 2),
}


def build(hidden: int, inter: int, experts: int, top_k: int):
    import transformers

    config = transformers.MixtralConfig(
        hidden_size=hidden, intermediate_size=inter, num_local_experts=experts, num_experts_per_tok=top_k,
        num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=8, vocab_size=32,
    )  # fmt: skip
    torch.manual_seed(0)  # the same weights every run (the quick mode's accuracy checks are then reproducible)
    model = transformers.MixtralForCausalLM(config).eval()
    module = model.model.layers[0].mlp.experts
    for param in module.parameters():
        param.data = torch.randn_like(param) / hidden**0.5
    return model, module


def routing(tokens: int, hidden: int, experts: int, top_k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    index = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    return x, index, torch.rand(tokens, top_k, generator=g).softmax(-1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes and few rounds (CI)")
    parser.add_argument("--shape", choices=["mixtral", "fine"], default="mixtral")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    shape = "quick" if args.quick else args.shape
    hidden, inter, experts, top_k = SHAPES[shape]
    rounds = 5 if args.quick else args.rounds
    tokens_list = [1, 16] if args.quick else [1, 4, 16, 64]

    model, module = build(hidden, inter, experts, top_k)
    float_weights = {name: p.detach().clone() for name, p in module.named_parameters()}

    def variant(implementation: str, quantize_kwargs=None):
        m = copy.deepcopy(model)
        if quantize_kwargs is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                qfp8.quantize(m, exclude=["*attn*", "lm_head", "*.gate"], **quantize_kwargs)
        m.to(torch.bfloat16)
        m.config._experts_implementation = implementation
        return m.model.layers[0].mlp.experts

    methods = {
        "bf16_grouped_mm": variant("grouped_mm"),
        "bf16_eager": variant("eager"),
        "qfp8_w8a16_eager_loop": variant("eager", {}),
        "qfp8_w8a16": variant("qfp8", {}),
        "qfp8_w8a8": variant("qfp8", {"activations": "dynamic"}),
    }
    rows = []
    for tokens in tokens_list:
        x, index, weights = routing(tokens, hidden, experts, top_k, seed=tokens)
        with torch.no_grad():
            exact = reference(module, float_weights, x, index, weights)
            sqnr = {
                name: formats.sqnr(exact, fn(x.bfloat16(), index, weights.bfloat16()).double())
                for name, fn in methods.items()
            }
        times = {name: [] for name in methods}
        order = list(methods)
        shuffle = random.Random(0)
        gc.collect()
        gc.disable()
        try:
            with torch.no_grad():
                for round_ in range(rounds):
                    x, index, weights = routing(tokens, hidden, experts, top_k, seed=1000 * tokens + round_)
                    x, weights = x.bfloat16(), weights.bfloat16()
                    shuffle.shuffle(order)
                    for name in order:
                        t0 = time.perf_counter()
                        methods[name](x, index, weights)
                        times[name].append(time.perf_counter() - t0)
        finally:
            gc.enable()
        medians = {name: statistics.median(ts) for name, ts in times.items()}
        base = medians["bf16_grouped_mm"]
        for name, t in medians.items():
            rows.append({"tokens": tokens, "method": name, "ms": t * 1e3, "speedup": base / t, "sqnr_db": sqnr[name]})
    print(f"{shape} experts: hidden {hidden}, inter {inter}, {experts} experts, top-{top_k}; {args.threads} thread(s)")
    print(f"{'tokens':>6}  {'method':<22} {'ms':>9} {'vs bf16 grouped_mm':>19} {'SQNR dB':>8}")
    for row in rows:
        print(
            f"{row['tokens']:>6}  {row['method']:<22} {row['ms']:>9.3f} {row['speedup']:>18.2f}x {row['sqnr_db']:>8.1f}"
        )
    if args.json:
        from provenance import collect  # bench/provenance.py, beside this script

        with open(args.json, "w") as f:
            json.dump(
                {"provenance": collect(), "shape": shape, "hidden": hidden, "inter": inter, "experts": experts, "top_k": top_k,
                 "threads": args.threads, "rows": rows},
                f,
            )  # fmt: skip
    return 0


def reference(module, float_weights, x, index, weights):
    """The experts' eager forward in float64 with the float weights."""
    clone = copy.copy(module)
    clone._parameters = {k: torch.nn.Parameter(v.double(), requires_grad=False) for k, v in float_weights.items()}
    return type(module).forward.__wrapped__(clone, x.double(), index, weights.double())


if __name__ == "__main__":
    sys.exit(main())
