"""Runs checkpoints in vLLM's offline engine and prints what it made of each, as JSON (run by vLLM's python).

``python serve.py JOB.json`` where the job is ``{"prompt": [token ids], "logprobs": k, "checkpoints":
[{"name": ..., "path": ..., "engine": {extra LLM(...) arguments}}]}``. Each checkpoint is started in turn in this
one process (vLLM's engine in-process, eager, a small KV cache) and fed the prompt teacher-forced. Its result is
``{"stage": "ok", "kv_cache_dtypes": [...], "kv_scales": [...], "kernels": [...], "prompt_logprobs": [...]}``
(per position None or the top-k ``[token, logprob]`` by rank), or the stage that failed (``"load"``,
``"generate"``) with the exception's type and message. The last line of stdout is the JSON:
``{"vllm": version, "results": {name: result}}``.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import traceback

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # one process: the engine core runs in this one
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM's CPU default is a share of the machine's memory

ENGINE = dict(
    skip_tokenizer_init=True,  # token ids in, logprobs out: no tokenizer needed
    max_model_len=64,
    max_num_seqs=1,
    max_num_batched_tokens=64,
    enforce_eager=True,
    compilation_config={"mode": 0},  # no torch.compile: the engine starts in seconds
    dtype="bfloat16",
)


def _error(stage: str, error: BaseException) -> dict:
    lines = traceback.format_exception(error)
    return {"stage": stage, "error": f"{type(error).__name__}: {error}", "traceback": "".join(lines[-12:])}


def _model_facts(model) -> dict:
    """What vLLM built: its attention layers' KV-cache dtypes and [k, v] scales, its linear layers' scheme and
    kernel classes."""
    kv_dtypes, kernels, kv_scales = set(), set(), []
    for module in model.modules():
        if hasattr(module, "kv_cache_dtype") and hasattr(module, "num_kv_heads"):
            kv_dtypes.add(str(module.kv_cache_dtype))
            kv_scales.append([float(module._k_scale_float), float(module._v_scale_float)])
        scheme = getattr(module, "scheme", None)
        kernel = getattr(scheme, "fp8_linear", None) or getattr(scheme, "linear_kernel", None)
        if scheme is not None:
            kernels.add(f"{type(scheme).__name__}/{type(kernel).__name__}")
    return {"kv_cache_dtypes": sorted(kv_dtypes), "kv_scales": kv_scales, "kernels": sorted(kernels)}


def _rank(position: dict):
    return lambda entry: position[entry[0]].rank


def run_one(checkpoint: dict, prompt: list[int], logprobs: int) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    try:
        llm = LLM(model=checkpoint["path"], **{**ENGINE, **checkpoint.get("engine", {})})
    except Exception as error:  # the result says which stage failed and how
        return _error("load", error)
    try:
        params = SamplingParams(max_tokens=1, prompt_logprobs=logprobs, detokenize=False, temperature=0.0)
        (output,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
        positions = [
            None if p is None else sorted(([t, v.logprob] for t, v in p.items() if v.rank <= logprobs), key=_rank(p))
            for p in output.prompt_logprobs
        ]
        (facts,) = llm.apply_model(_model_facts)
        return {"stage": "ok", **facts, "prompt_logprobs": positions}
    except Exception as error:
        return _error("generate", error)
    finally:
        del llm
        gc.collect()


def main(job_path: str) -> int:
    with open(job_path) as f:
        job = json.load(f)
    import vllm

    results = {}
    for checkpoint in job["checkpoints"]:
        results[checkpoint["name"]] = run_one(checkpoint, job["prompt"], job["logprobs"])
        print(f"serve.py: {checkpoint['name']}: {results[checkpoint['name']]['stage']}", file=sys.stderr, flush=True)
    print(json.dumps({"vllm": vllm.__version__, "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
