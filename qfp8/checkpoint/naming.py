"""transformers' checkpoint names for a model's tensors, and back.

transformers 5 changes some names between a checkpoint and the model it
builds, and its ``save_pretrained`` changes them back: Mixtral's
``block_sparse_moe`` is the model's ``mlp``, and the per-expert matrices
``experts.<e>.w1.weight`` and ``experts.<e>.w3.weight`` are stacked into the
model's 3-D ``experts.gate_up_proj`` (``w2`` into ``experts.down_proj``).
vLLM and every transformers version read the checkpoint names, so qfp8
writes them too: :class:`CheckpointNames` reads transformers' own
conversion table for the model (the reverse of what it applies at load, as
its ``save_pretrained`` does) and gives

- :meth:`~CheckpointNames.to_checkpoint`: a model tensor name -> its checkpoint name;
- :meth:`~CheckpointNames.expert_modules`: a fused experts parameter -> the
  checkpoint module name of each expert's parts (``[[w1, w3], ...]``);
- :meth:`~CheckpointNames.to_model`: a checkpoint name -> the model's.

Only the conversions that rename, or stack experts along the first
dimension and concatenate parts along the second, are followed: a model
with others (or a transformers without the table) keeps its model names,
which qfp8 reads back as they are.
"""

from __future__ import annotations

from torch import nn

__all__ = [
    "CheckpointNames",
    "KV_ROUNDING_FILE",
    "split_rows",
]

# The FP8 KV cache's query second moments (compensated key rounding, qfp8.nn.kv_cache): qfp8's own file beside
# the weights, since vLLM refuses a checkpoint tensor it does not know. Safetensors inside, but not named
# *.safetensors: vLLM loads every *.safetensors file of a folder that has no index.
KV_ROUNDING_FILE = "qfp8_kv_rounding.st"


def _transforms(model: nn.Module) -> tuple[list, list] | None:
    """The conversions transformers applies when it loads ``model``, and those whose reverse its save applies
    (None: none, or no table)."""
    try:
        from transformers import core_model_loading as loading
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:
        return None
    conversions = getattr(model, "_weight_conversions", None)
    if conversions is not None:
        return (conversions, conversions) if conversions else None
    try:
        conversions = get_model_conversion_mapping(model, add_legacy=False)
    except Exception:  # not a transformers model, or a table this code does not know
        return None
    # Loading applies a prefix change where the checkpoint has the prefix (the Hub's Llava, Gemma 3 and PaliGemma
    # store their vision tower under vision_tower.vision_model.*); transformers' save of a model it did not
    # load skips it, as it would add a prefix the model never had.
    saved = [c for c in conversions if not isinstance(c, loading.PrefixChange)]
    return (conversions, saved) if conversions else None


class CheckpointNames:
    """Model names <-> checkpoint names for ``model`` (see the module docstring)."""

    def __init__(self, model: nn.Module):
        self._out_renamings: list = []
        self._in_renamings: list = []
        self._out_converters: list = []
        self._loading = None
        found = _transforms(model)
        if found is None:
            return
        loaded, saved = found
        from transformers import core_model_loading as loading

        self._loading = loading
        try:
            reverse = [c.reverse_transform() for c in saved[::-1]]
        except Exception:
            return
        self._out_renamings = [c for c in reverse if isinstance(c, loading.WeightRenaming)]
        self._out_converters = [c for c in reverse if isinstance(c, loading.WeightConverter)]
        self._in_renamings = [c for c in loaded if isinstance(c, loading.WeightRenaming)]

    @property
    def identity(self) -> bool:
        return not (self._out_renamings or self._out_converters)

    def to_checkpoint(self, name: str) -> str:
        """The checkpoint name of the model tensor (or module) ``name``."""
        if not self._out_renamings:
            return name
        return self._loading.apply_renamings(name, self._out_renamings)

    def to_model(self, name: str) -> str:
        """The model name of the checkpoint tensor ``name`` (renamings only; experts: see :meth:`expert_modules`)."""
        if not self._in_renamings:
            return name
        return self._loading.apply_renamings(name, self._in_renamings)

    def expert_modules(self, fused: str, num_experts: int) -> list[list[str]] | None:
        """Checkpoint module names ``[expert][part]`` of the fused experts parameter ``fused`` (a model name).

        The parts of one expert (gate and up) are consecutive row blocks of
        equal size of its ``[out, in]`` matrix. None when transformers does
        not split this parameter, or splits it in another way.
        """
        if not self._out_converters:
            return None
        try:
            renamed, pattern = self._loading.apply_converters(fused, self._out_converters)
        except Exception:
            return None
        if pattern is None:
            return None
        converter = next(c for c in self._out_converters if pattern in c.source_patterns)
        targets = list(converter.target_patterns)
        steps = [(type(op).__name__, getattr(op, "dim", None)) for op in converter.operations]
        expected = [("SplitModulelist", 0)] if len(targets) == 1 else [("Chunk", 1), ("SplitModulelist", 0)]
        if steps != expected or not renamed.endswith(targets[0]):
            return None
        if not all(t.count("*") == 1 and t.endswith(".weight") for t in targets):
            return None
        stem = renamed[: len(renamed) - len(targets[0])]
        return [
            [self.to_checkpoint(stem + t.replace("*", str(e)))[: -len(".weight")] for t in targets]
            for e in range(num_experts)
        ]


def split_rows(rows: int, parts: int, what: str) -> list[slice]:
    """``parts`` equal consecutive row ranges of ``rows`` (ValueError naming ``what`` if they do not divide)."""
    if rows % parts:
        raise ValueError(f"{what}: {rows} rows do not split into {parts} equal parts")
    step = rows // parts
    return [slice(i * step, (i + 1) * step) for i in range(parts)]
