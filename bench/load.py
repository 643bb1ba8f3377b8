"""Loading through transformers with ``qfp8.Qfp8Config``: peak memory, and the speed of the model it gives.

Memory: a Llama-shaped checkpoint of random bf16 weights (about 1B parameters
by default) is written with safetensors, one shard per decoder layer, to a
temporary folder; a fresh Python process imports torch, transformers and
qfp8, notes its resident memory, loads the checkpoint with
``AutoModelForCausalLM.from_pretrained(folder, quantization_config=qfp8.Qfp8Config(), dtype=torch.bfloat16)``
and reports its peak resident memory (VmHWM) above that, against the bytes of
the FP8 model it holds (every parameter and buffer storage once). The target
is 1.3x: the FP8 model plus about one float layer. The same process shape
loads the float model alone (``from_pretrained`` without a config) for scale.
glibc's mmap threshold is fixed at 128 KiB in those processes (as the memory
tests do) so that freed tensors go back to the system and the peak is what is held.

Speed: a smaller model (SmolLM2-135M's shapes, random weights) is loaded three
ways, all three resident: transformers + ``Qfp8Config`` from the float
checkpoint, ``qfp8.from_pretrained`` of the checkpoint that model saves, and
transformers + ``Qfp8Config().for_checkpoint`` of that checkpoint. Each round
restarts every variant's dynamic cache after a prompt of ``--prompt-len``
tokens, then times ``--steps`` one-token steps, interleaved step by step
(A, B, C, then B, C, A, then C, A, B...: the one that runs first, after
another model's weights went through the caches, changes), so that on a
shared machine the steps compared ran side by side. The table gives the median wall and process CPU time per step,
and the median of the per-step ratios to ``qfp8.from_pretrained``.

    python bench/load.py                          # 1B memory, SmolLM2-shaped speed
    python bench/load.py --quick --json out.json  # CI: tiny shapes, seconds
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from provenance import collect  # noqa: E402  (bench/provenance.py, beside this script)

import qfp8  # noqa: E402

LLAMA_1B = dict(
    hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
    vocab_size=32000, max_position_embeddings=4096, tie_word_embeddings=False,
)  # fmt: skip
SMOLLM2_135M = dict(
    hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
    vocab_size=49152, max_position_embeddings=2048, tie_word_embeddings=True, rope_theta=100000.0,
)  # fmt: skip
TINY = dict(
    hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=1024, max_position_embeddings=256, tie_word_embeddings=False,
)  # fmt: skip
MEMORY_TARGET = 1.3


def write_checkpoint(sizes: dict, folder: Path, seed: int = 0) -> int:
    """A random bf16 Llama checkpoint, one safetensors shard per decoder layer (never the whole model in memory);
    returns its bytes."""
    import safetensors.torch
    import transformers

    config = transformers.LlamaConfig(**sizes, dtype="bfloat16", architectures=["LlamaForCausalLM"])
    config.save_pretrained(folder)
    generator = torch.Generator().manual_seed(seed)
    h, i, kv = sizes["hidden_size"], sizes["intermediate_size"], sizes["num_key_value_heads"]
    head = h // sizes["num_attention_heads"]

    def rand(*shape):
        return (torch.randn(*shape, generator=generator) * 0.02).to(torch.bfloat16)

    shards = {"model.embed_tokens.weight": rand(sizes["vocab_size"], h), "model.norm.weight": torch.ones(h).bfloat16()}
    if not sizes["tie_word_embeddings"]:
        shards["lm_head.weight"] = rand(sizes["vocab_size"], h)
    files = [("model-extra.safetensors", shards)]
    for layer in range(sizes["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        files.append(
            (
                f"model-layer-{layer:03d}.safetensors",
                {
                    p + "self_attn.q_proj.weight": rand(h, h),
                    p + "self_attn.k_proj.weight": rand(kv * head, h),
                    p + "self_attn.v_proj.weight": rand(kv * head, h),
                    p + "self_attn.o_proj.weight": rand(h, h),
                    p + "mlp.gate_proj.weight": rand(i, h),
                    p + "mlp.up_proj.weight": rand(i, h),
                    p + "mlp.down_proj.weight": rand(h, i),
                    p + "input_layernorm.weight": torch.ones(h).bfloat16(),
                    p + "post_attention_layernorm.weight": torch.ones(h).bfloat16(),
                },
            )
        )
    weight_map, total = {}, 0
    for name, tensors in files:
        safetensors.torch.save_file(tensors, folder / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors
    files.clear()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return total


# The measuring process: imports, resident memory, load, peak. Prints one JSON line.
MEASURE = textwrap.dedent(
    """
    import ctypes, json, sys
    ctypes.CDLL(None).mallopt(-3, 131072)  # M_MMAP_THRESHOLD: freed tensors go back to the system
    import torch, transformers, qfp8
    torch.set_num_threads({threads})

    def status(field):
        for line in open("/proc/self/status"):
            if line.startswith(field):
                return int(line.split()[1]) * 1024

    open("/proc/self/clear_refs", "w").write("5")
    before = status("VmRSS:")
    kwargs = dict(dtype=torch.bfloat16)
    if {quantize}:
        kwargs["quantization_config"] = qfp8.Qfp8Config()
    model = transformers.AutoModelForCausalLM.from_pretrained({folder!r}, **kwargs)
    peak = status("VmHWM:")
    seen, held = set(), 0
    for tensor in [*model.parameters(), *model.buffers()]:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen and tensor.device.type != "meta":
            seen.add(storage.data_ptr())
            held += storage.nbytes()
    quantized = sum(isinstance(m, qfp8.QLinear) for m in model.modules())
    print(json.dumps(dict(before=before, peak=peak, after=status("VmRSS:"), model_bytes=held, qlinears=quantized)))
    """
)


def measure_load(folder: Path, quantize: bool, threads: int) -> dict:
    script = MEASURE.format(folder=str(folder), quantize=quantize, threads=threads)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=1800, check=False
    )
    if result.returncode != 0:
        raise RuntimeError(f"the load process failed:\n{result.stderr[-3000:]}")
    row = json.loads(result.stdout.strip().splitlines()[-1])
    row["peak_above_imports"] = row["peak"] - row["before"]
    row["ratio_to_model"] = row["peak_above_imports"] / row["model_bytes"]
    return row


def bench_memory(sizes: dict, threads: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="qfp8-load-") as scratch:
        folder = Path(scratch)
        checkpoint_bytes = write_checkpoint(sizes, folder)
        fp8 = measure_load(folder, True, threads)
        bf16 = measure_load(folder, False, threads)
    params = checkpoint_bytes // 2
    return {"parameters": params, "checkpoint_bytes": checkpoint_bytes, "qfp8config": fp8, "bf16": bf16}


# ------------------------------------------------------------------ speed


class Decoder:
    """One variant's greedy decode with its own dynamic cache, a step at a time."""

    def __init__(self, model, prompt: torch.Tensor):
        import transformers

        self.model, self.prompt = model, prompt
        self.cache_argument = "cache" if int(transformers.__version__.split(".")[0]) >= 5 else "past_key_values"
        self.restart()

    def restart(self) -> None:
        import transformers

        self.cache = {self.cache_argument: transformers.DynamicCache()}
        with torch.no_grad():
            self.token = self.model(self.prompt, use_cache=True, **self.cache).logits[:, -1:].argmax(-1)

    def step(self) -> tuple[float, float]:
        """(wall seconds, process CPU seconds) of one one-token step."""
        wall, cpu = time.perf_counter(), time.process_time()
        with torch.no_grad():
            self.token = self.model(self.token, use_cache=True, **self.cache).logits[:, -1:].argmax(-1)
        return time.perf_counter() - wall, time.process_time() - cpu


def load_three_ways(sizes: dict, folder: Path) -> dict:
    import transformers

    write_checkpoint(sizes, folder / "float")
    variants = {}
    variants["transformers + Qfp8Config"] = transformers.AutoModelForCausalLM.from_pretrained(
        folder / "float", quantization_config=qfp8.Qfp8Config(), dtype=torch.bfloat16
    ).eval()
    variants["transformers + Qfp8Config"].save_pretrained(folder / "fp8")
    variants["qfp8.from_pretrained"] = qfp8.from_pretrained(folder / "fp8", dtype=torch.bfloat16)
    config = qfp8.Qfp8Config().for_checkpoint(folder / "fp8")
    variants["transformers + for_checkpoint"] = transformers.AutoModelForCausalLM.from_pretrained(
        folder / "fp8", config=config, dtype=torch.bfloat16
    ).eval()
    return variants


def bench_speed(sizes: dict, prompt_len: int, steps: int, rounds: int) -> list[dict]:
    """Each variant's one-token steps, interleaved step by step in a rotating order: on a shared machine a step's
    neighbours in time see the same load. Each round restarts the caches after the prompt."""
    with tempfile.TemporaryDirectory(prefix="qfp8-speed-") as scratch:
        variants = load_three_ways(sizes, Path(scratch))
    prompt = torch.randint(0, sizes["vocab_size"], (1, prompt_len), generator=torch.Generator().manual_seed(1))
    reference = "qfp8.from_pretrained"
    with torch.no_grad():
        logits = {name: model(prompt).logits for name, model in variants.items()}
    decoders = {name: Decoder(model, prompt) for name, model in variants.items()}
    for decoder in decoders.values():  # warm-up
        decoder.step()
    wall: dict[str, list[float]] = {name: [] for name in variants}
    cpu: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for decoder in decoders.values():
            decoder.restart()
        for step in range(steps):
            names = list(decoders)
            names = names[step % len(names) :] + names[: step % len(names)]  # each variant runs first in turn
            for name in names:
                seconds, cpu_seconds = decoders[name].step()
                wall[name].append(seconds)
                cpu[name].append(cpu_seconds)
    rows = []
    for name in variants:
        ratios = [t / r for t, r in zip(wall[name], wall[reference], strict=True)]
        cpu_ratios = [t / r for t, r in zip(cpu[name], cpu[reference], strict=True) if r > 0]
        rows.append(
            {
                "variant": name,
                "step_ms": statistics.median(wall[name]) * 1e3,
                "cpu_ms": statistics.median(cpu[name]) * 1e3,
                "min_step_ms": min(wall[name]) * 1e3,
                "ratio_to_qfp8_from_pretrained": statistics.median(ratios),
                "cpu_ratio_to_qfp8_from_pretrained": statistics.median(cpu_ratios),
                "steps_timed": len(ratios),
                "same_logits_as_qfp8_from_pretrained": bool(torch.equal(logits[name], logits[reference])),
            }
        )
    return rows


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes for both parts (CI)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    if args.quick:
        args.prompt_len, args.steps, args.rounds = min(args.prompt_len, 8), min(args.steps, 4), min(args.rounds, 3)
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    result = {
        "provenance": {**collect(), "transformers": importlib.metadata.version("transformers")},
        "memory_target": MEMORY_TARGET,
    }
    if not args.skip_memory:
        sizes = TINY if args.quick else LLAMA_1B
        print(f"memory: writing and loading a {sizes['num_hidden_layers']}-layer checkpoint ...", file=sys.stderr)
        memory = result["memory"] = bench_memory(sizes, args.threads)
        fp8, bf16 = memory["qfp8config"], memory["bf16"]
        print(f"Peak RSS above the imports, loading {memory['parameters'] / 1e9:.2f}B bf16 parameters")
        print(f"  {'load':<34}{'peak MB':>10}{'model MB':>10}{'peak/model':>12}")
        for name, row in (("transformers + Qfp8Config()", fp8), ("transformers, bf16 (mapped, unread)", bf16)):
            print(
                f"  {name:<34}{row['peak_above_imports'] / 1e6:>10.0f}{row['model_bytes'] / 1e6:>10.0f}"
                f"{row['ratio_to_model']:>12.2f}"
            )
        print(f"  target: peak/model <= {MEMORY_TARGET} with Qfp8Config")
    if not args.skip_speed:
        sizes = TINY if args.quick else SMOLLM2_135M
        print("speed: loading the model three ways ...", file=sys.stderr)
        rows = result["speed"] = bench_speed(sizes, args.prompt_len, args.steps, args.rounds)
        print(
            f"One-token step after a {args.prompt_len}-token prompt, {args.rounds} rounds of {args.steps} steps "
            f"interleaved step by step, {args.threads} threads (medians; ratios: median of per-step ratios)"
        )
        print(f"  {'variant':<32}{'ms/step':>9}{'ratio':>8}{'CPU ms':>9}{'CPU ratio':>11}{'min ms':>9}  same logits")
        for row in rows:
            print(
                f"  {row['variant']:<32}{row['step_ms']:>9.2f}{row['ratio_to_qfp8_from_pretrained']:>8.3f}"
                f"{row['cpu_ms']:>9.2f}{row['cpu_ratio_to_qfp8_from_pretrained']:>11.3f}{row['min_step_ms']:>9.2f}  "
                f"{row['same_logits_as_qfp8_from_pretrained']}"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
