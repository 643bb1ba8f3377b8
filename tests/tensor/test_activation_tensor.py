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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_plain_times_activation_of_the_same_dtype(dtype):
    """``p @ a`` / ``bmm`` with a plain tensor on either side: torch's dtype for two ``dtype`` operands.

    Both operands go to float32 (the FP8 values times their scale), the product is float32, and the result is
    rounded once to ``dtype``: within ``dtype``'s epsilon of the float64 product (float32: its accumulation
    error over K = 300, measured 5e-7), and bitwise that recipe.
    """
    tolerance = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float32: 1e-5}[dtype]
    a2 = Float8ActivationTensor.quantize(torch.randn(10, 300).to(dtype))
    a3 = Float8ActivationTensor.quantize(torch.randn(2, 5, 300).to(dtype), granularity="group")
    left2, left3 = torch.randn(4, 10).to(dtype), torch.randn(2, 4, 5).to(dtype)
    right2, right3 = torch.randn(300, 6).to(dtype), torch.randn(2, 300, 6).to(dtype)
    cases = [
        (left2 @ a2, left2, a2, torch.matmul),
        (torch.matmul(left2, a2), left2, a2, torch.matmul),
        (torch.bmm(left3, a3), left3, a3, torch.bmm),
        (a2 @ right2, a2, right2, torch.matmul),
        (torch.bmm(a3, right3), a3, right3, torch.bmm),
    ]

    def values(t, out):
        return t.dequantize(out) if isinstance(t, Float8ActivationTensor) else t.to(out)

    for y, left, right, op in cases:
        assert type(y) is torch.Tensor and y.dtype == dtype
        ref = op(values(left, torch.float64), values(right, torch.float64))
        assert ((y.double() - ref).norm() / ref.norm()).item() < tolerance
        assert torch.equal(y, op(values(left, torch.float32), values(right, torch.float32)).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_float_conversions_always_dequantize(dtype):
    """``a.float()`` & co. give a float tensor whatever ``a`` reports (torch's own would return ``a`` itself)."""
    a = Float8ActivationTensor.quantize(torch.randn(3, 40).to(dtype), granularity="group")
    conversions = {
        torch.float32: [a.float(), a.to(torch.float32), a.type(torch.float32), a.type(torch.FloatTensor)],
        torch.float64: [a.double(), a.to(torch.float64), a.to(torch.zeros(1, dtype=torch.float64))],
        torch.float16: [a.half(), a.to(torch.float16), a.type("torch.HalfTensor")],
        torch.bfloat16: [a.bfloat16(), a.to(dtype=torch.bfloat16)],
    }
    for out_dtype, results in conversions.items():
        for y in results:
            assert type(y) is torch.Tensor and y.dtype == out_dtype
            assert torch.equal(y, a.dequantize(out_dtype))
    # Against the float64 product of each FP8 value and its group's scale: one float32 rounding.
    group_scale = a.scale.double().repeat_interleave(formats.ACTIVATION_GROUP_SIZE, -1)[:, :40]
    ref = formats.fp8_to_float(a.qdata, torch.float64) * group_scale
    assert ((a.double() - ref).abs() <= ref.abs() * 2.0**-24).all()
    names = {
        torch.float32: "torch.FloatTensor",
        torch.bfloat16: "torch.BFloat16Tensor",
        torch.float16: "torch.HalfTensor",
    }
    assert a.type() == names[dtype]  # no argument: the type's name, as torch gives it
    assert a.to("cpu") is a
    with pytest.raises(TypeError, match="between FP8 formats"):
        a.to(torch.float8_e5m2)
