"""FP8 KV cache for Llama-family attention in transformers' cache API.

Layout
------
Each cache layer keeps ``keys``/``values`` as FP8 tensors ``[B, H_kv, S, D]``
(exactly half the bytes of bf16) and reads them back as ``q.float() * scale``
in the model's dtype. Scales are float32:

- static: per-tensor ``[1]`` buffers ``k_scale``/``v_scale`` on the attention
  module, set by :func:`qfp8.calibrate` and saved in the state dict as
  ``<attn>.k_scale``/``<attn>.v_scale`` (vLLM/compressed-tensors). Each is
  ``m * amax / fmax`` with ``m`` in ``[1, 2)`` (steps of 1/16) chosen to
  minimise the mean squared FP8 rounding error of the K (or V) rows seen in
  calibration (``scale_search``, the default; ``m = 1`` without it). FP8's
  precision is relative, so the factor costs no range (nothing seen in
  calibration clips), but it moves every value against the FP8 grid, and K/V
  hold channels of nearly constant magnitude whose rounding error does not
  average out over tokens (README: the measured effect);
- dynamic (no static scale for K or V): per-head ``[B, H_kv, 1, 1]``, taken from
  the first ``update`` of the sequence (the prefill) with ``DYNAMIC_HEADROOM``
  so later tokens fit. In eager mode a head's scale grows when a later update
  of several tokens, or a one-token step while the cache holds fewer than
  ``GROWTH_CHECK_TOKENS``, would saturate, and its stored states are quantized
  again (a short first update, a cached prefix before a prompt); otherwise
  anything beyond the headroom saturates, never overflows.

Compensated key rounding (``compensated_rounding=True``, the default): what
attention does with a key is ``q . k``, so what its rounding error ``e``
costs is ``q . e``, summed over the queries that will read it: ``e^T H e``
with ``H = E[q q^T]``, the second moment of the queries of the key's head
group (after RoPE, as attention sees them). :func:`qfp8.calibrate` measures
``H`` per KV head (``k_rounding_hessian`` ``[H_kv, D, D]``, float32, on the
attention module) and each key row is then rounded channel by channel with
its error fed into the channels still to round
(``torch.ops.qfp8.fp8_compensated_quantize``, GPTQ's rounding applied to one
key): the same FP8 format and scales, attention unchanged, a smaller error
where queries look. Only on CPU with qfp8's extension (its kernel); elsewhere
keys are rounded to nearest. Queries are recorded by qfp8's attention function
(:data:`FUSED_ATTENTION`, the default with sdpa attention); other attention
implementations calibrate scales only and keep round-to-nearest. ``H`` is not
part of the state dict (vLLM would refuse an unknown tensor):
:func:`qfp8.save_pretrained` writes it to ``qfp8_kv_rounding.st`` (safetensors)
beside the weights and :func:`qfp8.from_pretrained` reads it back.

Optional key centering (``center_keys=True``): the first update's per-channel
mean of K (``[B, H_kv, 1, D]``) is subtracted before quantizing and never added
back. ``q . (k - mu) = q . k - q . mu`` shifts every score of a query by the same
constant, which softmax ignores, so attention stays exact while the FP8 rounding
error shrinks with ``|k - mu|`` instead of ``|k|``.

How it plugs in
---------------
:func:`enable_fp8_kv_cache` gives every attention module (``layer_idx``,
``k_proj``, ``v_proj``) the scale buffers, calibration methods and a forward
pre-hook. The hook swaps the module's ``DynamicLayer``/``StaticLayer`` in
whatever ``Cache`` it is called with for :class:`Float8DynamicLayer` /
:class:`Float8StaticLayer`, and the sliding-window variants (Mistral, Qwen2
with ``use_sliding_window``) for :class:`Float8DynamicSlidingWindowLayer` /
:class:`Float8StaticSlidingWindowLayer`, which keep and return the same
tokens as transformers' layers; the module's own forward and RoPE are
untouched, and so is its attention implementation except as said below.

What is dequantized per step
----------------------------
With transformers' ``"sdpa"`` attention (the default), enabling the cache
switches the model to :data:`FUSED_ATTENTION`: the cache layers hand the
attention function their FP8 buffers, and each decode step (one query token)
runs ``torch.ops.qfp8.fp8_decode_attention``, which reads only the K/V rows
the mask lets through and converts them in registers. Nothing is
dequantized, and a static cache costs what its filled part costs.

Prefill, other attention implementations (eager, flex) and
``fused_attention=False`` take K/V dequantized into the model's dtype, one
layer at a time (never the whole cache):

- Dynamic cache: the stored tokens, all of which attention reads.
- Static cache, eager: only the filled prefix ``[0, seq_len)``; the rest of the
  returned buffer is zeros, which the causal mask hides.
- Static cache, compiled: shapes must not depend on the fill level, so the
  whole ``max_cache_len`` buffer is dequantized.

The package: :mod:`.numerics` (scales, quantization, key rounding of one module), :mod:`.layers` (the cache
layers), :mod:`.fused` (the attention function), :mod:`.mixin` (what an attention module gains, calibration)
and :mod:`.install` (enabling the cache on a model, loading scales).
"""

from qfp8.nn.kv_cache.fused import FUSED_ATTENTION, fused_attention_on
from qfp8.nn.kv_cache.install import enable_fp8_kv_cache, kv_cache_nbytes, set_fp8_kv_cache_enabled
from qfp8.nn.kv_cache.layers import (
    Float8DynamicLayer,
    Float8DynamicSlidingWindowLayer,
    Float8StaticLayer,
    Float8StaticSlidingWindowLayer,
)
from qfp8.nn.kv_cache.layers import (
    _Float8LayerMixin as _Float8LayerMixin,  # what bench/kv_cache.py measures
)
from qfp8.nn.kv_cache.mixin import (
    Float8KVAttentionMixin,
    attention_modules,
    check_supported,
    k_rounding_state,
    load_k_rounding,
    search_scale,
)
from qfp8.nn.kv_cache.mixin import (
    _unpickle_attention as _unpickle_attention,  # named by pickles of FP8 KV-cache attention modules
)
from qfp8.nn.kv_cache.numerics import (
    DYNAMIC_HEADROOM,
    GROWTH_CHECK_TOKENS,
    KV_CACHE_DTYPES,
    KV_ROUNDING_BUFFERS,
    KV_ROUNDING_DAMPING,
    SCALE_SEARCH_ROWS,
    SCALE_SEARCH_STEPS,
    dequantize_kv,
    per_head_scale,
    quantize_kv,
    set_k_rounding,
)

__all__ = [
    "DYNAMIC_HEADROOM",
    "FUSED_ATTENTION",
    "GROWTH_CHECK_TOKENS",
    "KV_CACHE_DTYPES",
    "KV_ROUNDING_BUFFERS",
    "KV_ROUNDING_DAMPING",
    "SCALE_SEARCH_ROWS",
    "SCALE_SEARCH_STEPS",
    "Float8DynamicLayer",
    "Float8DynamicSlidingWindowLayer",
    "Float8KVAttentionMixin",
    "Float8StaticLayer",
    "Float8StaticSlidingWindowLayer",
    "attention_modules",
    "check_supported",
    "dequantize_kv",
    "enable_fp8_kv_cache",
    "fused_attention_on",
    "k_rounding_state",
    "kv_cache_nbytes",
    "load_k_rounding",
    "per_head_scale",
    "quantize_kv",
    "search_scale",
    "set_fp8_kv_cache_enabled",
    "set_k_rounding",
]
