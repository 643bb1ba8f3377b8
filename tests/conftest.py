import pytest
import torch

from qfp8 import formats

FP8_IDS = {torch.float8_e4m3fn: "e4m3fn", torch.float8_e5m2: "e5m2", torch.float8_e4m3fnuz: "e4m3fnuz"}
FP8_DTYPES = list(FP8_IDS)


@pytest.fixture
def device():
    return torch.device("cpu")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def sqnr(reference, approximation):
    return formats.sqnr(reference, approximation)
