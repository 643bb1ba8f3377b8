"""The CPU kernel ISAs the kernel tests run on: every one compiled in (and ``avx512emu``, the AVX512 kernel's code
on AVX2), each skipped with its reason where this CPU or build cannot run it."""

from __future__ import annotations

import pytest

from qfp8.library import cpu


def isa_param(isa: str):
    """``isa`` as a pytest parameter, skipped with the reason where it does not run here."""
    usable = cpu.usable_isas() + cpu.emulated_isas()
    reason = f"this CPU or build does not run the {isa} kernel (usable here: {usable})"
    return pytest.param(isa, id=isa, marks=pytest.mark.skipif(isa not in usable, reason=reason))


ISA_PARAMS = [isa_param(isa) for isa in cpu.ISAS + cpu.EMULATED_ISAS]


def forced(request):
    """The body of an ``isa`` fixture: the parameter's ISA forced while the test runs."""
    with cpu.cpu_kernel_isa_forced(request.param):
        yield request.param
