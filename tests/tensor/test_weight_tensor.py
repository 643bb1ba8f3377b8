import pytest
import torch
import torch.nn.functional as F

from qfp8 import Float8ActivationTensor, Float8WeightTensor, formats
from qfp8.library.routing import kernel_by_name, select_kernel


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


def test_matmul_with_untransposed_weight_is_refused_not_dequantized(weight):
    # x @ W (W [N, K]) is not the linear layer's product; computing it would be a silent dequantize.
    w = Float8WeightTensor.from_float(weight.float())
    x = torch.randn(2, w.shape[0])
    with pytest.raises(NotImplementedError, match=r"untransposed is not a linear layer's product: use x @ W.t\(\)"):
        x @ w


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
    with pytest.raises(ValueError, match=r"input has no features \(shape \[\]\).*expects 80"):  # was IndexError
        F.linear(torch.tensor(1.0), w)


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


def _packed(w: Float8WeightTensor) -> Float8WeightTensor:
    """``w`` in the layout of the kernel this device picks for it (what a frozen QLinear hands out)."""
    kernel, _ = select_kernel(w.kernel_request())
    return w._with(qdata=kernel.pack(w.qdata), packing=kernel.name)


NON_CONTIGUOUS_BIASES = {
    "strided": lambda: torch.randn(96)[::2],
    "expanded": lambda: torch.randn(1).expand(48),
    "transposed-row": lambda: torch.randn(48, 3).t()[0],
    "bf16-strided": lambda: torch.randn(96, dtype=torch.bfloat16)[1::2],
}


@pytest.mark.parametrize("layout", ["reference", "kernel"])
@pytest.mark.parametrize("kind", list(NON_CONTIGUOUS_BIASES))
def test_linear_takes_a_non_contiguous_bias(weight, kind, layout):
    """F.linear takes any [N] bias; the FP8 weight's route too, with the result of its contiguous copy."""
    w = Float8WeightTensor.from_float(weight.float())
    if layout == "kernel":
        w = _packed(w)
    bias = NON_CONTIGUOUS_BIASES[kind]()
    assert not bias.is_contiguous()
    x = torch.randn(5, 80)
    y = F.linear(x, w, bias)
    ref = x.double() @ w.dequantize(torch.float64).t() + bias.double()
    assert ((y.double() - ref).norm() / ref.norm()).item() < 1e-6  # float32 accumulation over K = 80
    assert torch.equal(y, F.linear(x, w, bias.contiguous()))
    assert torch.equal(torch.addmm(bias, x, w.t()), y)


def test_cpu_kernel_names_a_non_contiguous_bias(weight):
    w = _packed(Float8WeightTensor.from_float(weight.float()))
    if w.packing == "reference":
        pytest.skip("no CPU kernel is built for this machine: the reference op takes any bias")
    kernel = kernel_by_name(w.packing)
    args = (torch.randn(2, 80), w.qdata, w.scale)
    extra = kernel.extra_args(w.kernel_request())
    with pytest.raises(RuntimeError, match=r"bias must be contiguous, got shape \[48\] with strides \[2\]"):
        kernel.op(*args, torch.randn(96)[::2], None, *extra)
    with pytest.raises(RuntimeError, match=r"bias has shape \[47\], expected \[48\]"):
        kernel.op(*args, torch.randn(47), None, *extra)


@pytest.mark.parametrize("orig_dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64], ids=str)
def test_float_conversions_always_dequantize(weight, orig_dtype):
    """``w.float()`` & co. dequantize whatever dtype the weight reports (torch's own would return ``w`` itself)."""
    w = _packed(Float8WeightTensor.from_float(weight.to(orig_dtype), granularity="block", block_size=(16, 32)))
    conversions = {
        torch.float32: [w.float(), w.to(torch.float32), w.type(torch.float32), w.type("torch.FloatTensor")],
        torch.float64: [w.double(), w.to(torch.float64), w.type(torch.DoubleTensor)],
        torch.float16: [w.half(), w.to(dtype=torch.float16)],
        torch.bfloat16: [w.bfloat16(), w.to(torch.zeros(1, dtype=torch.bfloat16))],
    }
    scale = formats.expand_block_scale(w.scale.double(), (48, 80), (16, 32))
    ref = formats.fp8_to_float(w.canonical_qdata(), torch.float64) * scale
    for out_dtype, results in conversions.items():
        for y in results:
            assert type(y) is torch.Tensor and y.dtype == out_dtype
            assert torch.equal(y, w.dequantize(out_dtype))
            # one float32 rounding of FP8 value x scale, then one to out_dtype
            bound = 2.0**-24 + (0 if out_dtype in (torch.float32, torch.float64) else torch.finfo(out_dtype).eps / 2)
            assert ((y.double() - ref).abs() <= ref.abs() * bound * 1.0001).all()
    assert w.float().norm() > 0  # a plain tensor: every op works on it
    assert w.t().float().shape == (80, 48) and torch.equal(w.t().float(), w.float().t())


@pytest.mark.parametrize("layout", ["reference", "kernel"])
def test_linear_float64_input_takes_the_reference_op(weight, layout):
    """Kernels take float32 / bfloat16 / float16: a float64 input is computed by the reference op."""
    w = Float8WeightTensor.from_float(weight.float())
    if layout == "kernel":
        w = _packed(w)
    x = torch.randn(3, 80, dtype=torch.float64)
    bias = torch.randn(48, dtype=torch.float64)
    y = F.linear(x, w, bias)
    assert y.dtype == torch.float64 and y.shape == (3, 48)
    ref = x @ w.dequantize(torch.float64).t() + bias
    assert ((y - ref).norm() / ref.norm()).item() < 1e-6  # the reference op computes in float32
    # the reference op on the canonical weight, what the route promises, bit for bit
    want = torch.ops.qfp8.scaled_linear(x, w.canonical_qdata(), w.scale, bias, None, [], "none", torch.float8_e4m3fn)
    assert torch.equal(y, want)
    assert torch.equal(x @ w.t(), F.linear(x, w))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.float8_e4m3fn], ids=str)
def test_linear_refuses_non_float_input_naming_dtype_and_sizes(weight, dtype):
    w = _packed(Float8WeightTensor.from_float(weight.float()))
    x = torch.ones(3, 80).to(dtype)
    with pytest.raises(TypeError, match=rf"input is {dtype}; the FP8 weight \[48, 80\] takes float32"):
        F.linear(x, w)
    with pytest.raises(TypeError, match=rf"input is {dtype}"):
        torch.matmul(x, w.t())  # (``x @ w.t()`` raises a TypeError too, Python's: torch turns it into NotImplemented)


def test_addmm_with_an_fp8_activation_routes_like_matmul(weight):
    from qfp8.tensor import Float8ActivationTensor

    w = Float8WeightTensor.from_float(weight.float())
    x = Float8ActivationTensor.quantize(torch.randn(3, w.shape[1]), granularity="token")
    bias = torch.randn(w.shape[0])
    assert torch.equal(torch.addmm(bias, x, w.t()), F.linear(x, w, bias))  # the linear route
    plain = torch.randn(w.shape[1], 5)
    expected = x.dequantize(torch.float32) @ plain + torch.ones(5)
    torch.testing.assert_close(torch.addmm(torch.ones(5), x, plain), expected)  # the dequantizing matmul route
    with pytest.raises(NotImplementedError, match="beta = alpha = 1"):
        torch.addmm(bias, x, w.t(), beta=2)


# ------------------------------------------------------ found by the stop-28 audit
def test_operands_given_by_keyword_route_as_positional_ones(weight):
    """The handlers had read their operands by position: F.linear(x, weight=w) raised IndexError."""
    w = Float8WeightTensor.from_float(weight.float())
    x, bias = torch.randn(3, 80), torch.randn(48)
    want = F.linear(x, w, bias)
    assert formats.sqnr(x.double() @ weight.t() + bias.double(), want) > 25
    assert torch.equal(F.linear(x, weight=w, bias=bias), want)
    assert torch.equal(F.linear(input=x, weight=w, bias=bias), want)
    assert torch.equal(F.linear(x, weight=w), F.linear(x, w))
    assert torch.equal(torch.addmm(input=bias, mat1=x, mat2=w.t()), want)
    assert torch.equal(torch.matmul(x, other=w.t()), F.linear(x, w))
    assert torch.equal(x.matmul(other=w.t()), F.linear(x, w))
    fp8 = Float8ActivationTensor.quantize(x)
    assert torch.equal(F.linear(fp8, weight=w, bias=bias), F.linear(fp8, w, bias))
    ids = torch.tensor([[3, 0], [47, 5]])
    assert torch.equal(F.embedding(ids, weight=w), F.embedding(ids, w))


def test_transpose_refuses_a_dimension_a_matrix_lacks(weight):
    w = Float8WeightTensor.from_float(weight.float())
    assert w.transpose(0, 1).transposed and w.transpose(-1, -2).transposed and not w.transpose(1, 1).transposed
    with pytest.raises(IndexError, match="out of range"):
        w.transpose(0, 5)


def test_share_memory_shares_the_fp8_data_and_scales(weight):
    """torch's Tensor.share_memory_ on the wrapper had crashed the process (no storage of its own)."""
    w = Float8WeightTensor.from_float(weight.float())
    x = torch.randn(3, 80)
    want = F.linear(x, w)
    assert not w.is_shared()
    assert w.share_memory_() is w
    assert w.is_shared() and w.qdata.is_shared() and w.scale.is_shared()
    assert torch.equal(F.linear(x, w), want)
    a = Float8ActivationTensor.quantize(x)
    assert a.share_memory_().is_shared()


@pytest.mark.parametrize("shape", [(48,), (1, 48), (5, 48), (5, 1)], ids=["N", "1xN", "MxN", "Mx1"])
def test_addmm_takes_any_input_that_broadcasts_to_the_product(weight, shape):
    """torch.addmm's input broadcasts to [M, N]; an [M, N] or [M, 1] one had raised the kernel's RuntimeError
    ("bias has shape [5, 48], expected [48]")."""
    w = Float8WeightTensor.from_float(weight.float())
    x = torch.randn(5, w.in_features)
    inp = torch.randn(shape)
    ref = torch.addmm(inp.double(), x.double(), w.float().double().t())
    y = torch.addmm(inp, x, w.t())
    assert y.shape == (5, w.out_features) and y.dtype == x.dtype
    assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5
    with pytest.raises(ValueError, match=r"addmm: the input of shape \[4, 48\] does not broadcast to the product"):
        torch.addmm(torch.randn(4, 48), x, w.t())
