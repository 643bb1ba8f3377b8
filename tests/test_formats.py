import math

import pytest
import torch

from qfp8 import formats

FP8 = {"e4m3fn": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2, "e4m3fnuz": torch.float8_e4m3fnuz}
# Round-trip SQNR floors on Gaussian weights: e4m3 keeps 3 mantissa bits
# (about 31 dB measured), e5m2 keeps 2 (about 25 dB).
ROUND_TRIP_DB = {"e4m3fn": 28.0, "e5m2": 22.0, "e4m3fnuz": 28.0}


@pytest.mark.parametrize("granularity", ["tensor", "channel", "block"])
@pytest.mark.parametrize("name", list(FP8), ids=[f"w-{n}" for n in FP8])
def test_weight_round_trip_sqnr(name, granularity):
    w = torch.randn(300, 520, dtype=torch.float64)
    q, scale = formats.quantize_weight(w, FP8[name], granularity, (128, 128))
    assert q.dtype == FP8[name] and scale.dtype == torch.float32
    expected_shape = {"tensor": (1,), "channel": (300, 1), "block": (3, 5)}[granularity]
    assert tuple(scale.shape) == expected_shape
    back = formats.dequantize_weight(q, scale, (128, 128) if granularity == "block" else None, torch.float64)
    assert formats.sqnr(w, back) >= ROUND_TRIP_DB[name]


def test_scale_formula_and_multiply_convention():
    w = torch.tensor([[1.0, -3.0], [0.5, 0.25]])
    q, scale = formats.quantize_weight(w, torch.float8_e4m3fn, "channel")
    assert torch.equal(scale, torch.tensor([[3.0 / 448], [0.5 / 448]]))
    # the largest magnitude of each row maps to fmax exactly
    assert q.float()[0, 1] == -448 and q.float()[1, 0] == 448


def test_saturation_never_nan():
    x = torch.tensor([[1e9, -1e9, 3.0]])
    for dtype in FP8.values():
        q = formats.quantize_with_scale(x, torch.tensor(1.0), dtype)
        values = q.float()
        assert not torch.isnan(values).any()
        assert values[0, 0] == formats.fp8_max(dtype) and values[0, 1] == -formats.fp8_max(dtype)


@pytest.mark.parametrize("granularity", ["tensor", "channel", "block"])
def test_zero_weight_gives_zeros(granularity):
    w = torch.zeros(7, 9)
    q, scale = formats.quantize_weight(w, torch.float8_e4m3fn, granularity, (4, 4))
    assert torch.all(scale > 0)
    back = formats.dequantize_weight(q, scale, (4, 4) if granularity == "block" else None)
    assert torch.equal(back, torch.zeros(7, 9))


@pytest.mark.parametrize("granularity", ["tensor", "token", "group"])
def test_zero_activation_gives_zeros(granularity):
    x = torch.zeros(3, 200)
    q, scale = formats.quantize_activation(x, torch.float8_e4m3fn, granularity)
    assert torch.equal(formats.dequantize_activation(q, scale), x)


def test_block_tail_blocks_are_partial():
    w = torch.randn(130, 260)
    w[128:, 256:] *= 1000  # the tail block alone holds large values
    q, scale = formats.quantize_weight(w, torch.float8_e4m3fn, "block", (128, 128))
    assert tuple(scale.shape) == (2, 3)
    assert math.isclose(scale[1, 2].item(), w[128:, 256:].abs().max().item() / 448, rel_tol=1e-6)
    assert math.isclose(scale[0, 0].item(), w[:128, :128].abs().max().item() / 448, rel_tol=1e-6)
    back = formats.dequantize_weight(q, scale, (128, 128))
    assert formats.sqnr(w[:128, :128], back[:128, :128]) > 28


@pytest.mark.parametrize("granularity", ["tensor", "token", "group", "token-mse"])
def test_activation_scales_shapes_and_sqnr(granularity):
    x = torch.randn(5, 300, dtype=torch.float64)
    q, scale = formats.quantize_activation(x, torch.float8_e4m3fn, granularity)
    assert tuple(scale.shape) == {"tensor": (1,), "token": (5, 1), "group": (5, 3), "token-mse": (5, 1)}[granularity]
    assert formats.sqnr(x, formats.dequantize_activation(q, scale, torch.float64)) >= 28


def test_group_scale_covers_128_columns():
    x = torch.ones(2, 260)
    x[:, 256:] = 8.0
    _, scale = formats.quantize_activation(x, torch.float8_e4m3fn, "group")
    assert torch.allclose(scale, torch.tensor([[1.0, 1.0, 8.0]] * 2) / 448)


@pytest.mark.parametrize("granularity", ["token", "group", "token-mse"])
def test_non_finite_activation_spoils_only_its_row(granularity):
    x = torch.randn(4, 256)
    x[2, 5] = float("inf")
    x[3, 7] = float("nan")
    q, scale = formats.quantize_activation(x, torch.float8_e4m3fn, granularity)
    back = formats.dequantize_activation(q, scale)
    assert torch.isfinite(back[:2]).all()
    assert torch.isnan(back[2, 5]) and torch.isnan(back[3, 7])


def _row_errors(x, scale, dtype):
    """float64 squared quantize-dequantize error of each row of x at its [M, 1] scale."""
    values = formats.fp8_to_float(formats.quantize_with_scale(x, scale, dtype)).double() * scale.double()
    return (values - x.double()).square().sum(-1)


@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz"])
def test_token_mse_picks_the_least_error_candidate(name):
    """Against every candidate's error in float64: the chosen one is the least (up to the float32 terms' rounding),
    never above amax / fmax's, and lower on average on data with outliers."""
    dtype = formats.fp8_dtype(name)
    torch.manual_seed(1)
    x = torch.randn(64, 577) * torch.logspace(-9, 3, 64)[:, None]  # includes rows in the FP8 subnormal range
    x[:, :4] *= 30.0  # outlier channels, as LLM activations have
    q, scale = formats.quantize_activation(x, dtype, "token-mse")
    base = formats.scale_from_amax(formats.activation_amax(x, "token"), dtype)
    factors = torch.tensor(formats.TOKEN_MSE_FACTORS)
    assert factors[0] == 1.0 and (factors[1:] > factors[:-1]).all() and factors[-1] < 2.0
    assert (scale >= base).all() and (scale < 2 * base).all()
    errors = torch.stack([_row_errors(x, base * f, dtype) for f in formats.TOKEN_MSE_FACTORS], dim=-1)
    chosen = _row_errors(x, scale, dtype)
    assert (chosen <= errors.amin(-1) * (1 + 1e-6)).all()
    assert (chosen <= errors[:, 0] * (1 + 1e-6)).all()
    assert chosen.sum() < 0.9 * errors[:, 0].sum()
    # q is the plain saturating cast at the chosen scale
    assert torch.equal(q.view(torch.uint8), formats.quantize_with_scale(x, scale, dtype).view(torch.uint8))


def test_token_mse_exact_rows_keep_the_amax_scale():
    x = torch.zeros(3, 16)
    x[1, 3] = 5.0  # one value: exact at every candidate
    _, scale = formats.quantize_activation(x, torch.float8_e4m3fn, "token-mse")
    assert torch.equal(scale, formats.scale_from_amax(formats.activation_amax(x, "token"), torch.float8_e4m3fn))


def test_non_finite_activation_does_not_spoil_per_tensor_scale():
    x = torch.randn(4, 64)
    x[1, 1] = float("inf")
    q, scale = formats.quantize_activation(x, torch.float8_e4m3fn, "tensor")
    assert torch.isfinite(scale).all()
    back = formats.dequantize_activation(q, scale)
    assert torch.isfinite(back[0]).all() and torch.isnan(back[1, 1])


@pytest.mark.parametrize("name", list(FP8))
def test_lookup_table_matches_torch_cast(name):
    codes = torch.arange(256, dtype=torch.uint8).view(FP8[name])
    table = formats.fp8_to_float(codes)
    cast = codes.to(torch.float32)
    assert torch.equal(torch.isnan(table), torch.isnan(cast))
    finite = ~torch.isnan(cast)
    assert torch.equal(table[finite], cast[finite])


# Special codes of each format: e4m3fn has NaN at 0x7f/0xff and no Inf; e5m2 IEEE-style +-Inf and 6 NaNs;
# e4m3fnuz one NaN (0x80, the "negative zero" code) and no Inf.
SPECIAL_CODES = {"e4m3fn": (2, 0), "e5m2": (6, 2), "e4m3fnuz": (1, 0)}


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(FP8))
def test_fp8_to_float_traces_and_matches_the_table(name, out_dtype):
    """Under torch.compile the table (a real tensor, which a graph cannot hold) gives way to the exact cast."""
    import torch._dynamo

    codes = torch.arange(256, dtype=torch.uint8).view(FP8[name])
    eager = formats.fp8_to_float(codes, out_dtype)
    graphs = []

    def backend(graph_module, example_inputs):
        graphs.append(graph_module.graph)
        return graph_module.forward

    torch._dynamo.reset()
    try:
        compiled = torch.compile(formats.fp8_to_float, fullgraph=True, backend=backend)(codes, out_dtype)
    finally:
        torch._dynamo.reset()
    # The graph's only tensor is the codes: no table captured (inside a tensor subclass's handler that fails).
    (graph,) = graphs
    assert [node.op for node in graph.nodes if node.op in ("placeholder", "get_attr")] == ["placeholder"]
    assert compiled.dtype == eager.dtype == out_dtype
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0, equal_nan=True)
    nans, infs = SPECIAL_CODES[name]
    assert int(eager.isnan().sum()) == nans and int(eager.isinf().sum()) == infs
    assert float(eager[torch.isfinite(eager)].abs().max()) == formats.fp8_max(FP8[name])


def test_bad_names_raise():
    with pytest.raises(ValueError, match="unknown FP8 dtype"):
        formats.fp8_dtype("float8_e3m4")
    with pytest.raises(TypeError, match="not an FP8 dtype"):
        formats.fp8_dtype(torch.float16)
    with pytest.raises(ValueError, match="unknown weight scale granularity"):
        formats.quantize_weight(torch.randn(4, 4), granularity="row")
    with pytest.raises(ValueError, match="block_size"):
        formats.quantize_weight(torch.randn(4, 4), granularity="block", block_size=(0, 4))
    with pytest.raises(ValueError, match="2-D"):
        formats.quantize_weight(torch.randn(4))


def test_sqnr():
    x = torch.randn(100, dtype=torch.float64)
    assert formats.sqnr(x, x) == math.inf
    assert abs(formats.sqnr(x, x * 1.1) - 20.0) < 1e-9


@pytest.mark.parametrize("block_size", [(10**9, 10**9), (10**9, 16), (8, 10**9)], ids=["both", "rows", "columns"])
def test_a_block_larger_than_the_weight_is_the_weight_sized_block(block_size):
    """The amax and scale broadcast padded the weight to the whole block grid: at (10^6, 10^6) a 64 x 128 weight
    asked for 4e12 bytes, at 65536 it took 17 GB. A side beyond the weight is the weight's side: same grid."""
    w = torch.randn(64, 128)
    fitted = (min(block_size[0], 64), min(block_size[1], 128))
    q, scale = formats.quantize_weight(w, granularity="block", block_size=block_size)
    q_fitted, scale_fitted = formats.quantize_weight(w, granularity="block", block_size=fitted)
    assert scale.shape == scale_fitted.shape == formats.block_scale_shape((64, 128), block_size)
    assert torch.equal(scale, scale_fitted) and torch.equal(q.view(torch.uint8), q_fitted.view(torch.uint8))
    w_hat = formats.dequantize_weight(q, scale, block_size)
    assert formats.sqnr(w.double(), w_hat) > 28
