import pytest
import torch
import torch.nn.functional as F

from qfp8 import Float8ActivationTensor, Float8WeightTensor, formats


@pytest.fixture
def weight():
    return torch.randn(48, 80, dtype=torch.float64)


@pytest.mark.parametrize("granularity", ["tensor", "channel", "block"], ids=lambda g: f"w-{g}")
def test_linear_matmul_addmm_route_to_kernel(weight, granularity):
    w = Float8WeightTensor.from_float(weight.float(), granularity=granularity, block_size=(16, 32))
    x = torch.randn(3, 80)
    bias = torch.randn(48)
    ref = x.double() @ weight.t() + bias.double()
    assert formats.sqnr(ref, F.linear(x, w, bias)) > 25
    assert torch.allclose(F.linear(x, w, bias) - bias, x @ w.t(), rtol=1e-5, atol=1e-5)
    assert torch.equal(torch.matmul(x, w.t()), x @ w.t())
    assert torch.equal(torch.addmm(bias, x, w.t()), F.linear(x, w, bias))


def test_T_mT_and_permute_are_the_transpose(weight):
    w = Float8WeightTensor.from_float(weight.float())
    x = torch.randn(3, 80)
    want = x @ w.t()
    for transposed in (w.T, w.mT, w.permute(1, 0), torch.permute(w, (1, 0)), w.permute(-1, -2)):
        assert transposed.transposed and transposed.shape == (80, 48)
        assert torch.equal(x @ transposed, want)
    assert not w.T.T.transposed and not w.permute(0, 1).transposed
    with pytest.raises(ValueError, match="dims"):
        w.permute(0, 0)


def test_matmul_with_untransposed_weight_is_explicit_dequantize(weight):
    w = Float8WeightTensor.from_float(weight.float())
    x = torch.randn(2, 48)
    assert torch.allclose(x @ w, x @ w.dequantize(torch.float32))


def test_shape_dtype_and_repr(weight):
    w = Float8WeightTensor.from_float(weight.to(torch.bfloat16), dtype=torch.float8_e5m2)
    assert w.shape == (48, 80) and w.dtype == torch.bfloat16 and w.fp8_dtype == torch.float8_e5m2
    assert w.t().shape == (80, 48) and w.transpose(0, 1).transposed
    text = repr(w)
    assert "Float8WeightTensor" in text and "float8_e5m2" in text and "channel" in text and "(48, 80)" in text


def test_to_float_dtype_is_explicit_dequantize(weight):
    w = Float8WeightTensor.from_float(weight.float())
    out = w.to(torch.float32)
    assert type(out) is torch.Tensor and out.dtype == torch.float32
    assert torch.equal(out, w.dequantize(torch.float32))
    assert w.to("cpu") is w
    with pytest.raises(TypeError, match="between FP8 formats"):
        w.to(torch.float8_e5m2)


def test_detach_clone_keep_fp8(weight):
    w = Float8WeightTensor.from_float(weight.float())
    for copy in (w.detach(), w.clone()):
        assert isinstance(copy, Float8WeightTensor)
        assert torch.equal(copy.qdata.view(torch.uint8), w.qdata.view(torch.uint8))
    assert w.clone().qdata.data_ptr() != w.qdata.data_ptr()


@pytest.mark.parametrize(
    "op",
    [lambda w: w + 1, lambda w: torch.exp(w), lambda w: w.sum(), lambda w: w[0], lambda w: torch.cat([w, w])],
    ids=["add", "exp", "sum", "index", "cat"],
)
def test_unknown_ops_raise_naming_the_op(weight, op):
    w = Float8WeightTensor.from_float(weight.float())
    with pytest.raises(NotImplementedError, match=r"Float8WeightTensor does not implement aten\.\w+"):
        op(w)


def test_activation_times_weight_uses_fp8_products(weight):
    w = Float8WeightTensor.from_float(weight.float())
    x = torch.randn(4, 80, dtype=torch.bfloat16)
    a = Float8ActivationTensor.quantize(x)
    y = F.linear(a, w)
    assert y.dtype == torch.bfloat16
    ref = a.dequantize(torch.float64) @ w.dequantize(torch.float64).t()
    assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < 1e-2


def test_linear_checks_features(weight):
    w = Float8WeightTensor.from_float(weight.float())
    with pytest.raises(ValueError, match="input has 79 features.*expects 80"):
        F.linear(torch.randn(2, 79), w)


def test_compile_traces_through_weight_subclass(weight):
    w = Float8WeightTensor.from_float(weight.float())

    def f(x, w):
        return F.linear(x, w) * 2

    x = torch.randn(3, 80)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x, w), f(x, w))


def test_stable_hash_for_caching_follows_layout_not_values(weight):
    """AOT autograd's cache key (and no 'does not implement _stable_hash_for_caching' warning on compile)."""
    a = Float8WeightTensor.from_float(weight.float())
    b = Float8WeightTensor.from_float(torch.randn_like(weight).float())
    assert a._stable_hash_for_caching() == b._stable_hash_for_caching()
    for other in (
        Float8WeightTensor.from_float(weight[:, :64].float()),
        Float8WeightTensor.from_float(weight.float(), dtype=torch.float8_e5m2),
        Float8WeightTensor.from_float(weight.float(), granularity="tensor"),
        a.t(),
    ):
        assert other._stable_hash_for_caching() != a._stable_hash_for_caching()
    activation = Float8ActivationTensor.quantize(torch.randn(3, 80))
    assert len(activation._stable_hash_for_caching()) == 32
