"""Fused projections (vLLM's qkv_proj, gate_up_proj) with the per-tensor scales qfp8 writes.

vLLM loads q/k/v (and gate/up) into one fused layer. With per-tensor weight
scales it keeps the largest scale and requantizes the other shards to it;
with static activations it keeps the largest input_scale. qfp8 writes one
weight scale per projection (per-channel scales concatenate exactly, so only
the per-tensor scheme is affected) and, since q/k/v (and gate/up) read the
same input, calibration gives them equal input scales.
"""

from __future__ import annotations

import torch

import qfp8
from qfp8 import formats

FUSED = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj"))


def test_fusion_as_vllm_does_changes_output_within_fp8_rounding(tiny):
    model = tiny.model()
    x = tiny.tokens()
    with torch.no_grad():
        reference = model(x).logits
    qfp8.quantize(model, weight_scale="tensor", activations="static")
    with qfp8.calibrate(model):
        model(tiny.tokens(seed=3, batch=4))
    with torch.no_grad():
        unfused = model(x).logits
    for layer in model.model.layers:
        for group in FUSED:
            modules = [layer.get_submodule(name) for name in group]
            input_scales = {m.input_scale.item() for m in modules}
            assert len(input_scales) == 1, group  # same input, same calibrated scale: max() changes nothing
            shared = torch.stack([m.weight_scale for m in modules]).amax(0)
            for m in modules:  # vLLM's requantize_with_max_scale
                values = formats.dequantize_weight(m.canonical_weight(), m.weight_scale)
                q, _ = formats.quantize_weight(values, m.scheme.weight_dtype, "tensor", scale=shared)
                m.load_state_dict({"weight": q, "weight_scale": shared.clone(), "input_scale": m.input_scale})
    with torch.no_grad():
        fused = model(x).logits
    # One extra FP8 rounding of the smaller-scale shards: an error no larger than quantization's own.
    fusion_sqnr, quantization_sqnr = formats.sqnr(unfused, fused), formats.sqnr(reference, unfused)
    assert fusion_sqnr > 20 and fusion_sqnr > quantization_sqnr - 3, (fusion_sqnr, quantization_sqnr)
