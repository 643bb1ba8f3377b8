"""The reference op: the oracle of every kernel, checked against float64 math."""

import pytest
import torch

from qfp8 import formats
from qfp8.library import ops  # noqa: F401
from qfp8.library.testing import opcheck

MODES = ["none", "token", "tensor", "group", "static", "token-mse"]


def float64_linear(x, q, w_scale, bias, block_size, activation, act_dtype, input_scale):
    """Independent float64 computation of the op's arithmetic."""
    n, k = q.shape
    w = q.to(torch.float64)
    if block_size:
        bn, bk = block_size
        w = w * w_scale.double().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    else:
        w = w * w_scale.double().reshape(-1, 1) if w_scale.numel() > 1 else w * w_scale.double()
    x2 = x.reshape(-1, k).double()
    if activation != "none":
        granularity = "tensor" if activation == "static" else activation
        qx, s = formats.quantize_activation(x2.float(), act_dtype, granularity, input_scale)
        s = s.double()
        if granularity == "group":
            s = s.repeat_interleave(128, 1)[:, :k]
        x2 = qx.double() * s
    y = x2 @ w.t()
    if bias is not None:
        y = y + bias.double()
    return y.reshape(*x.shape[:-1], n)


@pytest.mark.parametrize("activation", MODES, ids=[f"a-{m}" for m in MODES])
@pytest.mark.parametrize("granularity", ["tensor", "channel", "block"], ids=lambda g: f"w-{g}")
@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16], ids=["x-fp32", "x-bf16"])
def test_reference_matches_float64(activation, granularity, xdtype):
    n, k = 37, 300
    w = torch.randn(n, k)
    block = (16, 128) if granularity == "block" else ()
    q, w_scale = formats.quantize_weight(w, torch.float8_e4m3fn, granularity, block or None)
    x = torch.randn(2, 3, k).to(xdtype)
    bias = torch.randn(n)
    input_scale = torch.tensor([x.float().abs().max().item() / 448]) if activation == "static" else None
    y = torch.ops.qfp8.scaled_linear(x, q, w_scale, bias, input_scale, list(block), activation, torch.float8_e4m3fn)
    assert y.dtype == xdtype and y.shape == (2, 3, n)
    ref = float64_linear(x, q, w_scale, bias, block, activation, torch.float8_e4m3fn, input_scale)
    rel = ((y.double() - ref).abs().mean() / ref.abs().mean()).item()
    assert rel <= (1e-2 if xdtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("activation", MODES, ids=[f"a-{m}" for m in MODES])
def test_opcheck(activation):
    q, w_scale = formats.quantize_weight(torch.randn(24, 40), torch.float8_e4m3fn, "channel")
    x = torch.randn(3, 40)
    input_scale = torch.tensor([0.01]) if activation == "static" else None
    opcheck(
        torch.ops.qfp8.scaled_linear.default,
        (x, q, w_scale, torch.randn(24), input_scale, [], activation, torch.float8_e4m3fn),
    )


def test_static_without_scale_says_what_to_do():
    q, w_scale = formats.quantize_weight(torch.randn(4, 8))
    with pytest.raises(ValueError, match="calibrate"):
        torch.ops.qfp8.scaled_linear(torch.randn(1, 8), q, w_scale, None, None, [], "static", torch.float8_e4m3fn)
