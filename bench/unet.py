"""Convolutions and a diffusers UNet forward on CPU: qfp8's FP8 layers against the bf16 model.

Two sections, each measured interleaved round by round in one process, with
medians and the ratio bf16 time / qfp8 time (above 1: qfp8 is faster):

- ``conv``: single ``nn.Conv2d`` layers of a Stable-Diffusion-style UNet
  (bf16 ``F.conv2d`` against ``QConv2d``, W8A16), for a contiguous (NCHW)
  input and a channels-last one (what a QConv2d gives the next layer when its
  own input was channels-last).
- ``unet``: a ``UNet2DConditionModel`` built from a config (random weights),
  its whole forward in bf16 against the same model after ``qfp8.quantize``
  (every Linear and Conv2d FP8, W8A16), and the bytes of their state dicts.

    python bench/unet.py                       # medium UNet, 1 thread
    python bench/unet.py --quick --json out.json   # CI: tiny shapes, seconds
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch
from provenance import collect  # bench/provenance.py, beside this script

import qfp8
from qfp8.nn.conv import quantize_convolution
from qfp8.nn.scheme import QuantizationScheme

# (in_channels, out_channels, kernel, stride, spatial): a 512x512 SD UNet's 64x64 latent, scaled down.
CONV_SHAPES = [
    (320, 320, 3, 1, 32),
    (320, 640, 3, 1, 16),
    (640, 640, 3, 2, 16),
    (640, 320, 1, 1, 32),
    (4, 320, 3, 1, 32),
]
QUICK_CONV_SHAPES = [(32, 64, 3, 1, 16), (64, 32, 1, 1, 16)]

UNETS = {
    "medium": dict(
        sample_size=32,
        layers_per_block=2,
        block_out_channels=(128, 256, 256),
        cross_attention_dim=256,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=8,
    ),  # fmt: skip
    "tiny": dict(
        sample_size=16,
        layers_per_block=1,
        block_out_channels=(32, 64),
        cross_attention_dim=32,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=8,
        norm_num_groups=16,
    ),  # fmt: skip
}


def interleaved(methods: dict, rounds: int) -> dict[str, float]:
    """Median seconds per call of each method, the methods called in turn each round (after one warm-up call)."""
    times = {name: [] for name in methods}
    for fn in methods.values():
        fn()
    for _ in range(rounds):
        for name, fn in methods.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


@torch.no_grad()
def conv_rows(shapes, rounds: int) -> list[dict]:
    rows = []
    for cin, cout, kernel, stride, size in shapes:
        conv = torch.nn.Conv2d(cin, cout, kernel, stride=stride, padding=kernel // 2).to(torch.bfloat16)
        qconv = quantize_convolution(conv, QuantizationScheme(), "conv")
        x = torch.randn(1, cin, size, size, dtype=torch.bfloat16)
        x_last = x.contiguous(memory_format=torch.channels_last)
        medians = interleaved(
            {
                "bf16": lambda conv=conv, x=x: conv(x),
                "qfp8": lambda qconv=qconv, x=x: qconv(x),
                "qfp8_channels_last": lambda qconv=qconv, x_last=x_last: qconv(x_last),
            },
            rounds,
        )
        rows.append(
            {
                "shape": f"{cin}->{cout} k{kernel} s{stride} {size}x{size}",
                "kernel": qconv.packing,
                **{f"{name}_ms": value * 1e3 for name, value in medians.items()},
                "ratio": medians["bf16"] / medians["qfp8"],
                "ratio_channels_last": medians["bf16"] / medians["qfp8_channels_last"],
            }
        )
    return rows


@torch.no_grad()
def unet_row(size: str, rounds: int) -> dict:
    from diffusers import UNet2DConditionModel

    config = UNETS[size]
    torch.manual_seed(0)
    model = UNet2DConditionModel(in_channels=4, out_channels=4, **config).eval()
    torch.nn.Module.to(model, torch.bfloat16)  # not ModelMixin.to, which warns about modules this UNet lacks
    quantized = copy.deepcopy(model)
    _, report = qfp8.quantize(quantized)
    sample = torch.randn(1, 4, config["sample_size"], config["sample_size"], dtype=torch.bfloat16)
    context = torch.randn(1, 77, config["cross_attention_dim"], dtype=torch.bfloat16)
    timestep = torch.tensor([500])
    reference = model(sample, timestep, context).sample.double()
    error = (reference - quantized(sample, timestep, context).sample.double()).norm()
    medians = interleaved(
        {"bf16": lambda: model(sample, timestep, context), "qfp8": lambda: quantized(sample, timestep, context)}, rounds
    )
    weights_mb = {
        name: sum(t.numel() * t.element_size() for t in m.state_dict().values()) / 2**20
        for name, m in (("bf16", model), ("qfp8", quantized))
    }
    convolutions = sum(1 for e in report.quantized if "conv" in type(quantized.get_submodule(e.name)).__name__.lower())
    return {
        "unet": size,
        "config": config,
        "quantized_layers": len(report.quantized),
        "quantized_convolutions": convolutions,
        "skipped_layers": len(report.skipped),
        "sqnr_db": float(20 * torch.log10(reference.norm() / error)),
        "bf16_ms": medians["bf16"] * 1e3,
        "qfp8_ms": medians["qfp8"] * 1e3,
        "ratio": medians["bf16"] / medians["qfp8"],
        "bf16_weights_mb": weights_mb["bf16"],
        "qfp8_weights_mb": weights_mb["qfp8"],
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes and UNet, few rounds (CI)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 7, --quick 3)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rounds = args.rounds or (3 if args.quick else 7)
    convs = conv_rows(QUICK_CONV_SHAPES if args.quick else CONV_SHAPES, rounds)
    unet = unet_row("tiny" if args.quick else "medium", rounds)
    result = {"provenance": collect(), "rounds": rounds, "conv": convs, "unet": unet}
    print(f"{'conv (bf16 input NCHW)':32} {'bf16 ms':>9} {'qfp8 ms':>9} {'ratio':>6} {'qfp8 CL ms':>11} {'ratio':>6}")
    for row in convs:
        print(
            f"{row['shape']:32} {row['bf16_ms']:9.3f} {row['qfp8_ms']:9.3f} {row['ratio']:6.2f} "
            f"{row['qfp8_channels_last_ms']:11.3f} {row['ratio_channels_last']:6.2f}"
        )
    print(
        f"UNet2DConditionModel ({unet['unet']}, {unet['quantized_layers']} FP8 layers, "
        f"{unet['quantized_convolutions']} of them convolutions): bf16 {unet['bf16_ms']:.1f} ms, "
        f"qfp8 {unet['qfp8_ms']:.1f} ms, ratio {unet['ratio']:.2f}, SQNR {unet['sqnr_db']:.1f} dB; weights "
        f"{unet['bf16_weights_mb']:.1f} MB bf16, {unet['qfp8_weights_mb']:.1f} MB qfp8"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
