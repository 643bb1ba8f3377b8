"""qfp8 with accelerate: its hooks on a Linear survive quantize, offloading a quantized model works, removing the
hooks gives the fast path back, and disk-offloaded Linears are reported and warned about."""

from __future__ import annotations

import tempfile
import warnings

import pytest
import torch
from accelerate import cpu_offload, dispatch_model
from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_module
from torch import nn
from transformers import LlamaForCausalLM

import qfp8
from qfp8 import formats
from tests import models


def llama() -> LlamaForCausalLM:
    return models.tiny_llama(vocab_size=256, num_hidden_layers=4, tie_word_embeddings=False)


class Counting(ModelHook):
    def __init__(self):
        self.calls = 0

    def pre_forward(self, module, *args, **kwargs):
        self.calls += 1
        return args, kwargs


def test_an_accelerate_hook_moves_to_the_qlinear():
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))
    hook = Counting()
    add_hook_to_module(model[0], hook)
    x = torch.randn(3, 64)
    qfp8.quantize(model, exclude=None)
    assert isinstance(model[0], qfp8.QLinear) and model[0]._hf_hook is hook
    with torch.no_grad():
        model(x)
        model(x)
    assert hook.calls == 2
    remove_hook_from_module(model[0])  # accelerate leaves the class's forward bound on the instance
    model(x)
    assert hook.calls == 2 and model[0].__dict__["_fast"] is not None  # the fast path is back


@pytest.mark.parametrize("how", ["dispatch_model", "cpu_offload"])
def test_a_quantized_model_offloads_its_buffers(how):
    model = llama()
    qfp8.quantize(model)
    x = torch.randint(0, 256, (2, 10))
    with torch.no_grad():
        expected = model(x).logits
    with tempfile.TemporaryDirectory() as offload_dir:
        if how == "dispatch_model":
            device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "cpu"}
            device_map |= {"model.layers.2": "disk", "model.layers.3": "disk", "model.norm": "cpu"}
            device_map |= {"model.rotary_emb": "cpu", "lm_head": "cpu"}
            model = dispatch_model(model, device_map=device_map, offload_dir=offload_dir, offload_buffers=True)
        else:
            model = cpu_offload(model, execution_device="cpu", offload_buffers=True)
        with torch.no_grad():
            assert torch.equal(model(x).logits, expected)


def test_disk_offloaded_linears_are_named_and_warned_about():
    float_model = llama()
    with tempfile.TemporaryDirectory() as offload_dir:
        device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk"}
        device_map |= {"model.layers.2": "disk", "model.layers.3": "disk", "model.norm": "cpu"}
        device_map |= {"model.rotary_emb": "cpu", "lm_head": "cpu"}
        model = dispatch_model(llama(), device_map=device_map, offload_dir=offload_dir)
        with pytest.warns(UserWarning, match=r"21 of 29 nn\.Linear stay in float .*meta device .*disk offload"):
            _, report = qfp8.quantize(model)
        assert len(report.quantized) == 7
        assert all("offloaded by accelerate" in e.reason for e in report.skipped if e.name != "lm_head")
        x = torch.randint(0, 256, (2, 10))
        with torch.no_grad(), warnings.catch_warnings():
            assert formats.sqnr(float_model(x).logits, model(x).logits) > 20  # offloaded layers still load
