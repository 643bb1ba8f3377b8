"""Memory around quantizing and loading: weights quantized a band of rows at a time, the file mappings of a
model transformers loaded let go once its Linears are quantized, and the tied table saved a band at a time."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import qfp8
from qfp8 import formats
from qfp8.library import memory
from qfp8.nn import QuantizationScheme
from qfp8.nn.embedding import QEmbedding
from tests import models

transformers = pytest.importorskip("transformers", reason="the mapping test loads a model with transformers")


@pytest.mark.parametrize("shape", [(301, 77), (1000, 1), (1, 5000), (257, 129)])
@pytest.mark.parametrize("granularity, block", [("tensor", None), ("channel", None), ("block", (128, 128)),
                                                ("block", (16, 5)), ("block", (7, 64))])  # fmt: skip
def test_weights_quantized_in_row_bands_are_bitwise_the_whole_weights(monkeypatch, shape, granularity, block):
    torch.manual_seed(0)
    weight = (torch.randn(shape) * torch.logspace(-3, 3, shape[0]).unsqueeze(1)).to(torch.bfloat16)
    whole_q, whole_scale = formats.quantize_weight(weight, granularity=granularity, block_size=block)
    whole_amax = formats.weight_amax(weight, granularity, block)
    monkeypatch.setattr(formats, "WEIGHT_CHUNK_ELEMENTS", 97)  # bands of a few rows
    assert formats._row_bands(weight, block[0] if block else 1) is not None or weight.numel() <= 97
    q, scale = formats.quantize_weight(weight, granularity=granularity, block_size=block)
    assert torch.equal(q.view(torch.uint8), whole_q.view(torch.uint8)) and torch.equal(scale, whole_scale)
    assert torch.equal(formats.weight_amax(weight, granularity, block), whole_amax)
    given, _ = formats.quantize_weight(weight, granularity=granularity, block_size=block, scale=whole_scale)
    assert torch.equal(given.view(torch.uint8), whole_q.view(torch.uint8))
    reference = weight.double()  # the float64 reference: dequantized bands within FP8 rounding of it
    dequantized = formats.dequantize_weight(q, scale, block, torch.float64)
    assert formats.sqnr(reference, dequantized) > 25


@pytest.mark.parametrize("rows, band_rows, align", [(10, 3, 1), (1000, 1024, 128), (3000, 1024, 128), (300, 100, 128),
                                                     (0, 4, 1)])  # fmt: skip
def test_row_bands_cover_every_row_once_in_whole_blocks(rows, band_rows, align):
    bands = formats.row_bands(rows, band_rows, align)
    assert [r for start, stop in bands for r in range(start, stop)] == list(range(rows))
    assert all((stop - start) % align == 0 for start, stop in bands[:-1])  # only the last band ends mid-block
    assert all(stop - start <= max(align, band_rows) for start, stop in bands)


def test_banded_checks_count_every_non_finite_value(monkeypatch):
    monkeypatch.setattr(formats, "WEIGHT_CHUNK_ELEMENTS", 50)
    weight = torch.randn(40, 30, dtype=torch.float64)
    weight[3, 4], weight[39, 29], weight[20, 0] = float("nan"), float("inf"), -float("inf")
    assert formats.nonfinite_count(weight) == 3
    weight = torch.randn(40, 30, dtype=torch.float64)
    weight[17, 3] = -1e300
    assert formats.abs_max(weight).item() == 1e300
    with pytest.raises(ValueError, match="beyond float32's range"):
        qfp8.QLinear.from_weight(weight, None, QuantizationScheme(), "w")


def test_quantizing_a_large_weight_peaks_near_its_fp8_bytes(rss_reader):
    """Bands of rows, not a whole-weight float32 temporary (4x to 6x the bf16 weight's bytes)."""
    script = rss_reader + textwrap.dedent(
        """
        import torch, qfp8
        torch.set_num_threads(1)
        for granularity in ("channel", "block"):
            linear = torch.nn.Linear(4096, 8192, bias=False, dtype=torch.bfloat16)  # 64 MiB
            scheme = qfp8.nn.QuantizationScheme.from_args(weight_scale=granularity)
            qfp8.QLinear.from_linear(linear, scheme)  # warms the allocator and kernels
            open("/proc/self/clear_refs", "w").write("5")
            base = rss("VmRSS:")
            layer = qfp8.QLinear.from_linear(linear, scheme)
            print(granularity, (rss("VmHWM:") - base) / linear.weight.nbytes)
            del layer
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    ratios = dict(line.split() for line in out.stdout.strip().splitlines())
    print(ratios)
    for granularity, ratio in ratios.items():
        assert float(ratio) < 2.0, granularity  # FP8 + its packed copy (1.0x) and a band's temporaries


def test_a_loaded_models_file_mappings_go_once_its_linears_are_quantized(tmp_path):
    """transformers maps the safetensors file; the float tensors left after quantize (norms, a float table) kept
    the mapping, and every page quantize had read from it, resident: 640 MiB beside 321 MiB of FP8 weights."""
    models.tiny_llama(
        dtype=torch.bfloat16, hidden_size=256, intermediate_size=512, vocab_size=1024, tie_word_embeddings=False
    ).save_pretrained(tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    ids = torch.randint(0, 1024, (1, 9))
    with torch.no_grad():
        before = model(ids).logits
    file = str((tmp_path / "model.safetensors").resolve())

    def mapped():
        return [line for line in open("/proc/self/maps") if line.rstrip().endswith(file)]

    if not mapped():
        pytest.skip("this transformers version reads the file instead of mapping it: nothing to let go")
    norm = model.model.norm.weight
    qfp8.quantize(model)
    assert not mapped()
    assert model.model.norm.weight is norm  # the same Parameter, its data copied
    with torch.no_grad():
        assert formats.sqnr(before.double(), model(ids).logits.double()) > 25
    assert memory.copy_out_of_file_mappings(model) == 0  # nothing left to copy


def test_the_tied_table_is_made_a_band_of_rows_at_a_time_with_the_same_bits(monkeypatch):
    model = models.tiny_llama(
        dtype=torch.bfloat16, intermediate_size=96, num_hidden_layers=1, vocab_size=300, tie_word_embeddings=True
    )
    qfp8.quantize(model, exclude=())
    embedding = model.get_input_embeddings()
    assert isinstance(embedding, QEmbedding)
    whole = embedding.table()
    monkeypatch.setattr("qfp8.nn.embedding._CHUNK_VALUES", 7 * 64)  # 7 rows a band
    banded = embedding.table()
    assert banded.dtype == torch.bfloat16 and torch.equal(banded, whole)
    assert torch.equal(whole, model.lm_head.weight.dequantize().to(torch.bfloat16))
