"""Tied word embeddings of a loaded checkpoint: the table a config ties, and the embeddings tied to a quantized head."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from torch import nn

from qfp8.checkpoint import config as qconfig
from qfp8.checkpoint.naming import CheckpointNames
from qfp8.checkpoint.pages import release_pages
from qfp8.nn import QLinear
from qfp8.nn.embedding import is_plain_embedding
from qfp8.nn.experts import QExperts

__all__ = ["fill_tied_table", "tie_loaded_embeddings", "tie_model"]


def tie_model(model: nn.Module) -> None:
    tie = getattr(model, "tie_weights", None)
    if not callable(tie):
        return
    try:
        tie()
    except (KeyError, RuntimeError, AttributeError) as error:
        tied = [name for name, m in model.named_modules() if isinstance(m, (QLinear, QExperts)) and "lm_head" in name]
        if not tied:
            raise
        raise ValueError(
            f"the config ties {tied[0]} to the input embedding (tie_word_embeddings) but the checkpoint quantizes "
            f"{tied[0]}: a tied head shares the float embedding's weight; set tie_word_embeddings to false in "
            f"config.json, or store {tied[0]} in float ({type(error).__name__}: {error})"
        ) from None


def fill_tied_table(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """The word-embedding table a config ties, loaded as transformers loads it.

    - Stored under one of the two names only (qfp8's own SmolLM2 folder holds ``lm_head.weight``), it fills
      both, so that ``tie_weights`` ties two loaded tensors rather than the loaded head to an embedding left
      on meta.
    - Stored as two different tensors, or loaded into a model whose head and embedding are not tied although
      its config says so (T5 v1.1's flag, forced by transformers; BigBirdPegasusForCausalLM ties nothing),
      the two stay apart: the config's flag is cleared, where ``tie_weights`` would silently make one of them
      the other (or fail on a quantized head).
    """
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else None
    if not any(getattr(c, "tie_word_embeddings", False) for c in (config, text)):
        return
    try:
        head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return
    where = {id(module): name for name, module in model.named_modules()}
    if head is None or embedding is None or id(head) not in where or id(embedding) not in where:
        return
    from qfp8.quantize import untie_config  # quantize imports the checkpoint package

    float_head = type(head) is nn.Linear
    skeleton = embedding.weight.is_meta or (float_head and head.weight.is_meta)
    keys = [where[id(head)] + ".weight", where[id(embedding)] + ".weight"]
    present = [key for key in keys if key in state]
    if float_head and not skeleton and head.weight is not embedding.weight:
        untie_config(config)  # a live model the flag calls tied and that is not: it stays as it is
        return
    if len(present) == 2:
        first, second = state[keys[0]], state[keys[1]]
        if first.dtype != second.dtype or first.shape != second.shape or not torch.equal(first, second):
            untie_config(config)
        return
    if not float_head or len(present) != 1:
        return
    # A skeleton built on meta has its ties undone (accelerate's empty weights): tie_weights shows what the
    # model ties (BigBirdPegasusForCausalLM sets the flag and ties nothing).
    if skeleton:
        with contextlib.suppress(Exception):
            model.tie_weights()
    if head.weight is embedding.weight:
        state[keys[1 - keys.index(present[0])]] = state[present[0]]


def tie_loaded_embeddings(model: nn.Module, tied, directory: Path) -> None:
    """Ties each embedding config.json lists (``qfp8_tied_embeddings``) to its quantized head again: the
    loaded float table must be the head's dequantized rows (checked), and is then dropped."""
    if tied is None:
        return
    from qfp8.quantize import tie_embedding  # quantize imports the checkpoint package

    where = f"{directory}/config.json: {qconfig.TIED_EMBEDDINGS_KEY}"
    if not isinstance(tied, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in tied.items()):
        raise ValueError(f"{where} must map embedding names to head names, got {tied!r}")
    names = CheckpointNames(model)
    for embedding_name, head_name in tied.items():
        embedding_name, head_name = (
            names.to_model(n + ".weight").removesuffix(".weight") for n in (embedding_name, head_name)
        )
        try:
            embedding, head = model.get_submodule(embedding_name), model.get_submodule(head_name)
        except AttributeError:
            raise ValueError(f"{where}: the model has no {embedding_name!r} or no {head_name!r} to tie") from None
        if not isinstance(head, QLinear) or not is_plain_embedding(embedding):
            raise ValueError(
                f"{where}: {embedding_name!r} ({type(embedding).__name__}) can only be tied to {head_name!r} "
                f"({type(head).__name__}) as a plain nn.Embedding to a quantized Linear"
            )
        table = embedding.weight.detach()
        try:
            tied_module = tie_embedding(model, head_name, embedding_name)
            tied_module.dtype_of_rows = tied_module.dtype_of_rows.to(table.dtype)  # the rows' dtype: the table's
            tied_module._loaded = table
            tied_module.check_loaded()
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from None
        release_pages(table)
        del table, embedding
