"""Per-tensor weight scales written as channel scales, and read back as one scale.

vLLM re-quantizes the shards of a layer it fuses (q/k/v, gate/up) to one scale when their weights are per tensor:
a second rounding on GPU, and on its CPU build a call to an op the build lacks (docs/vllm.md). Written with the
layer's one scale repeated per output row (``weight_scale`` ``[N, 1]``, strategy ``channel``), the checkpoint
holds the same values and every reader takes it as it is. The quantization_config lists those config groups under
:data:`TENSOR_WEIGHTS_KEY` (qfp8/checkpoint/config.py), so that qfp8 reads their layers back per tensor, one
scalar each (:func:`collapse_rows`); another tool's channel scales, unlisted, stay channel scales.
"""

from __future__ import annotations

import torch

__all__ = ["collapse_rows", "expand_rows"]


def expand_rows(scale: torch.Tensor, rows: int) -> torch.Tensor:
    """A per-tensor ``scale`` (one value) as the ``[rows, 1]`` channel scale that holds it in every row."""
    return scale.reshape(1, 1).expand(rows, 1).contiguous()


def collapse_rows(scale: torch.Tensor, where: str, why: str) -> torch.Tensor:
    """The one value of a channel-written per-tensor ``scale`` (``[N, 1]``, float32), as ``[1]``.

    ValueError naming ``where`` (the file and tensor) when its rows differ, saying ``why`` the layer is per tensor.
    """
    flat = scale.reshape(-1)
    if flat.numel() and not bool((flat == flat[0]).all()):
        differ = int((flat != flat[0]).sum())
        raise ValueError(
            f"{where} has {differ} of {flat.numel()} rows differing from its first ({flat[0].item():.6g}), but {why}: "
            "a per-tensor scale written per channel holds its one value in every row"
        )
    return flat[:1]
