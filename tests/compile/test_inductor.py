"""Inductor compiles of the quantized Llama decode step (static cache) in the modes users pick on CPU.

Each mode gets one scheme so that the file stays short; between them the
three cover weight-only, dynamic and static activations.
``error_on_recompile`` makes any recompilation across decode steps fail.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

MODES = {
    "default-w-e4m3-channel": (None, "w-e4m3-channel"),
    "reduce-overhead-a-dynamic-token": ("reduce-overhead", "a-dynamic-token"),
    "max-autotune-no-cudagraphs-a-static": ("max-autotune-no-cudagraphs", "a-static"),
}


@pytest.mark.parametrize(("mode", "scheme_id"), list(MODES.values()), ids=list(MODES))
def test_inductor_decode_matches_eager(
    mode, scheme_id, schemes, tiny_llama, tokens, quantized, decode, decode_step, assert_bf16_close
):
    model = quantized(tiny_llama, schemes[scheme_id], tokens)
    eager = decode(model, tokens)
    compiled_step = torch.compile(decode_step, fullgraph=True, mode=mode)
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = decode(model, tokens, step=compiled_step)
    assert dict(torch._dynamo.utils.counters["graph_break"]) == {}
    assert_bf16_close(compiled, eager)
