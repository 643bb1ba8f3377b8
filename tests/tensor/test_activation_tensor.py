import pytest
import torch

from qfp8 import Float8ActivationTensor, formats


@pytest.mark.parametrize("granularity", ["tensor", "token", "group", "token-mse"], ids=lambda g: f"a-{g}")
def test_quantize_dequantize_sqnr(granularity):
    x = torch.randn(2, 5, 300, dtype=torch.float64)
    a = Float8ActivationTensor.quantize(x.float(), granularity=granularity)
    assert a.shape == x.shape and a.dtype == torch.float32
    assert formats.sqnr(x, a.dequantize(torch.float64)) > 28


def test_reshape_keeps_token_scales():
    x = torch.randn(2, 5, 64)
    a = Float8ActivationTensor.quantize(x, granularity="token")
    flat = a.reshape(-1, 64)
    assert flat.shape == (10, 64) and flat.scale.shape == (10, 1)
    assert torch.equal(flat.dequantize(), a.dequantize().reshape(10, 64))
    assert torch.equal(a.view(10, 64).dequantize(), flat.dequantize())
    with pytest.raises(ValueError, match="must keep the last"):
        a.reshape(2, 320)


def test_reshape_per_tensor_any_shape():
    a = Float8ActivationTensor.quantize(torch.randn(4, 6), granularity="tensor")
    assert a.reshape(24).shape == (24,)


def test_bmm_dequantizes_explicitly():
    x = torch.randn(2, 3, 16)
    y = torch.randn(2, 16, 4)
    a = Float8ActivationTensor.quantize(x, granularity="tensor")
    out = torch.bmm(a, y)
    assert torch.allclose(out, torch.bmm(a.dequantize(), y), atol=1e-5)


def test_static_scale_and_repr():
    x = torch.randn(3, 8)
    a = Float8ActivationTensor.quantize(x, scale=torch.tensor([0.01]))
    assert a.granularity == "tensor" and a.scale.item() == pytest.approx(0.01)
    assert "Float8ActivationTensor" in repr(a) and "float8_e4m3fn" in repr(a)


def test_unknown_op_raises():
    a = Float8ActivationTensor.quantize(torch.randn(3, 8))
    with pytest.raises(NotImplementedError, match="Float8ActivationTensor does not implement aten.mul"):
        a * 2


def test_refuses_non_float():
    with pytest.raises(TypeError, match="float tensor"):
        Float8ActivationTensor.quantize(torch.ones(3, dtype=torch.int32))
