"""No code from a checkpoint unless asked.

A config.json may carry an ``auto_map`` naming Python files of the checkpoint
that transformers imports (runs) to build the model; asked nothing,
transformers prompts on the terminal. Every place qfp8 reads a config or
builds a model passes ``trust_remote_code`` explicitly, False by default
(``qfp8.from_pretrained(..., trust_remote_code=True)`` and ``qfp8 quantize
--trust-remote-code`` opt in), so that nothing prompts and nothing runs: a
model type transformers does not know is then a ValueError naming the file.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = [
    "auto_config",
    "auto_tokenizer",
    "check_flag",
    "refusal",
]


def check_flag(trust_remote_code, caller: str) -> bool:
    if not isinstance(trust_remote_code, bool):
        raise TypeError(f"{caller}: trust_remote_code must be True or False, got {trust_remote_code!r}")
    return trust_remote_code


def refusal(directory: str | os.PathLike, error: Exception | None = None) -> ValueError:
    detail = f" ({str(error).strip().splitlines()[0]})" if error is not None and str(error).strip() else ""
    return ValueError(
        f"{Path(directory) / 'config.json'}: the checkpoint needs its own Python code (auto_map) to build its model"
        f"{detail}; qfp8 runs no code from a checkpoint unless asked. If you trust it, pass trust_remote_code=True "
        "(qfp8 quantize --trust-remote-code)"
    )


def _is_remote_code_error(error: Exception) -> bool:
    return "trust_remote_code" in str(error) or "custom code" in str(error)


def auto_config(directory: str | os.PathLike, trust_remote_code: bool = False):
    """``transformers.AutoConfig.from_pretrained(directory)`` that never prompts: custom code runs only when
    ``trust_remote_code`` is True; otherwise a model type transformers lacks is a ValueError naming the file."""
    import transformers

    try:
        return transformers.AutoConfig.from_pretrained(directory, trust_remote_code=trust_remote_code)
    except ValueError as error:
        if not trust_remote_code and _is_remote_code_error(error):
            raise refusal(directory, error) from None
        raise


def auto_tokenizer(directory: str | os.PathLike, trust_remote_code: bool = False):
    """``transformers.AutoTokenizer.from_pretrained(directory)`` that never prompts (see :func:`auto_config`)."""
    import transformers

    try:
        return transformers.AutoTokenizer.from_pretrained(directory, trust_remote_code=trust_remote_code)
    except ValueError as error:
        if not trust_remote_code and _is_remote_code_error(error):
            raise refusal(directory, error) from None
        raise
