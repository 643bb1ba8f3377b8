import socket

import pytest
import torch

from qfp8 import formats
from tests.models import tiny_llama_config

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


@pytest.fixture
def tiny_llava():
    """A builder of tiny random Llavas (a CLIP tower over a Llama): ``tiny_llava(tie=False, layers=2)``, whose
    transformers-5 module names differ from its checkpoint names."""
    transformers = pytest.importorskip("transformers", reason="builds a transformers model")

    def build(tie: bool = False, layers: int = 2, dtype: torch.dtype = torch.float32):
        text = tiny_llama_config(
            vocab_size=320, intermediate_size=96, num_hidden_layers=layers, tie_word_embeddings=tie
        )
        vision = transformers.CLIPVisionConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
            patch_size=14,
        )  # fmt: skip
        config = transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_index=310)
        torch.manual_seed(0)
        return transformers.LlavaForConditionalGeneration(config).to(dtype).eval()

    return build


@pytest.fixture
def rss_reader() -> str:
    """Python source of ``rss(field)``, a field of /proc/self/status in bytes (``"VmHWM:"``, ``"VmRSS:"``), to
    begin the script a memory test runs in a subprocess with.

    It also fixes glibc's mmap threshold at 128 KiB. glibc raises that threshold after each large free (up to
    32 MiB), after which freed tensors may stay in the heap or go back to the system depending on the order of
    frees, so the same script's peak moved by a third of a 64 MiB weight from run to run (0.25x-2.1x). Fixed,
    each large tensor is returned when freed and the peak is what the code holds."""
    return (
        "import ctypes\n"
        "ctypes.CDLL(None).mallopt(-3, 131072)  # M_MMAP_THRESHOLD\n"
        "def rss(field):\n"
        "    for line in open('/proc/self/status'):\n"
        "        if line.startswith(field):\n"
        "            return int(line.split()[1]) * 1024\n"
    )


def greedy(model, prompt, cache, steps, compiled=False):
    """Eager prefill, then ``steps`` greedy decode steps (compiled with fullgraph if asked)."""
    with torch.no_grad():
        logits = model(prompt, cache=cache, use_cache=True).logits
        token = logits[:, -1:].argmax(-1)

        def step(token, position):
            return model(token, cache=cache, position_ids=position, use_cache=True).logits

        step_fn = torch.compile(step, fullgraph=True) if compiled else step
        tokens, all_logits = [token], []
        for i in range(steps):
            position = torch.full((prompt.shape[0], 1), prompt.shape[1] + i)
            logits = step_fn(token, position)
            all_logits.append(logits)
            token = logits[:, -1:].argmax(-1)
            tokens.append(token)
    return torch.cat(tokens, 1), torch.cat(all_logits, 1)


def dynamic_and_static(model, prompt, steps, compiled):
    """``greedy`` with a DynamicCache, then with a StaticCache (compiled if asked, failing on a recompile):
    (dynamic tokens, dynamic logits, static cache, static tokens, static logits)."""
    from transformers import DynamicCache, StaticCache

    dynamic_tokens, dynamic_logits = greedy(model, prompt, DynamicCache(config=model.config), steps)
    static_cache = StaticCache(config=model.config, max_cache_len=prompt.shape[1] + steps + 3)
    torch.compiler.reset()
    torch._dynamo.utils.counters.clear()
    with torch._dynamo.config.patch(error_on_recompile=True):
        static_tokens, static_logits = greedy(model, prompt, static_cache, steps, compiled=compiled)
    return dynamic_tokens, dynamic_logits, static_cache, static_tokens, static_logits


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """A local Hub cache folder (tests/hub.py lays repos into it), with huggingface_hub pointed at it offline; fails the test if anything tried the network."""
    huggingface_hub = pytest.importorskip("huggingface_hub", reason="Hub repo ids resolve through huggingface_hub")
    cache = tmp_path / "hf" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub reads these variables once, when it is imported (huggingface_hub.constants).
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    attempts = []

    def no_network(*args, **kwargs):
        # Recorded as well as refused: resolve() turns any Hub error into FileNotFoundError.
        attempts.append(args)
        raise OSError("network access attempted in a test")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket.socket, "connect_ex", no_network)
    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    yield cache
    assert not attempts, f"network access attempted: {attempts[:3]}"
