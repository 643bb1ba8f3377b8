"""QConv1d / QConv2d against float64 convolutions, their state dicts and errors (see qfp8/nn/conv.py)."""

import copy
import pickle

import pytest
import torch
from torch import nn

import qfp8
from qfp8 import formats
from qfp8.nn.conv import QConv1d, QConv2d, linear_from_conv1d, quantize_convolution
from qfp8.nn.scheme import QuantizationScheme
from tests.conftest import sqnr

SCHEMES = {
    "w-channel": QuantizationScheme.from_args(),
    "w-tensor": QuantizationScheme.from_args(weight_scale="tensor"),
    "w-block16": QuantizationScheme.from_args(weight_scale="block", block_size=(16, 16)),
    "w-e5m2": QuantizationScheme.from_args(weights="float8_e5m2"),
    "a-token": QuantizationScheme.from_args(activations="dynamic"),
    "a-tensor": QuantizationScheme.from_args(activations="dynamic", activation_scale="tensor"),
}

# Shapes a UNet or an audio model has, and the odd ones: stride, dilation, asymmetric kernels, string padding,
# padding modes, grouped and depthwise convolutions, no bias.
CONV2D = {
    "3x3-pad1": dict(in_channels=6, out_channels=10, kernel_size=3, padding=1),
    "1x1": dict(in_channels=7, out_channels=12, kernel_size=1),
    "3x2-stride-dilation": dict(
        in_channels=5, out_channels=9, kernel_size=(3, 2), stride=(2, 1), padding=(1, 0), dilation=(1, 2)
    ),  # fmt: skip
    "same-reflect": dict(in_channels=6, out_channels=8, kernel_size=3, padding="same", padding_mode="reflect"),
    "same-even-kernel": dict(in_channels=4, out_channels=6, kernel_size=4, padding="same", dilation=2),
    "valid-circular": dict(in_channels=3, out_channels=5, kernel_size=3, padding=2, padding_mode="circular"),
    "replicate-no-bias": dict(
        in_channels=6, out_channels=6, kernel_size=3, padding=1, padding_mode="replicate", bias=False
    ),  # fmt: skip
    "stride2": dict(in_channels=8, out_channels=16, kernel_size=3, stride=2, padding=1),
    "groups2": dict(in_channels=6, out_channels=10, kernel_size=3, padding=1, groups=2),
    "depthwise": dict(in_channels=8, out_channels=8, kernel_size=3, padding=1, groups=8),
}


def _dequantized_conv(conv: nn.Module, q) -> nn.Module:
    """``conv`` in float64 with the FP8 layer's weight (dequantized, back in PyTorch's order): the oracle of the
    FP8 layer's own arithmetic."""
    reference = copy.deepcopy(conv).double()
    matrix = formats.dequantize_weight(q.canonical_weight(), q.weight_scale, q.scheme.block_size or None)
    with torch.no_grad():
        reference.weight.copy_(q.stored_order(matrix).reshape(conv.weight.shape).double())
    return reference


@pytest.mark.parametrize("scheme", list(SCHEMES.values()), ids=list(SCHEMES))
@pytest.mark.parametrize("shape", list(CONV2D.values()), ids=list(CONV2D))
def test_conv2d_matches_float64(shape, scheme):
    conv = nn.Conv2d(**shape)
    q = quantize_convolution(conv, scheme, "conv")
    assert isinstance(q, QConv2d)
    x = torch.randn(2, shape["in_channels"], 11, 9)
    y = q(x)
    expected = conv.double()(x.double())
    assert y.shape == expected.shape and y.dtype == x.dtype
    # Against the float convolution: FP8 weights (and activations) cost about 30 dB (25 with FP8 activations).
    floor = 20 if "e5m2" in str(scheme.weight_dtype) or scheme.activations else 26
    assert sqnr(expected, y.double()) > floor
    if scheme.activations is None:
        # Against the dequantized weight in float64: only float32 rounding of the products remains.
        assert sqnr(_dequantized_conv(conv, q)(x.double()), y.double()) > 100


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_conv2d_half_inputs(dtype):
    conv = nn.Conv2d(16, 24, 3, padding=1)
    q = quantize_convolution(conv.to(dtype), QuantizationScheme(), "conv")
    x = torch.randn(1, 16, 12, 12, dtype=dtype)
    y = q(x)
    assert y.dtype == dtype and q.packing != "reference"
    assert sqnr(_dequantized_conv(conv, q)(x.double()), y.double()) > 40  # the output's own 16-bit rounding


def test_memory_format_follows_the_input():
    q = quantize_convolution(nn.Conv2d(8, 16, 3, padding=1), QuantizationScheme(), "conv")
    x = torch.randn(2, 8, 10, 10)
    assert q(x).is_contiguous()
    channels_last = x.contiguous(memory_format=torch.channels_last)
    y = q(channels_last)
    assert y.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(y, q(x))


@pytest.mark.parametrize("groups", [1, 3])
def test_conv1d_matches_float64(groups):
    conv = nn.Conv1d(6, 9, kernel_size=5, stride=2, padding=3, dilation=2, groups=groups)
    q = quantize_convolution(conv, QuantizationScheme(), "conv")
    assert isinstance(q, QConv1d)
    x = torch.randn(3, 6, 31)
    y = q(x)
    assert y.shape == conv(x).shape
    assert sqnr(_dequantized_conv(conv, q)(x.double()), y.double()) > 100
    assert sqnr(conv.double()(x.double()), y.double()) > 26
    assert torch.equal(q(x[0]), y[0])  # an unbatched input gives the batch's row


def test_grouped_convolution_names_the_reference_route():
    q = quantize_convolution(nn.Conv2d(8, 8, 3, groups=4), QuantizationScheme(), "conv")
    assert q.packing == "reference" and "groups=4" in q.kernel_notes[0]


def test_static_activations_calibrate():
    for groups in (1, 2):
        conv = nn.Conv2d(4, 8, 3, padding=1, groups=groups)
        model = nn.Sequential(conv)
        qfp8.quantize(model, activations="static")
        x = torch.randn(2, 4, 9, 9)
        with pytest.raises(RuntimeError, match="calibrate"):
            model(x)
        with qfp8.calibrate(model):
            model(x)
        amax = x.abs().max()
        assert torch.allclose(model[0].input_scale, amax / torch.finfo(torch.float8_e4m3fn).max)
        assert sqnr(conv.double()(x.double()), model(x).double()) > 20


def test_gradient_flows_to_the_input():
    conv = nn.Conv2d(4, 6, 3, padding=1)
    q = quantize_convolution(conv, QuantizationScheme(), "conv")
    x = torch.randn(1, 4, 7, 7, requires_grad=True)
    q(x).square().sum().backward()
    reference = _dequantized_conv(conv, q)
    x64 = x.detach().double().requires_grad_()
    reference(x64).square().sum().backward()
    assert sqnr(x64.grad, x.grad.double()) > 40


@pytest.mark.parametrize("scheme", ["w-channel", "w-block16", "a-token"])
def test_state_dict_round_trip(scheme):
    conv = nn.Conv2d(6, 20, (3, 2), padding=1)
    q = quantize_convolution(conv, SCHEMES[scheme], "conv")
    state = q.state_dict()
    # Saved as compressed-tensors' 2-D weight: PyTorch's flattening of the convolution's weight.
    assert state["weight"].shape == (20, 6 * 3 * 2) and state["weight"].dtype == torch.float8_e4m3fn
    flat = conv.weight.detach().reshape(20, -1)
    reference = formats.quantize_weight(flat, torch.float8_e4m3fn, q.scheme.weight_scale, q.scheme.block_size or None)[
        0
    ]
    assert torch.equal(state["weight"].view(torch.uint8), reference.view(torch.uint8))
    fresh = quantize_convolution(nn.Conv2d(6, 20, (3, 2), padding=1), SCHEMES[scheme], "fresh")
    fresh.load_state_dict(state)
    x = torch.randn(1, 6, 8, 8)
    assert torch.equal(fresh(x), q(x))
    model = nn.Sequential(nn.Conv2d(6, 20, (3, 2), padding=1))
    qfp8.quantize(model, **({"activations": "dynamic"} if scheme == "a-token" else {}),
                  **({"weight_scale": "block", "block_size": (16, 16)} if scheme == "w-block16" else {}))  # fmt: skip
    qfp8.load_state_dict(model, {"0." + key: value for key, value in state.items()})
    assert torch.equal(model(x), q(x))


def test_pickle_and_deepcopy_keep_outputs():
    q = quantize_convolution(nn.Conv2d(4, 8, 3, groups=2), QuantizationScheme(), "conv")
    x = torch.randn(1, 4, 6, 6)
    assert torch.equal(pickle.loads(pickle.dumps(q))(x), q(x))
    assert torch.equal(copy.deepcopy(q)(x), q(x))


def test_quantize_takes_convolutions_and_reports_them():
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.SiLU(), nn.Conv2d(8, 8, 3, groups=2), nn.Conv1d(8, 8, 1), nn.Flatten()
    )
    model[3] = nn.Conv2d(8, 4, 1)
    _, report = qfp8.quantize(model, exclude=["3"])
    by_name = {entry.name: entry for entry in report.entries}
    assert by_name["0"].quantized and by_name["0"].in_features == 27 and by_name["0"].kernel.startswith("cpu")
    assert by_name["2"].quantized and by_name["2"].kernel == "reference" and "groups=2" in by_name["2"].reason
    assert "groups=2: the FP8 kernels run one matrix per layer" in str(report)
    assert not by_name["3"].quantized and "excluded" in by_name["3"].reason
    assert isinstance(model[0], QConv2d) and isinstance(model[3], nn.Conv2d)
    assert not report.others  # convolutions have report entries, quantized or not


def test_quantize_skips_convolutions_it_cannot_take_with_the_reason():
    class Custom(nn.Conv2d):
        def forward(self, x):
            return super().forward(x) * 2

    model = nn.Sequential(Custom(3, 4, 3), nn.Conv2d(4, 4, 3, groups=2))
    with pytest.warns(UserWarning, match="nothing was quantized"):
        _, report = qfp8.quantize(model, accuracy="gptq")
    reasons = {entry.name: entry.reason for entry in report.entries}
    assert "own forward" in reasons["0"] and "groups=1" in reasons["1"]


def test_transformers_conv1d_becomes_a_linear():
    transformers = pytest.importorskip("transformers", reason="GPT-2's Conv1D is a transformers class")
    conv1d = transformers.pytorch_utils.Conv1D(12, 10)  # nf (out) = 12, nx (in) = 10: weight [10, 12]
    q = linear_from_conv1d(conv1d, QuantizationScheme(), "c_attn")
    assert (q.in_features, q.out_features) == (10, 12)
    x = torch.randn(3, 10)
    assert sqnr(conv1d.double()(x.double()), q(x).double()) > 26
    with pytest.raises(TypeError, match="Conv1D"):
        linear_from_conv1d(nn.Linear(3, 4), QuantizationScheme())


def test_bad_input_and_arguments_name_the_layer():
    model = nn.Sequential(nn.Conv2d(4, 8, 3))
    qfp8.quantize(model)
    layer = model[0]
    with pytest.raises(ValueError, match=r"module '0'.*expected \[batch, 4"):
        layer(torch.randn(1, 5, 8, 8))
    with pytest.raises(ValueError, match="smaller than the dilated kernel"):
        layer(torch.randn(1, 4, 2, 2))
    with pytest.raises(TypeError, match="floating-point"):
        layer(torch.ones(1, 4, 8, 8, dtype=torch.int64))
    with pytest.raises(ValueError, match="padding='same' needs stride 1"):
        QConv2d(4, 4, 3, stride=2, padding="same")
    with pytest.raises(ValueError, match="groups=3"):
        QConv2d(4, 4, 3, groups=3)
    with pytest.raises(ValueError, match="padding_mode"):
        QConv2d(4, 4, 3, padding_mode="mirror")
    with pytest.raises(ValueError, match="padding_mode='reflect'"):
        quantize_convolution(nn.Conv2d(2, 2, 3, padding=4, padding_mode="reflect"), QuantizationScheme())(
            torch.randn(1, 2, 3, 3)
        )
    bad = nn.Conv2d(2, 2, 3)
    with torch.no_grad():
        bad.weight[0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        quantize_convolution(bad, QuantizationScheme(), "bad")
    with pytest.raises(ValueError, match=r"the model is itself a convolution \(Conv2d\)"):
        qfp8.quantize(nn.Conv2d(2, 2, 3))
    with pytest.raises(TypeError, match="nn.Conv1d or nn.Conv2d"):
        quantize_convolution(nn.ConvTranspose2d(2, 2, 3), QuantizationScheme())


@pytest.mark.parametrize("accuracy", ["scale", "gptq"])
def test_accuracy_modes_lower_the_error_on_calibration_data(accuracy):
    conv = nn.Conv2d(8, 16, 3, padding=1)
    x = torch.randn(8, 8, 12, 12) * torch.linspace(0.1, 3, 8).reshape(1, 8, 1, 1)  # uneven input channels
    expected = conv.double()(x.double())
    nearest = nn.Sequential(copy.deepcopy(conv).float())
    qfp8.quantize(nearest)
    chosen = nn.Sequential(copy.deepcopy(conv).float())
    qfp8.quantize(chosen, accuracy=accuracy)
    with qfp8.calibrate(chosen):
        chosen(x)
    qfp8.freeze(chosen)
    assert not chosen[0].accuracy_pending
    # The weights chosen for these inputs give a smaller output error than round-to-nearest ones.
    assert sqnr(expected, chosen(x).double()) > sqnr(expected, nearest(x).double()) + 0.2


def test_torch_compile_fullgraph_matches_eager():
    torch._dynamo.reset()
    model = nn.Sequential(
        nn.Conv2d(4, 8, 3, padding=1),
        nn.SiLU(),
        nn.Conv2d(8, 8, 1),
        nn.Conv2d(8, 8, 3, groups=2, padding=1, padding_mode="reflect"),
    )
    qfp8.quantize(model)
    x = torch.randn(2, 4, 8, 8)
    assert torch.equal(torch.compile(model, fullgraph=True)(x), model(x))


@torch.no_grad()
def test_gpt2_conv1d_layers_as_linears_save_and_reload(tmp_path):
    transformers = pytest.importorskip("transformers", reason="GPT-2 is a transformers model")
    config = transformers.GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 96, (1, 12))
    expected = model(ids).logits
    scheme = QuantizationScheme()
    for name, module in list(model.named_modules()):
        if type(module).__name__ == "Conv1D":
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent), leaf, linear_from_conv1d(module, scheme, name))
    out = model(ids).logits
    assert sqnr(expected.double(), out.double()) > 20
    qfp8.save_pretrained(model, tmp_path)
    loaded = qfp8.from_pretrained(tmp_path)
    assert type(loaded.transformer.h[0].attn.c_attn).__name__ == "QLinear"
    assert torch.equal(loaded(ids).logits, out)
