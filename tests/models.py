"""The tiny random models the tests build: a Llama of a few layers (sizes overridable), a GPT-2 (whose linear
layers are transformers' Conv1D) and a saved Llama with a byte-level BPE tokenizer, for the code paths that read a
model folder. Built from configs, never downloaded."""

from __future__ import annotations

import os
from pathlib import Path

import torch

# Two layers of grouped-query attention (2 query heads per KV head), small enough to run in milliseconds.
TINY_LLAMA = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
)


def tiny_llama_config(**overrides):
    """A ``LlamaConfig`` of :data:`TINY_LLAMA`'s sizes, any of them (or other settings) overridden."""
    import transformers

    return transformers.LlamaConfig(**{**TINY_LLAMA, **overrides})


def tiny_llama(seed: int = 0, dtype: torch.dtype = torch.float32, attn_implementation: str | None = None, **overrides):
    """A random ``LlamaForCausalLM`` of :func:`tiny_llama_config` (``seed`` sets its weights), in eval mode."""
    import transformers

    config = tiny_llama_config(**overrides)
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).to(dtype).eval()


# Two GPT-2 blocks: c_attn, c_proj, c_fc and c_proj are transformers' Conv1D (weight [in, out]); lm_head, an
# nn.Linear, is tied to the token embedding.
TINY_GPT2 = dict(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=64, bos_token_id=0, eos_token_id=0)


def tiny_gpt2(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    """A random ``GPT2LMHeadModel`` of :data:`TINY_GPT2`'s sizes (``seed`` sets its weights), in eval mode."""
    import transformers

    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**TINY_GPT2, **overrides})).to(dtype).eval()


def save_tiny_llama(folder: str | os.PathLike, vocab_size: int = 512, seed: int = 0) -> Path:
    """Writes a tiny random Llama and a byte-level BPE tokenizer trained on pydoc_data into ``folder``, for the
    ``--model PATH`` code paths; its perplexity means nothing."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

    from qfp8.evaluate import pydoc_text

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([pydoc_text()[:200_000]], trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>", bos_token="<|endoftext|>")
    fast.save_pretrained(folder)
    torch.manual_seed(seed)
    config = tiny_llama_config(
        vocab_size=fast.vocab_size,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        eos_token_id=fast.eos_token_id,
        bos_token_id=fast.bos_token_id,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder
