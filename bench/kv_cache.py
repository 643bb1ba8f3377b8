"""FP8 KV cache: bytes, decode speed and accuracy against the unquantized cache.

1. Cache bytes of a static cache for a 1B-shaped model (16 layers, 8 KV heads,
   head_dim 64), model-dtype (bf16) vs FP8 (data and scales separately).
2. Decode tokens/s at several contexts on a random 1B-shaped Llama in bf16
   (hidden 2048, intermediate 8192, 32 heads, 8 KV heads, vocab 32000), static
   cache, compiled (``fullgraph=True``) unless ``--eager``. The cache is filled
   with random states up to the context (a real prefill of 8192 tokens takes
   minutes on CPU and does not change decode cost); bf16 and FP8 steps are
   interleaved in one process and medians reported. The FP8 cache writes its
   keys with compensated rounding (a stand-in query moment), as a calibrated
   model does.
3. Accuracy: SmolLM2-135M (float32) on pydoc_data windows, K/V cache in
   float32 (reference), bf16, FP8 static per-tensor (calibrated on other
   windows; amax scales and searched scales), FP8 dynamic per-head, and each
   FP8 one with key centering, and with compensated key rounding (the query
   second moment measured in the same calibration).
   Mean per-token KL divergence from the float32-cache model and perplexity.

``--quick`` (CI): 2 layers, contexts 128/512, eager, and a tiny random Llama
instead of SmolLM2 (loading the GGUF alone takes minutes on a busy CPU).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, StaticCache
from transformers.cache_utils import DynamicLayer

from qfp8.nn import kv_cache as kvc

ONE_B = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=32000,
)


# ------------------------------------------------------------------ models


def random_llama(layers: int, dtype=torch.bfloat16, seed: int = 0, **overrides) -> LlamaForCausalLM:
    config = LlamaConfig(**{**ONE_B, "num_hidden_layers": layers, **overrides}, max_position_embeddings=16384)
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.fill_(1.0)
            else:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.02)
        model.model.rotary_emb.__init__(config)  # inv_freq was left empty on meta
    return model.to(dtype).eval()


def fill_cache(cache, context: int, generator: torch.Generator) -> None:
    """Writes random states into positions [0, context) of every initialized static layer."""
    for layer in cache.layers:
        states = torch.randn(layer.keys.shape[:2] + (context, layer.keys.shape[-1]), generator=generator)
        for name in ("keys", "values"):
            if isinstance(layer, kvc._Float8LayerMixin):
                scale = layer._scales()[0 if name == "keys" else 1]
                q = kvc.quantize_kv(states, scale, layer.fp8_dtype)
                getattr(layer, name).view(torch.uint8)[:, :, :context] = q.view(torch.uint8)
            else:
                getattr(layer, name)[:, :, :context] = states.to(layer.keys.dtype)
        layer.cumulative_length.fill_(context)


# ------------------------------------------------------------------- bytes


def cache_bytes(model, context: int) -> dict:
    """Bytes of a static cache of ``context`` tokens, plain vs FP8 (filled by a 4-token prefill)."""
    ids = torch.zeros(1, 4, dtype=torch.long)
    result = {}
    for variant in ("bf16", "fp8"):
        cache = StaticCache(config=model.config, max_cache_len=context)
        set_fp8(model, variant == "fp8")
        with torch.no_grad():
            model(ids, cache=cache, use_cache=True)
        result[variant] = kvc.kv_cache_nbytes(cache)
    set_fp8(model, True)
    return result


def set_fp8(model, enabled: bool) -> None:
    """FP8 cache on or off for the caches the model meets from now on (off: plain bf16 layers stay)."""
    kvc.set_fp8_kv_cache_enabled(model, enabled)


# ------------------------------------------------------------------- speed


def decode_speed(layers: int, contexts, steps: int, compiled: bool) -> list[dict]:
    model = random_llama(layers)
    kvc.enable_fp8_kv_cache(model, torch.float8_e4m3fn)
    rows = []
    generator = torch.Generator().manual_seed(1)
    # As after qfp8.calibrate, keys are written with compensated rounding (its cost is part of each FP8 step);
    # a query moment of random queries with a common mean direction stands in for a measured one.
    dim = model.config.hidden_size // model.config.num_attention_heads
    for attention in kvc.attention_modules(model).values():
        q = torch.randn(model.config.num_key_value_heads, 1024, dim, generator=generator)
        q = q + torch.randn(q.shape[0], 1, dim, generator=generator)
        kvc.set_k_rounding(attention, q.transpose(1, 2) @ q / q.shape[1])
    prompt = torch.randint(0, model.config.vocab_size, (1, 4), generator=generator)
    for context in contexts:
        caches, steppers, positions, tokens = {}, {}, {}, {}
        for variant in ("bf16", "fp8"):
            set_fp8(model, variant == "fp8")
            cache = StaticCache(config=model.config, max_cache_len=context + steps + 4)
            with torch.no_grad():
                model(prompt, cache=cache, use_cache=True)  # eager: initializes the layers and dynamic scales
            fill_cache(cache, context, generator)
            caches[variant] = cache

            def step(token, position, cache=cache):
                return model(token, cache=cache, position_ids=position, use_cache=True).logits

            steppers[variant] = torch.compile(step, fullgraph=True) if compiled else step
            positions[variant] = context
            tokens[variant] = prompt[:, -1:]
        times = {"bf16": [], "fp8": []}
        compile_s = {}
        with torch.no_grad():
            for i in range(steps + 1):
                for variant in ("bf16", "fp8"):
                    set_fp8(model, variant == "fp8")
                    position = torch.tensor([[positions[variant]]])
                    start = time.perf_counter()
                    logits = steppers[variant](tokens[variant], position)
                    elapsed = time.perf_counter() - start
                    if i == 0:
                        compile_s[variant] = elapsed  # first call: compile + warm-up
                    else:
                        times[variant].append(elapsed)
                    tokens[variant] = logits[:, -1:].argmax(-1)
                    positions[variant] += 1
        nbytes = {v: kvc.kv_cache_nbytes(caches[v]) for v in caches}
        bf16_tps = 1 / statistics.median(times["bf16"])
        fp8_tps = 1 / statistics.median(times["fp8"])
        rows.append(
            {
                "context": context,
                "bf16_tok_s": bf16_tps,
                "fp8_tok_s": fp8_tps,
                "fp8_vs_bf16": fp8_tps / bf16_tps,
                "bf16_cache_bytes": nbytes["bf16"]["data"],
                "fp8_cache_bytes": nbytes["fp8"]["data"],
                "fp8_scale_bytes": nbytes["fp8"]["scales"],
                "first_call_s": compile_s,
            }
        )
        print(
            f"  context {context}: bf16 {bf16_tps:.3f} tok/s, fp8 {fp8_tps:.3f} tok/s (x{fp8_tps / bf16_tps:.3f})",
            flush=True,
        )
        torch.compiler.reset()
    return rows


# ---------------------------------------------------------------- accuracy


class _RoundedLayer(DynamicLayer):
    """Reference-side cache layer: stores the states rounded to bf16, returns them in the model dtype."""

    def update(self, key_states, value_states, *args, **kwargs):
        return super().update(
            key_states.to(torch.bfloat16).to(key_states.dtype), value_states.to(torch.bfloat16).to(key_states.dtype)
        )


def load_smollm2():
    """SmolLM2-135M in float32 (qfp8.evaluate's loader and its cached conversion) and pydoc_data as token ids."""
    from qfp8 import evaluate

    model, tokenizer = evaluate.load_model()
    return model, evaluate.token_ids(tokenizer), evaluate.smollm2_gguf().name


def _forward(model, ids: torch.Tensor, variant: str) -> torch.Tensor:
    if variant == "bf16":
        cache = DynamicCache(config=model.config)
        cache.layers = [_RoundedLayer() for _ in cache.layers]
    else:
        cache = DynamicCache(config=model.config)
    return model(ids, cache=cache, use_cache=True).logits[0, :-1].float()


def accuracy(model, tokens: torch.Tensor, window: int, windows: int, calibration_windows: int) -> list[dict]:
    """KL from the float32-cache model and perplexity, per cache variant, over ``windows`` windows."""
    import qfp8

    kvc.enable_fp8_kv_cache(model, torch.float8_e4m3fn)
    attentions = list(kvc.attention_modules(model).values())
    total = windows + calibration_windows
    if tokens.numel() < total * window:
        raise ValueError(f"need {total * window} tokens for {total} windows of {window}, have {tokens.numel()}")
    # Evaluation windows are spread over the text; calibration windows come from its end.
    stride = (tokens.numel() - calibration_windows * window) // windows
    eval_windows = [tokens[i * stride : i * stride + window] for i in range(windows)]
    calibration = [tokens[-(j + 1) * window : tokens.numel() - j * window] for j in range(calibration_windows)]
    # Static scales both ways: amax / fmax, and the default search for the
    # factor in [1, 2) with the least FP8 error on the calibration K/V.
    static_scales = {}
    for search in (False, True):
        for attention in attentions:
            attention.qfp8_kv_scale_search = search
        with torch.no_grad():
            with qfp8.calibrate(model):
                for ids in calibration:
                    model(ids[None], use_cache=False)
        static_scales[search] = [(a.k_scale.clone(), a.v_scale.clone()) for a in attentions]

    def configure(static: bool | None, center: bool, compensate: bool = False):
        scales = static_scales[bool(static)]
        for attention, (k_scale, v_scale) in zip(attentions, scales, strict=True):
            attention.k_scale = k_scale if static is not None else None
            attention.v_scale = v_scale if static is not None else None
            attention.qfp8_center_keys = center
            attention.qfp8_kv_compensate = compensate

    variants = [
        ("bf16", None),
        ("fp8-e4m3 static tensor, amax scales", (False, False)),
        ("fp8-e4m3 static tensor, searched scales", (True, False)),
        ("fp8-e4m3 dynamic head", (None, False)),
        ("fp8-e4m3 static tensor (searched) + key centering", (True, True)),
        ("fp8-e4m3 dynamic head + key centering", (None, True)),
        ("fp8-e4m3 static tensor (searched) + compensated key rounding", (True, False, True)),
        ("fp8-e4m3 dynamic head + compensated key rounding", (None, False, True)),
    ]
    sums = {name: {"kl": 0.0, "nll": 0.0} for name, _ in [("float32", None), *variants]}
    # Per window: mean NLL minus the float32-cache model's (windows are about
    # independent; tokens within one are not), for a standard error.
    window_deltas = {name: [] for name in sums}
    count = 0
    with torch.no_grad():
        for ids in eval_windows:
            set_fp8(model, False)
            reference = _forward(model, ids[None], "float32")
            labels = ids[1:]
            log_ref = torch.log_softmax(reference, -1)
            nll_ref = float(torch.nn.functional.nll_loss(log_ref, labels, reduction="sum"))
            sums["float32"]["nll"] += nll_ref
            window_deltas["float32"].append(0.0)
            for name, setting in variants:
                set_fp8(model, setting is not None)
                if setting is not None:
                    configure(*setting)
                logits = _forward(model, ids[None], "bf16" if setting is None else "fp8")
                log_p = torch.log_softmax(logits, -1)
                sums[name]["kl"] += float((log_ref.exp() * (log_ref - log_p)).sum())
                nll = float(torch.nn.functional.nll_loss(log_p, labels, reduction="sum"))
                sums[name]["nll"] += nll
                window_deltas[name].append((nll - nll_ref) / labels.numel())
            count += labels.numel()
    configure(True, False, True)
    set_fp8(model, True)
    base_ppl = math.exp(sums["float32"]["nll"] / count)
    rows = []
    for name, values in sums.items():
        ppl = math.exp(values["nll"] / count)
        deltas = window_deltas[name]
        # Standard error of the mean per-window NLL difference, as a % of
        # perplexity (d ppl = ppl d NLL); 0 with one window.
        se = statistics.stdev(deltas) / math.sqrt(len(deltas)) if len(deltas) > 1 else 0.0
        rows.append(
            {
                "cache": name,
                "kl_mean": values["kl"] / count,
                "perplexity": ppl,
                "perplexity_delta_pct": 100 * (ppl / base_ppl - 1),
                "perplexity_delta_pct_se": 100 * (ppl / base_ppl) * se,
                "tokens": count,
                "windows": len(deltas),
            }
        )
    return rows


# -------------------------------------------------------------------- main


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small and fast (CI)")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--eager", action="store_true", help="time eager decode instead of compiled")
    parser.add_argument("--layers", type=int, help="layers of the 1B-shaped speed model (default 16, quick 2)")
    parser.add_argument("--contexts", type=int, nargs="+", help="decode contexts (default 512 2048 8192)")
    parser.add_argument("--steps", type=int, help="timed decode steps per context")
    parser.add_argument("--window", type=int, help="tokens per accuracy window (default 1024)")
    parser.add_argument("--windows", type=int, help="accuracy windows (default 4)")
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--skip-accuracy", action="store_true")
    args = parser.parse_args(argv)
    quick = args.quick
    layers = args.layers or (2 if quick else 16)
    contexts = args.contexts or ([128, 512] if quick else [512, 2048, 8192])
    steps = args.steps or (3 if quick else 8)
    compiled = not (args.eager or quick)
    torch.manual_seed(0)
    results: dict = {"quick": quick, "threads": torch.get_num_threads()}

    bytes_model = random_llama(1, **({"num_hidden_layers": 1} if quick else {}))
    kvc.enable_fp8_kv_cache(bytes_model, torch.float8_e4m3fn)
    per_layer = cache_bytes(bytes_model, 8192)
    del bytes_model
    full_layers = ONE_B["num_hidden_layers"]
    bf16_bytes = per_layer["bf16"]["data"] * full_layers
    fp8_bytes = per_layer["fp8"]["data"] * full_layers
    fp8_scales = per_layer["fp8"]["scales"] * full_layers
    results["bytes"] = {
        "context": 8192,
        "layers": full_layers,
        "bf16": bf16_bytes,
        "fp8_data": fp8_bytes,
        "fp8_scales": fp8_scales,
        "ratio": (fp8_bytes + fp8_scales) / bf16_bytes,
    }
    print("\n== cache bytes, 1B-shaped model, 8192 tokens, batch 1 (dynamic per-head scales)")
    print(
        f"  bf16 {bf16_bytes:,} B | fp8 data {fp8_bytes:,} B + scales {fp8_scales:,} B "
        f"| data ratio {fp8_bytes / bf16_bytes:.4f}"
    )

    if not args.skip_speed:
        print(
            f"\n== decode, random 1B-shaped Llama bf16, {layers} layers, static cache, "
            f"{'compiled fullgraph' if compiled else 'eager'}, median of {steps} steps"
        )
        rows = decode_speed(layers, contexts, steps, compiled)
        results["decode"] = {"layers": layers, "compiled": compiled, "steps": steps, "rows": rows}
        header = (
            f"  {'context':>8} {'bf16 tok/s':>11} {'fp8 tok/s':>10} {'fp8/bf16':>9} {'bf16 KV B':>13} {'fp8 KV B':>13}"
        )
        print(header)
        for row in rows:
            print(
                f"  {row['context']:>8} {row['bf16_tok_s']:>11.3f} {row['fp8_tok_s']:>10.3f} "
                f"{row['fp8_vs_bf16']:>9.3f} {row['bf16_cache_bytes']:>13,} {row['fp8_cache_bytes']:>13,}"
            )

    if not args.skip_accuracy:
        window = args.window or (64 if quick else 1024)
        windows = args.windows or (2 if quick else 4)
        if quick:
            model = random_llama(
                2,
                dtype=torch.float32,
                hidden_size=128,
                intermediate_size=256,
                num_attention_heads=4,
                num_key_value_heads=2,
                vocab_size=256,
            )
            tokens = torch.randint(0, 256, (window * (windows + 1),), generator=torch.Generator().manual_seed(2))
            source = "random tiny Llama, random tokens"
        else:
            model, tokens, source = load_smollm2()
            source = f"SmolLM2 ({source}), pydoc_data"
        print(f"\n== accuracy: {source}, {windows} windows of {window} tokens, KL from the float32-cache model")
        rows = accuracy(model, tokens, window, windows, calibration_windows=1)
        results["accuracy"] = {"source": source, "window": window, "windows": windows, "rows": rows}
        print(f"  {'cache':<62} {'KL mean':>9} {'perplexity':>11} {'delta %':>8} {'+- SE':>6}")
        for row in rows:
            print(
                f"  {row['cache']:<62} {row['kl_mean']:>9.5f} {row['perplexity']:>11.4f} "
                f"{row['perplexity_delta_pct']:>+8.3f} {row['perplexity_delta_pct_se']:>6.3f}"
            )

    if args.json:
        from provenance import collect  # bench/provenance.py, beside this script

        with open(args.json, "w") as f:
            json.dump({"provenance": collect(), **results}, f, indent=2)
    return results


if __name__ == "__main__":
    main()
