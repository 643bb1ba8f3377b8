"""``python -m qfp8 demo``: SmolLM2-135M-Instruct in bf16 and in FP8, side by side.

For each scheme: the text generated for a prompt (greedy), decode speed,
the bytes of the weights in memory, and perplexity on a fixed ``pydoc_data`` slice (the
first ``--ppl-windows`` windows of ``qfp8.evaluate``'s evaluation slice; the
accuracy mode calibrates on its disjoint calibration slice).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import time
from pathlib import Path

import torch
from torch import nn

import qfp8
from qfp8 import evaluate
from qfp8.checkpoint.layerwise import TOKENIZER_FILES

__all__ = [
    "DEFAULTS",
    "DEFAULT_PROMPT",
    "QUICK_DEFAULTS",
    "SCHEMES",
    "add_arguments",
    "build",
    "check_tokenizer",
    "decode_rate",
    "generate",
    "prompt_ids",
    "run",
    "weight_bytes",
]

# name -> qfp8.quantize arguments (None: the bf16 model itself)
SCHEMES: dict[str, dict | None] = {
    "bf16": None,
    "fp8-w8a16-channel": {"weight_scale": "channel"},
    # lm_head too: SmolLM2's is tied, so its embedding reads the same FP8 table (qfp8/nn/embedding.py)
    "fp8-w8a16-channel-head": {"weight_scale": "channel", "exclude": ()},
    "fp8-w8a8-dynamic-token": {"weight_scale": "channel", "activations": "dynamic", "activation_scale": "token"},
    "fp8-w8a8-static-tensor": {"weight_scale": "tensor", "activations": "static"},
}
DEFAULT_PROMPT = "What is the capital of France? Answer in one sentence."
DEFAULTS = {"max_new_tokens": 16, "ppl_windows": 1, "window_length": 256, "calibration_windows": 2}
QUICK_DEFAULTS = {"max_new_tokens": 4, "ppl_windows": 1, "window_length": 64, "calibration_windows": 1}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="local Hugging Face Llama-family folder (default: SmolLM2)")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("--max-new-tokens", type=int, default=None, help="default 16 (--quick: 4)")
    parser.add_argument("--schemes", default=",".join(SCHEMES), help=f"comma-separated, from {', '.join(SCHEMES)}")
    parser.add_argument("--ppl-windows", type=int, default=None, help="pydoc_data windows for perplexity (default 1)")
    parser.add_argument(
        "--window-length", type=int, default=None, help="tokens per perplexity window (default 256, --quick: 64)"
    )
    parser.add_argument(
        "--accuracy",
        choices=["none", "scale", "gptq"],
        default="none",
        help="qfp8 accuracy mode for the FP8 schemes (calibrates on a disjoint pydoc_data slice)",
    )
    parser.add_argument("--calibration-windows", type=int, default=None, help="default 2 (--quick: 1)")
    parser.add_argument(
        "--quick", action="store_true", help="tiny run for tests: 4 tokens, one 64-token window (options given win)"
    )
    parser.add_argument("--json", default=None, help="also write the results here")


def check_tokenizer(model: str | os.PathLike) -> None:
    """A ValueError naming the folder ``model`` when it is a Hugging Face folder (config.json) without tokenizer
    files: transformers would build an empty tokenizer from the config (GPT-2's: no token for any text) or fail
    with a message that does not say so. A .gguf file or folder carries its own tokenizer."""
    folder = Path(model)
    if not (folder / "config.json").is_file() or any((folder / name).is_file() for name in TOKENIZER_FILES):
        return
    raise ValueError(
        f"demo: --model {model}: the folder has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); the demo "
        "tokenizes its prompt and perplexity text with it: add the model's tokenizer files to the folder"
    )


def weight_bytes(model: nn.Module) -> int:
    """Bytes the model holds in its parameters and buffers (each storage once: a tied table counts once, and
    an embedding reading a quantized head's FP8 table adds nothing, though a checkpoint stores it in float)."""
    seen, total = set(), 0
    for tensor in [*model.parameters(), *model.buffers()]:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def prompt_ids(tokenizer, prompt: str) -> torch.Tensor:
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
    else:
        text = prompt
    return tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]


def generate(model: nn.Module, tokenizer, ids: torch.Tensor, max_new_tokens: int) -> tuple[str, float | None]:
    """Greedy decoding; returns the new text and decode tokens/s (prefill timed apart; see decode_rate)."""
    with torch.inference_mode():
        # The prefill alone: one token, after a first untimed call (warm-up), the faster of two timings.
        timings = []
        for _ in range(3):
            began = time.perf_counter()
            model.generate(
                ids, max_new_tokens=1, min_new_tokens=1, do_sample=False, pad_token_id=tokenizer.eos_token_id
            )
            timings.append(time.perf_counter() - began)
        prefill = min(timings[1:])
        began = time.perf_counter()
        out = model.generate(
            ids,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.eos_token_id,
        )
        elapsed = time.perf_counter() - began
    new = out[0, ids.shape[1] :]
    return tokenizer.decode(new, skip_special_tokens=True), decode_rate(new.numel() - 1, elapsed, prefill)


def decode_rate(decode_steps: int, elapsed: float, prefill: float) -> float | None:
    """Tokens/s of the steps after the first token: None when there are none, or when generating took no longer
    than the prefill alone (a timing too short to say anything)."""
    decode_time = elapsed - prefill
    if decode_steps < 1 or decode_time <= 0:
        return None
    return decode_steps / decode_time


def build(base: nn.Module, kwargs: dict | None, accuracy: str | None, calibration: torch.Tensor) -> nn.Module:
    if kwargs is None:
        return base
    model = copy.deepcopy(base)
    qfp8.quantize(model, accuracy=accuracy, **kwargs)
    if kwargs.get("activations") == "static" or accuracy:
        with qfp8.calibrate(model):
            for window in calibration:
                evaluate.logits_of(model, window[None])
    return qfp8.freeze(model)


def run(args: argparse.Namespace) -> int:
    names = [name.strip() for name in args.schemes.split(",") if name.strip()]
    unknown = [name for name in names if name not in SCHEMES]
    if unknown:
        raise ValueError(f"demo: unknown scheme(s) {unknown}; expected from {list(SCHEMES)}")
    if not names:
        raise ValueError(f"demo: --schemes names no scheme; expected from {list(SCHEMES)}")
    if args.json:  # checked before the work, not after it
        target = os.path.abspath(args.json)
        if os.path.isdir(target):
            raise ValueError(f"demo: --json {args.json} is a folder; give a file path")
        if not os.path.isdir(os.path.dirname(target)):
            raise FileNotFoundError(f"demo: --json {args.json}: the folder {os.path.dirname(target)} does not exist")
    if args.model is not None:
        check_tokenizer(args.model)
    defaults = QUICK_DEFAULTS if args.quick else DEFAULTS
    for option, value in defaults.items():  # what the user gave wins over --quick
        if getattr(args, option) is None:
            setattr(args, option, value)
    accuracy = None if args.accuracy == "none" else args.accuracy

    began = time.perf_counter()
    float_model, tokenizer = evaluate.load_model(args.model)
    base = float_model.to(torch.bfloat16)
    ids = prompt_ids(tokenizer, args.prompt)
    if ids.numel() == 0:
        raise ValueError("demo: --prompt gives no tokens (an empty prompt, and the model has no chat template)")
    windows = evaluate.evaluation_windows(tokenizer, args.ppl_windows, "pydoc_data", args.window_length)
    calibration = evaluate.calibration_windows(tokenizer, args.calibration_windows, args.window_length)
    print(
        f"model {args.model or evaluate.SMOLLM2_GGUF} loaded in {time.perf_counter() - began:.1f} s; "
        f"torch threads {torch.get_num_threads()}; perplexity on {args.ppl_windows} x {args.window_length} "
        f"tokens of pydoc_data; accuracy mode: {args.accuracy}",
        flush=True,
    )
    print(f"prompt: {args.prompt!r}\n", flush=True)

    results = []
    for name in names:
        t = time.perf_counter()
        model = build(base, SCHEMES[name], accuracy, calibration)
        built = time.perf_counter() - t
        text, tokens_per_s = generate(model, tokenizer, ids, args.max_new_tokens)
        ppl = evaluate.perplexity(model, windows)
        kernels = sorted({m.packing for m in model.modules() if isinstance(m, qfp8.QLinear)})
        row = {
            "scheme": name + (f"+{accuracy}" if accuracy and SCHEMES[name] else ""),
            "weight_bytes": weight_bytes(model),
            "perplexity": ppl,
            "decode_tokens_per_s": tokens_per_s,
            "kernel": ",".join(kernels) or "torch",
            "text": text,
            "build_seconds": built,
        }
        results.append(row)
        print(f"[{row['scheme']}] {text!r}", flush=True)
        del model

    print()
    header = ("scheme", "weight MB", "perplexity", "decode tok/s", "kernel")

    def rate(value):
        return "n/a" if value is None else f"{value:.1f}"

    lines = [
        (r["scheme"], f"{r['weight_bytes'] / 1e6:.1f}", f"{r['perplexity']:.3f}", rate(r["decode_tokens_per_s"]))
        + (r["kernel"],)
        for r in results
    ]
    widths = [max(len(line[i]) for line in [header, *lines]) for i in range(len(header))]
    for line in [header, tuple("-" * w for w in widths), *lines]:
        print("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip())
    print(f"\ntotal {time.perf_counter() - began:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model or evaluate.SMOLLM2_GGUF, "rows": results}, f, indent=2)
    return 0
