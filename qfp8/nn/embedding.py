"""``QEmbedding``: an input embedding tied to a quantized output head.

A model with tied word embeddings (SmolLM2, Llama-3.2-1B, Qwen2.5-0.5B)
reads one ``[vocab, hidden]`` table twice: as the input embedding and as the
``lm_head`` weight. When ``lm_head`` is quantized, the embedding looks its
rows up in the head's FP8 weight (``QLinear.qweight`` in the kernel's layout,
times its scales) instead of keeping a float copy of the table: the table is
stored once, in FP8, and each token reads one row of it.

The values are the head's dequantized rows, bit for bit: what
``lm_head.weight.dequantize()[ids]`` gives. The head is held as a plain
attribute, not a submodule, so ``state_dict`` and ``named_modules`` name it
once (under its own name). ``state_dict`` gives the embedding's ``weight`` as
that dequantized table (a checkpoint body any loader reads, with
``tie_word_embeddings`` false); loading one checks that it is the head's
(:meth:`QEmbedding.check_loaded`).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from qfp8.library.routing import dequantized_rows
from qfp8.nn.qlinear import _STATE_SPEC_ONLY, QLinear
from qfp8.tensor import Float8WeightTensor
from qfp8.tensor.weights import check_row_ids

__all__ = [
    "LOADED_FLOOR",
    "LOADED_TOLERANCE",
    "QEmbedding",
    "is_plain_embedding",
    "untieable_reason",
]

# A loaded ``weight`` counts as the head's table when it is within the
# rounding of a bf16 (or fp16) checkpoint of it: 2^-8 relative. FP8 steps
# are 2^-3 (e4m3) apart, so the float table the head was quantized from
# differs by far more.
LOADED_TOLERANCE = 2.0**-8
LOADED_FLOOR = 2.0**-24  # fp16's subnormal step: where fp16's rounding is absolute, not relative
# Table values dequantized at a time (saving the table, checking a loaded one): their float32 temporaries stay
# a few MB, however wide the table.
_CHUNK_VALUES = 1 << 20


def untieable_reason(module: nn.Module) -> str | None:
    """Why ``module`` cannot become a QEmbedding (None: a plain ``nn.Embedding``, which can). A subclass is
    refused even when it keeps ``forward``: its other methods and attributes would be lost."""
    if type(module) is not nn.Embedding:
        return f"a {type(module).__name__}, not a plain nn.Embedding"
    if module.max_norm is not None:
        return "an nn.Embedding with max_norm, which renormalizes its rows in place"
    if module.sparse:
        return "an nn.Embedding with sparse gradients"
    return None


def is_plain_embedding(module: nn.Module) -> bool:
    return untieable_reason(module) is None


class QEmbedding(nn.Module):
    """An embedding that reads its rows from ``head``'s FP8 weight (a tied ``lm_head``)."""

    def __init__(self, head: QLinear, head_name: str, padding_idx: int | None = None, name: str = ""):
        super().__init__()
        self.num_embeddings = head.out_features
        self.embedding_dim = head.in_features
        self.padding_idx = padding_idx
        self.head_name = head_name
        self.name = name or "QEmbedding"
        self.__dict__["head"] = head  # not a submodule: the model names the head once, where it sits
        self._loaded: torch.Tensor | None = None  # a loaded table not yet checked against the head
        # The output dtype, as an nn.Embedding's weight holds it: cast with this module (model.model.to(...)),
        # not with the head. Empty and not saved.
        device = head.weight_scale.device if head.weight_scale.device.type != "meta" else None
        self.register_buffer("dtype_of_rows", torch.empty(0, dtype=head.orig_dtype, device=device), persistent=False)

    @classmethod
    def tied_to(cls, embedding: nn.Embedding, head: QLinear, head_name: str, name: str) -> QEmbedding:
        if not is_plain_embedding(embedding):
            raise TypeError(f"module {name!r}: {type(embedding).__name__} is not a plain nn.Embedding to tie")
        if tuple(embedding.weight.shape) != (head.out_features, head.in_features):
            raise ValueError(
                f"module {name!r}: embedding {list(embedding.weight.shape)} does not match the weight of "
                f"{head_name!r} [{head.out_features}, {head.in_features}]"
            )
        return cls(head, head_name, embedding.padding_idx, name)

    @property
    def weight(self) -> Float8WeightTensor:
        """The head's FP8 weight (``F.embedding(ids, weight)`` looks rows up in it; ``.dtype`` is the table's)."""
        return self.head.weight

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, rows of {self.head_name}'s FP8 weight"

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self._loaded is not None:
            self.check_loaded()
        check_row_ids(input, self.num_embeddings, f"module {self.name!r}")
        return self._rows(input.long(), self.dtype_of_rows.dtype)

    @contextlib.contextmanager
    def _head_buffers(self):
        """The head's buffers, loaded for the duration when accelerate's offload keeps them elsewhere."""
        head = self.head
        hook = getattr(head, "_hf_hook", None)  # accelerate's offload: the head's weights load for its own calls
        offloaded = hook is not None and any(b is not None and b.is_meta for b in head._buffers.values())
        if offloaded:
            hook.pre_forward(head)
        try:
            yield head._buffers
        finally:
            if offloaded:
                hook.post_forward(head, None)

    def _rows_of(self, buffers, ids: torch.Tensor | range, dtype: torch.dtype) -> torch.Tensor:
        head = self.head
        if isinstance(ids, range):
            ids = torch.arange(ids.start, ids.stop, device=buffers["qweight"].device)
        return dequantized_rows(
            head.packing,
            buffers["qweight"],
            buffers["weight_scale"],
            head.scheme.block_size,
            ids,
            head.out_features,
            head.in_features,
            dtype,
        )

    def _rows(self, ids: torch.Tensor | range, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` (a tensor, or a range of rows made on the head's device) of the head's weight."""
        with self._head_buffers() as buffers:
            return self._rows_of(buffers, ids, dtype)

    def _band_rows(self) -> int:
        return max(1, _CHUNK_VALUES // max(self.embedding_dim, 1))

    def table(self) -> torch.Tensor:
        """The whole dequantized ``[vocab, hidden]`` table, in this module's dtype, made a band of rows at a
        time: the float32 products of all rows at once would peak at several times a bf16 table's bytes."""
        dtype = self.dtype_of_rows.dtype
        with self._head_buffers() as buffers:
            out = torch.empty(self.num_embeddings, self.embedding_dim, dtype=dtype, device=buffers["qweight"].device)
            band = self._band_rows()
            for start in range(0, self.num_embeddings, band):
                stop = min(start + band, self.num_embeddings)
                out[start:stop] = self._rows_of(buffers, range(start, stop), dtype)
        return out

    # --------------------------------------------------------- state dict
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        if _STATE_SPEC_ONLY.get():
            destination[prefix + "weight"] = torch.empty(
                self.num_embeddings, self.embedding_dim, dtype=self.dtype_of_rows.dtype, device="meta"
            )
            return
        if self._loaded is not None:
            self.check_loaded()  # a table loaded and not yet checked: not saved as the head's unseen
        destination[prefix + "weight"] = self.table()

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        key = prefix + "weight"
        if strict:
            unexpected_keys += [k for k in state_dict if k.startswith(prefix) and k != key]
        if key not in state_dict:
            if strict:
                missing_keys.append(key)
            return
        value = state_dict[key]
        if tuple(value.shape) != (self.num_embeddings, self.embedding_dim) or not value.is_floating_point():
            error_msgs.append(
                f"{key}: the embedding tied to {self.head_name} takes a float [{self.num_embeddings}, "
                f"{self.embedding_dim}] table, got {value.dtype} {list(value.shape)}"
            )
            return
        # The head may load after this module: the check waits for
        # check_loaded (qfp8's loaders call it; the next forward does too).
        self._loaded = value.detach()

    def check_loaded(self) -> None:
        """Checks a table loaded into this module against the head's FP8 weight; raises ``ValueError`` if
        it is not that table (up to a bf16 checkpoint's rounding). The table is then dropped."""
        loaded, self._loaded = self._loaded, None
        if loaded is None or loaded.device.type == "meta" or self.head.qweight.device.type == "meta":
            return
        band = self._band_rows()
        for start in range(0, self.num_embeddings, band):
            rows = self._rows(range(start, min(start + band, self.num_embeddings)), torch.float32)
            given = loaded[start : start + len(rows)].to(rows.device, torch.float32)
            # Within a bf16 copy's rounding, or an fp16 one's in its subnormal range; NaN is off too.
            off = ~((given - rows).abs() <= torch.clamp(LOADED_TOLERANCE * rows.abs(), min=LOADED_FLOOR))
            if off.any():
                row, col = (int(i) for i in off.nonzero()[0])
                self._loaded = loaded
                raise ValueError(
                    f"module {self.name!r}: the loaded embedding table is not the FP8 weight of {self.head_name!r} "
                    f"it is tied to (row {start + row}, column {col}: {float(given[row, col]):.6g} against "
                    f"{float(rows[row, col]):.6g}); a checkpoint of a tied quantized head stores the head's "
                    "dequantized rows as the embedding"
                )
