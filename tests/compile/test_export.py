"""``torch.export`` of a quantized Llama (and Mixtral): every scheme traces, and the program is the model.

The exported graph calls qfp8's ops directly (``export`` traces through
``QLinear`` and the autograd.Function QLinear applies for gradients), so the
program runs with autograd on only because the CPU kernel's op and the
experts op have an Autograd kernel of their own; these tests hold both: the
forward equals the eager model's, and gradients reach the input embeddings
as in eager, the quantized layers' share included.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import qfp8
from qfp8.library import cpu

transformers = pytest.importorskip("transformers", reason="the export tests run Hugging Face models")


def _export(model, ids):
    return torch.export.export(model, (ids,), kwargs={"use_cache": False})


def _qfp8_ops(program) -> set[str]:
    return {
        str(node.target) for node in program.graph.nodes if node.op == "call_function" and "qfp8" in str(node.target)
    }


def test_export_every_scheme_matches_eager(scheme, tiny_llama, tokens, quantized):
    model = quantized(tiny_llama, scheme, tokens)
    with torch.no_grad():
        program = _export(model, tokens)
        got = program.module()(tokens, use_cache=False).logits
        want = model(tokens, use_cache=False).logits
    assert _qfp8_ops(program), "the exported graph calls no qfp8 op"
    assert torch.equal(got, want)


@pytest.mark.parametrize("scheme_id", ["w-e4m3-channel", "w-e4m3-block", "a-dynamic-token", "a-static"])
def test_exported_program_differentiates_like_eager(scheme_id, schemes, tiny_llama, tokens, quantized):
    """Exported with autograd on and run with it on: the input embeddings' gradient is eager's."""
    model = quantized(tiny_llama, schemes[scheme_id], tokens).float()
    linears = [module for module in model.modules() if isinstance(module, qfp8.QLinear)]
    _assert_gradient_like_eager(model, tokens, linears, "qfp8.scaled_linear_cpu.default")


def test_exported_mixtral_matches_and_differentiates_like_eager(tiny_llama, tokens):
    model = _tiny_mixtral(tiny_llama)
    with torch.no_grad():
        got = _export(model, tokens).module()(tokens, use_cache=False).logits
        assert torch.equal(got, model(tokens, use_cache=False).logits)
    experts = [layer.mlp.experts for layer in model.model.layers]  # each runs its QExperts weights
    _assert_gradient_like_eager(model, tokens, experts, "qfp8.experts_linear.default")


def test_aot_inductor_package_of_a_quantized_mixtral_runs(tmp_path, tiny_llama, tokens):
    """AOTInductor compiles the exported program; its runtime hands an empty list argument (block_size of a layer
    without block scales, the experts' input_scales) to the ops as None, which they take as the empty list."""
    model = _tiny_mixtral(tiny_llama)
    with torch.no_grad():
        want = model(tokens, use_cache=False).logits
        program = _export(model, tokens)
        assert "[]" in program.graph_module.code  # the empty lists this test is about
        package = torch._inductor.aoti_compile_and_package(program, package_path=str(tmp_path / "mixtral.pt2"))
    runner = torch._inductor.aoti_load_package(package)
    for mode in (torch.no_grad, torch.inference_mode):  # inference tensors skip the Autograd kernels
        with mode():
            got = runner(tokens, use_cache=False)[0]  # the model output's first field: the logits
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def _tiny_mixtral(tiny_llama):
    sizes = {key: getattr(tiny_llama.config, key) for key in ("hidden_size", "num_hidden_layers", "vocab_size")}
    config = transformers.MixtralConfig(
        **sizes, num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2
    )
    torch.manual_seed(0)
    return qfp8.freeze(qfp8.quantize(transformers.MixtralForCausalLM(config).eval())[0])


def _assert_gradient_like_eager(model, tokens, quantized: list, op: str) -> None:
    """The exported program's input-embedding gradient equals eager's, the ``quantized`` modules' share included."""
    program = _export(model, tokens)  # grad mode on: the embedding weight requires grad
    if cpu.cpu_kernel_isa() is not None:
        assert op in _qfp8_ops(program)
    exported = program.module()
    (embedding,) = [p for name, p in exported.named_parameters() if name.endswith("embed_tokens.weight")]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (got,) = torch.autograd.grad(exported(tokens, use_cache=False).logits.square().mean(), embedding)
    # torch's fallback for an op without an Autograd kernel warns (and may give wrong gradients).
    assert not [w for w in caught if "autograd kernel was not registered" in str(w.message)]
    (want,) = torch.autograd.grad(
        model(tokens, use_cache=False).logits.square().mean(), model.model.embed_tokens.weight
    )
    # The quantized modules' share of the gradient: without it the gradient would be off by 2-80 %.
    detached = [module.register_forward_hook(lambda module, args, out: out.detach()) for module in quantized]
    (residual_only,) = torch.autograd.grad(
        model(tokens, use_cache=False).logits.square().mean(), model.model.embed_tokens.weight
    )
    for handle in detached:
        handle.remove()
    assert (want - residual_only).abs().max() > 0.02 * want.abs().max()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6 * float(want.abs().max()))


def test_exported_program_saves_and_loads(tmp_path, schemes, tiny_llama, tokens, quantized):
    model = quantized(tiny_llama, schemes["a-dynamic-token"], tokens)
    with torch.no_grad():
        program = _export(model, tokens)
        path = tmp_path / "model.pt2"
        torch.export.save(program, path)
        loaded = torch.export.load(path)
        assert torch.equal(loaded.module()(tokens, use_cache=False).logits, model(tokens, use_cache=False).logits)


@pytest.mark.parametrize("run_first", [False, True], ids=["fresh", "run-before"])
def test_jit_trace_passes_its_own_check_and_jit_script_is_refused_clearly(run_first):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 32))
    qfp8.quantize(model, activations="dynamic", exclude=())
    x = torch.randn(4, 64)
    if run_first:  # the layers' fast path is armed before tracing
        model(x)
    traced = torch.jit.trace(model, (x,))  # check_trace: traces twice and compares the graphs
    other = torch.randn(7, 64)
    with torch.no_grad():
        assert torch.equal(traced(other), model(other))
    with pytest.raises(TypeError, match=r"QLinear\(64 -> 128\): torch.jit.script cannot compile qfp8's layers"):
        torch.jit.script(model)
