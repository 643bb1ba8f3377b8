import pytest
import torch
from torch import nn

import qfp8
from qfp8 import formats
from qfp8.library import cpu
from qfp8.nn import QLinear, QuantizationScheme

WEIGHTS = ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz"]
WEIGHT_SCALES = ["tensor", "channel", "block"]
ACTIVATIONS = [
    (None, "token"),
    ("dynamic", "token"),
    ("dynamic", "tensor"),
    ("dynamic", "group"),
    ("dynamic", "token-mse"),
    ("static", "tensor"),
]
ACTIVATION_IDS = ["a-none", "a-token", "a-tensor", "a-group", "a-token-mse", "a-static"]
# SQNR floors of a layer's output against float64: FP8 rounding of the weight
# alone costs about 31 dB (e4m3) / 25 dB (e5m2); quantizing the activation too
# costs about 3 dB more.
FLOOR_DB = {("e4m3", False): 25.0, ("e4m3", True): 22.0, ("e5m2", False): 20.0, ("e5m2", True): 19.0}


def make_linear(k=200, n=96, dtype=torch.float32):
    linear = nn.Linear(k, n).to(dtype)
    return linear


@pytest.mark.parametrize("activations", ACTIVATIONS, ids=ACTIVATION_IDS)
@pytest.mark.parametrize("weight_scale", WEIGHT_SCALES, ids=[f"w-{s}" for s in WEIGHT_SCALES])
@pytest.mark.parametrize("weights", WEIGHTS, ids=[w.replace("float8_", "") for w in WEIGHTS])
def test_output_sqnr_every_scheme(weights, weight_scale, activations):
    linear = make_linear()
    x = torch.randn(4, 7, 200)
    ref = x.double() @ linear.weight.double().t() + linear.bias.double()
    model = nn.Sequential(linear)
    qfp8.quantize(model, weights, weight_scale, activations[0], activations[1], exclude=(), block_size=(32, 64))
    if activations[0] == "static":
        with qfp8.calibrate(model):
            model(x)
    qfp8.freeze(model)
    y = model(x)
    assert y.shape == (4, 7, 96) and y.dtype == torch.float32
    family = "e5m2" if "e5m2" in weights else "e4m3"
    assert formats.sqnr(ref, y) >= FLOOR_DB[(family, activations[0] is not None)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_model(dtype):
    linear = make_linear(dtype=dtype)
    x = torch.randn(3, 200, dtype=dtype)
    ref = x.double() @ linear.weight.double().t() + linear.bias.double()
    model, _ = qfp8.quantize(nn.Sequential(linear), exclude=())
    y = model(x)
    assert y.dtype == dtype and formats.sqnr(ref, y) > 24


def test_state_dict_uses_compressed_tensors_names():
    model = nn.Sequential(make_linear())
    qfp8.quantize(model, weight_scale="block", activations="static", exclude=())
    with qfp8.calibrate(model):
        model(torch.randn(2, 200))
    sd = model.state_dict()
    assert set(sd) == {"0.weight", "0.weight_scale", "0.input_scale", "0.bias"}
    assert sd["0.weight"].dtype == torch.float8_e4m3fn and tuple(sd["0.weight"].shape) == (96, 200)
    assert sd["0.weight_scale"].dtype == torch.float32 and tuple(sd["0.weight_scale"].shape) == (1, 2)
    assert tuple(sd["0.input_scale"].shape) == (1,)


def test_state_dict_round_trip_into_skeleton():
    model = nn.Sequential(make_linear())
    qfp8.quantize(model, activations="static", exclude=())
    x = torch.randn(5, 200)
    with qfp8.calibrate(model):
        model(x)
    scheme = model[0].scheme
    skeleton = nn.Sequential(QLinear(200, 96, scheme=scheme, device="meta"))
    skeleton.load_state_dict(model.state_dict(), assign=True)
    assert torch.equal(skeleton(x), model(x))
    assert torch.equal(skeleton[0].canonical_weight().view(torch.uint8), model[0].canonical_weight().view(torch.uint8))


def test_load_state_dict_reports_wrong_shapes():
    model = nn.Sequential(QLinear(200, 96, scheme=QuantizationScheme()))
    bad = {"0.weight": torch.zeros(96, 199, dtype=torch.float8_e4m3fn), "0.weight_scale": torch.ones(96, 1)}
    bad["0.bias"] = torch.zeros(96)
    with pytest.raises(RuntimeError, match=r"0\.weight: expected .*\[96, 200\], got .*\[96, 199\]"):
        model.load_state_dict(bad)


def test_model_dtype_change_keeps_fp8_and_float32_scales():
    model = nn.Sequential(make_linear())
    qfp8.quantize(model, activations="static", exclude=())
    with qfp8.calibrate(model):
        model(torch.randn(2, 200))
    before = model[0].canonical_weight().view(torch.uint8).clone()
    model.to(torch.bfloat16)
    layer = model[0]
    assert layer.qweight.dtype == torch.float8_e4m3fn
    assert layer.weight_scale.dtype == torch.float32 and layer.input_scale.dtype == torch.float32
    assert layer.bias.dtype == torch.bfloat16 and layer.weight.dtype == torch.bfloat16
    assert torch.equal(layer.canonical_weight().view(torch.uint8), before)
    assert model(torch.randn(2, 200, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_uncalibrated_static_layer_says_what_to_do():
    model = nn.Sequential(make_linear())
    qfp8.quantize(model, activations="static", exclude=())
    with pytest.raises(RuntimeError, match="never calibrated.*qfp8.calibrate"):
        model(torch.randn(2, 200))


@pytest.mark.parametrize("activations", [None, "static"], ids=["w8a16", "static"])
@pytest.mark.parametrize(
    ("x", "error", "match"),
    [
        (torch.randn(2, 199), ValueError, r"the input has shape \(2, 199\), its last dimension must be 200"),
        (torch.randint(0, 5, (2, 200)), TypeError, "the input must be a floating-point tensor"),
    ],
    ids=["features", "integer"],
)
def test_bad_input_during_calibration_gets_the_layers_error(activations, x, error, match):
    model = nn.Sequential(make_linear())
    qfp8.quantize(model, activations=activations, exclude=())
    with pytest.raises(error, match=r"QLinear\(in_features=200.*" + match):
        model(x)
    with pytest.raises(error, match=r"QLinear\(in_features=200.*" + match), qfp8.calibrate(model):
        model(x)


def test_weight_property_is_fp8_tensor():
    model, _ = qfp8.quantize(nn.Sequential(make_linear()), exclude=())
    w = model[0].weight
    assert isinstance(w, qfp8.Float8WeightTensor) and w.shape == (96, 200)
    x = torch.randn(2, 200)
    assert torch.allclose(nn.functional.linear(x, w, model[0].bias), model(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("activations", ACTIVATIONS, ids=ACTIVATION_IDS)
def test_compile_fullgraph_two_layer_mlp_matches_eager(activations):
    torch._dynamo.reset()
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 32))
    qfp8.quantize(model, activations=activations[0], activation_scale=activations[1], exclude=())
    x = torch.randn(3, 64)
    if activations[0] == "static":
        with qfp8.calibrate(model):
            model(x)
    qfp8.freeze(model)
    compiled = torch.compile(model, fullgraph=True)
    eager = model(x)
    assert torch.allclose(compiled(x), eager, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("activations", [None, "dynamic", "static"])
def test_plain_pickle_round_trip(activations):
    """pickle (multiprocessing, joblib) of a quantized model; torch cannot unpickle a bare float8 tensor."""
    import pickle

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 24), nn.Linear(24, 8, bias=False))
    qfp8.quantize(model, activations=activations)
    x = torch.randn(3, 16)
    if activations == "static":
        with qfp8.calibrate(model):
            model(x)
    copy_ = pickle.loads(pickle.dumps(model))
    assert [m.qweight.dtype for m in copy_] == [m.qweight.dtype for m in model]
    assert [m.packing for m in copy_] == [m.packing for m in model]
    assert torch.equal(copy_(x), model(x))


def test_state_made_under_inference_mode_is_usable_with_autograd():
    """quantize, calibrate and load_state_dict under torch.inference_mode, then a forward and backward outside."""
    torch.manual_seed(0)

    def build():
        model = nn.Sequential(nn.Linear(16, 24), nn.Linear(24, 8))
        with torch.inference_mode():
            qfp8.quantize(model, activations="static")
        return model

    model = build()
    with torch.inference_mode(), qfp8.calibrate(model):
        model(torch.randn(4, 16))
    copy_ = build()
    with torch.inference_mode():
        qfp8.load_state_dict(copy_, model.state_dict())
    for m in (model, copy_):
        assert not [name for name, t in m.state_dict().items() if t.is_inference()]
        x = torch.randn(3, 16, requires_grad=True)
        m(x).sum().backward()
        assert x.grad is not None and torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0


@pytest.mark.parametrize("batch", ["empty", "all-nan", "all-zero"], ids=str)
def test_calibration_batch_without_a_finite_nonzero_value_sets_no_scale(batch):
    """Such a batch measures nothing: the layer stays uncalibrated (freeze names it) instead of taking eps / fmax,
    where every real input would saturate (a layer behind a dead ReLU sees only zeros)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32))
    qfp8.quantize(model, activations="static")
    x = {"empty": torch.randn(0, 64), "all-nan": torch.full((2, 64), float("nan")), "all-zero": torch.zeros(2, 64)}[
        batch
    ]
    with qfp8.calibrate(model):
        model(x)
    assert model[0].input_scale is None
    with pytest.raises(RuntimeError, match=r"never calibrated \(0\).*saw only zeros or non-finite inputs"):
        qfp8.freeze(model)
    calibration = torch.randn(8, 64)
    with qfp8.calibrate(model):  # a later batch with finite values calibrates as usual; the bad one adds nothing
        model(x)
        model(calibration)
        model(x)
    amax = calibration.abs().max()
    assert torch.equal(model[0].input_scale, formats.scale_from_amax(amax.reshape(1), torch.float8_e4m3fn))


@pytest.mark.parametrize("activations", [None, "dynamic"])
def test_an_fp8_activation_input_takes_the_subclass_route(activations):
    """An nn.Linear took a Float8ActivationTensor (F.linear's handler); the QLinear replacing it takes it too."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32))
    x = qfp8.Float8ActivationTensor.quantize(torch.randn(4, 64))
    reference = model(x).double()
    qfp8.quantize(model, activations=activations)
    want = nn.functional.linear(x, model[0].weight, model[0].bias)
    for _ in range(2):  # the regular path arms the fast path, which must hand the input back
        got = model(x)
        assert type(got) is torch.Tensor and torch.equal(got, want)
    assert formats.sqnr(reference, got.double()) > 25  # only the weight's FP8 rounding added


@pytest.mark.skipif(
    cpu.cpu_kernel_isa() is None, reason="only the CPU kernel needs a contiguous bias (the reference route takes any)"
)
def test_non_contiguous_bias_is_named():
    model = nn.Sequential(nn.Linear(16, 8))
    qfp8.quantize(model)
    model[0].bias = nn.Parameter(torch.randn(8, 2)[:, 0])
    with pytest.raises(ValueError, match=r"QLinear\(.*\): the bias \(stride \(2,\)\) is not contiguous"):
        model(torch.randn(3, 16))


BAD_STATE = [
    ("weight_scale", lambda layer: torch.ones(5), ValueError, r"weight_scale has shape \(5,\); expected \(8, 1\)"),
    ("weight_scale", lambda layer: layer.weight_scale.double(), TypeError, r"weight_scale is torch.float64"),
    (
        "weight_scale",
        lambda layer: layer.weight_scale.clone().fill_(float("nan")),
        ValueError,
        r"weight_scale holds 8 of 8 .*NaN",
    ),
    ("weight_scale", lambda layer: -layer.weight_scale, ValueError, r"weight_scale holds .*zero or negative"),
    ("weight_scale", lambda layer: None, ValueError, r"weight_scale cannot be None"),
    ("weight_scale", lambda layer: [1.0], TypeError, r"weight_scale must be a tensor, got list"),
    ("bias", lambda layer: nn.Parameter(torch.ones(7)), ValueError, r"bias has shape \(7,\); expected \(8,\)"),
    ("bias", lambda layer: torch.ones(8, dtype=torch.int32), TypeError, r"bias is torch.int32"),
    ("input_scale", lambda layer: torch.tensor([1e-30]), ValueError, r"input_scale holds 1 of 1 value\(s\) below"),
    ("input_scale", lambda layer: torch.tensor([0.0]), ValueError, r"input_scale holds .*zero or negative"),
    (
        "input_scale",
        lambda layer: torch.tensor([0.01], dtype=torch.float16),
        TypeError,
        r"input_scale is torch.float16",
    ),
    ("input_scale", lambda layer: torch.ones(2), ValueError, r"input_scale has shape \(2,\); expected \(1,\)"),
]
BAD_STATE_IDS = [
    "scale-shape",
    "scale-float64",
    "scale-nan",
    "scale-negative",
    "scale-none",
    "scale-list",
    "bias-shape",
    "bias-int",
    "input-scale-tiny",
    "input-scale-zero",
    "input-scale-fp16",
    "input-scale-shape",
]


@pytest.mark.parametrize(("name", "make", "error", "message"), BAD_STATE, ids=BAD_STATE_IDS)
def test_a_bad_scale_or_bias_assigned_is_refused_naming_the_module(name, make, error, message):
    model = nn.Sequential(nn.Linear(16, 8))
    qfp8.quantize(model, activations="static")
    x = torch.randn(3, 16)
    with qfp8.calibrate(model):
        model(x)
    layer = model[0]
    before = layer(x)
    kept = getattr(layer, name)
    with pytest.raises(error, match=r"module '0': QLinear\(16 -> 8\): " + message):
        setattr(layer, name, make(layer))
    assert getattr(layer, name) is kept  # the layer is as it was, and still runs
    assert torch.equal(layer(x), before)


@pytest.mark.parametrize(
    ("name", "value", "error", "message"),
    [
        ("weight_scale", torch.ones(3), ValueError, r"weight_scale has shape \(3,\); expected \(8, 1\)"),
        ("weight_scale", torch.ones(8, 1, dtype=torch.float64), TypeError, r"weight_scale is torch.float64"),
        ("bias", torch.ones(3), ValueError, r"bias has shape \(3,\); expected \(8,\)"),
        ("weight_scale", torch.ones(8, 2)[:, :1], ValueError, r"the weight_scale \(stride \(2, 1\)\) is not contig"),
    ],
    ids=["scale-shape", "scale-float64", "bias-shape", "scale-strided"],
)
@pytest.mark.parametrize("route", ["functional_call", "dict"])
@pytest.mark.skipif(
    cpu.cpu_kernel_isa() is None,
    reason="the reference route computes with any scale that broadcasts; only a kernel refuses these",
)
def test_a_bad_scale_or_bias_that_bypasses_assignment_is_named_when_the_kernel_refuses_it(
    name, value, error, message, route
):
    model = nn.Sequential(nn.Linear(16, 8))
    qfp8.quantize(model)
    x = torch.randn(3, 16)
    with pytest.raises(error, match=r"module '0': QLinear\(16 -> 8\): " + message):
        if route == "functional_call":
            torch.func.functional_call(model, {f"0.{name}": value}, (x,))
        else:
            (model[0]._parameters if name == "bias" else model[0]._buffers)[name] = value
            model(x)


@pytest.mark.parametrize("accuracy", [None, "gptq"])
def test_a_batch_refused_during_calibration_leaves_the_calibration_as_it_was(accuracy):
    model = nn.Sequential(make_linear())
    qfp8.quantize(model, activations="static", accuracy=accuracy, exclude=())
    accepted = torch.randn(8, 200)
    with qfp8.calibrate(model):
        model(accepted)
        with pytest.raises(TypeError, match=r"QLinear\(in_features=200.*floating-point"):
            model(torch.randint(0, 1000, (4, 200), dtype=torch.int32))
        with pytest.raises(TypeError, match=r"QLinear\(in_features=200.*must be a tensor"):
            model([1.0] * 200)
        if accuracy:
            assert model[0]._calibration_rows == 8
    want = formats.scale_from_amax(accepted.abs().max().reshape(1), torch.float8_e4m3fn)
    assert torch.equal(model[0].input_scale, want)
