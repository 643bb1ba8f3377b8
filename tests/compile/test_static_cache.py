"""``torch.compile(fullgraph=True)`` of a quantized Llama decode step with a static cache, every scheme.

Compiled with the ``aot_eager`` backend: Dynamo tracing, the fake
implementations of the qfp8 ops and functionalization are all exercised,
without Inductor's code generation (tests/compile/test_inductor.py covers it).
"""

from __future__ import annotations

import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounterWithBackend

from qfp8.nn import QLinear


def test_decode_step_compiles_whole_without_recompiling(
    scheme, tiny_llama, tokens, quantized, decode, decode_step, assert_bf16_close
):
    model = quantized(tiny_llama, scheme, tokens)
    assert any(isinstance(m, QLinear) for m in model.modules())
    counter = CompileCounterWithBackend("aot_eager")
    compiled_step = torch.compile(decode_step, backend=counter, fullgraph=True)

    eager = decode(model, tokens)
    compiled = decode(model, tokens, step=compiled_step)

    # fullgraph=True turns any graph break into an error; the counters are
    # checked as well so that a break can never pass unnoticed.
    assert dict(torch._dynamo.utils.counters["graph_break"]) == {}
    assert counter.frame_count == 1, f"{counter.frame_count} compilations over {len(eager)} decode steps"
    assert compiled.shape == eager.shape
    assert_bf16_close(compiled, eager)


def test_explain_counts_no_graph_break(schemes, tiny_llama, tokens, quantized, decode, decode_step):
    # Static activations: the scheme with the most per-layer state (input_scale, calibration flag).
    model = quantized(tiny_llama, schemes["a-static"], tokens)
    explained = []

    def explain_first_step(model, token, position, cache):
        if not explained:
            explained.append(torch._dynamo.explain(decode_step)(model, token, position, cache))
        return decode_step(model, token, position, cache)

    decode(model, tokens, step=explain_first_step)
    assert explained[0].graph_break_count == 0, explained[0].break_reasons
    assert explained[0].graph_count == 1
    # The decode step's whole compute is in the graph: every QLinear is one qfp8 op call.
    qfp8_calls = [
        node for node in explained[0].graphs[0].graph.nodes if node.op == "call_function" and "qfp8" in str(node.target)
    ]
    assert len(qfp8_calls) == sum(isinstance(m, QLinear) for m in model.modules())
