"""The import-time self-check of the CPU kernel variant (qfp8.library.cpu.verify_cpu_kernel_isa)."""

import subprocess
import sys

import pytest
import torch

from qfp8 import formats
from qfp8.library import cpu
from tests.isas import ISA_PARAMS

pytestmark = pytest.mark.skipif(cpu.cpu_kernel_isa() is None, reason="the qfp8 CPU extension is not built")


@pytest.mark.parametrize("isa", ISA_PARAMS)
def test_every_usable_variant_passes_and_the_selection_is_restored(isa):
    before = cpu.cpu_kernel_isa()
    assert cpu.verify_cpu_kernel_isa(isa) is None
    assert cpu.cpu_kernel_isa() == before


def test_cases_reach_every_path():
    cases = cpu._self_check_cases()
    pairs = {(x.shape[0], activation) for x, *_, activation, _ in cases}
    assert pairs == {(m, a) for m in (1, 3, 9) for a in cpu.ACTIVATION_MODES}
    assert {dtype for *_, dtype in cases} == set(formats.FP8_DTYPES.values())
    assert {x.dtype for x, *_ in cases} == {torch.float32, torch.bfloat16, torch.float16}
    assert {tuple(case[5]) for case in cases} == {(), (16, 10), (16, 5)}  # even and odd k blocks
    assert {case[2].numel() for case in cases if not case[5]} == {1, 45}  # tensor and channel scales
    assert any(case[3] is None for case in cases) and any(case[3] is not None for case in cases)


def _kernel_with(monkeypatch, corrupt):
    real = cpu._kernel_op

    def wrong(*args):
        return corrupt(args[0], real(*args))

    monkeypatch.setattr(cpu, "_kernel_op", wrong)


def test_a_wrong_lane_in_one_path_is_caught(monkeypatch):
    def swap_two_channels_in_the_panel(x, y):  # a lane bug of the M > 4 path only
        if x.shape[0] == 9:
            y = y.clone()
            y[:, [3, 40]] = y[:, [40, 3]]
        return y

    _kernel_with(monkeypatch, swap_two_channels_in_the_panel)
    problem = cpu.verify_cpu_kernel_isa(cpu.cpu_kernel_isa())
    assert problem is not None and problem.startswith("M=9, N=45, K=37") and "relative error" in problem


def test_a_nan_output_or_an_exception_is_caught(monkeypatch):
    _kernel_with(monkeypatch, lambda x, y: y.index_fill(-1, torch.tensor([0]), float("nan")))
    assert "relative error nan" in cpu.verify_cpu_kernel_isa(cpu.cpu_kernel_isa())

    def raises(x, y):
        raise RuntimeError("illegal instruction emulated")

    _kernel_with(monkeypatch, raises)
    assert "raised RuntimeError: illegal instruction emulated" in cpu.verify_cpu_kernel_isa(cpu.cpu_kernel_isa())


def test_a_failing_variant_steps_down_with_one_warning(monkeypatch):
    best = cpu.cpu_kernel_isa()
    usable = cpu.usable_isas()
    if len(usable) < 2:
        pytest.skip(f"only {usable} runs here: there is no variant to step down to")
    checked = []

    def fails_for_best(isa):
        checked.append(isa)
        return "M=1: relative error 1 against the reference op" if isa == best else None

    monkeypatch.setattr(cpu, "verify_cpu_kernel_isa", fails_for_best)
    try:
        with pytest.warns(RuntimeWarning, match=f"the {best} CPU kernel disagrees .* using {usable[1]} instead"):
            assert cpu._use_verified_isa() is True
        assert cpu.cpu_kernel_isa() == usable[1] and checked == [best, usable[1]]
    finally:
        torch.ops.qfp8._cpu_set_isa(best)


def test_no_passing_variant_means_no_cpu_kernel(monkeypatch):
    best = cpu.cpu_kernel_isa()
    monkeypatch.setattr(cpu, "verify_cpu_kernel_isa", lambda isa: "wrong")
    try:
        with pytest.warns(RuntimeWarning) as records:
            assert cpu._use_verified_isa() is False
        assert len(records) == len(cpu.usable_isas()[cpu.usable_isas().index(best) :])
        assert "using the reference op (no CPU kernel) instead" in str(records[-1].message)
    finally:
        torch.ops.qfp8._cpu_set_isa(best)


def test_a_fresh_import_verifies_the_best_variant_without_a_warning():
    code = (
        "import warnings; warnings.simplefilter('always')\n"
        "from qfp8.library import cpu\n"
        "print(cpu.KERNEL_VERIFIED, cpu.cpu_kernel_isa())"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", cpu.usable_isas()[0]]
    assert "disagrees" not in result.stderr


def test_the_emulated_avx512_variant_is_never_chosen_automatically():
    assert not set(cpu.EMULATED_ISAS) & set(cpu.usable_isas() + cpu.compiled_isas())
    assert cpu.cpu_kernel_isa() in cpu.usable_isas()
    with pytest.raises(ValueError, match="unknown CPU kernel ISA"):
        cpu.set_cpu_kernel_isa("avx512emu2")


@pytest.mark.parametrize("defaults", ["torch.set_default_dtype(torch.float64)", "torch.set_default_device('meta')"])
def test_import_under_user_defaults_keeps_the_kernel(defaults):
    """The check (and the module-level tables) make their own CPU float32 tensors, whatever the defaults."""
    code = (
        f"import torch; {defaults}\n"
        "import warnings; warnings.simplefilter('always')\n"
        "import qfp8\n"
        "from qfp8 import formats\n"
        "from qfp8.library import cpu\n"
        "print(cpu.KERNEL_VERIFIED, cpu.cpu_kernel_isa(), formats.dequantize_table(torch.float8_e4m3fn).device)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", cpu.usable_isas()[0], "cpu"]
