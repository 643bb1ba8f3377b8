"""Where a benchmark result came from, recorded in every bench/*.py JSON.

Each script adds ``{"provenance": provenance.collect()}`` to its JSON, so a
table can cite the file and a reader can rerun it: the commit, the CPU model
as /proc/cpuinfo (or lscpu) names it, the qfp8 CPU kernel chosen on it, the
torch version, the thread count, the date and the exact command.
"""

from __future__ import annotations

import datetime
import platform
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

FIELDS = ("commit", "cpu_model", "isa", "torch", "threads", "date", "command")


def git_commit(root: Path = ROOT) -> str | None:
    """The checked-out commit, with ``-dirty`` when tracked files differ from it; None outside a git checkout."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        changed = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("-dirty" if changed else "") if commit else None


def cpu_identity() -> dict:
    """The CPU's model name, vendor, family and model numbers (which tell Zen generations apart in a VM)."""
    fields = {"model name": "cpu_model", "vendor_id": "cpu_vendor", "cpu family": "cpu_family", "model": "cpu_model_id"}
    found: dict = {}
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in fields and fields[key] not in found:
                    found[fields[key]] = value.strip()
                if not line.strip() and found:
                    break  # the first processor's block is enough
    except OSError:
        pass
    if "cpu_model" not in found:
        try:
            out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10, check=True).stdout
            for line in out.splitlines():
                if line.startswith("Model name:"):
                    found["cpu_model"] = line.split(":", 1)[1].strip()
        except (OSError, subprocess.SubprocessError):
            pass
    found.setdefault("cpu_model", platform.processor() or platform.machine())
    generation = amd_generation(found)
    if generation:
        found["cpu_generation"] = generation
    return found


def amd_generation(cpu: dict) -> str | None:
    """ "Zen 3", "Zen 4" or "Zen 5" from an AMD CPU's family and model numbers (a VM often names only "AMD EPYC")."""
    if cpu.get("cpu_vendor") != "AuthenticAMD":
        return None
    try:
        family, model = int(cpu["cpu_family"]), int(cpu["cpu_model_id"])
    except (KeyError, ValueError):
        return None
    if family == 26:
        return "Zen 5"
    if family == 25:
        return "Zen 4" if 0x10 <= model <= 0x1F or 0x60 <= model <= 0xAF else "Zen 3"
    return None


def command() -> str:
    """The command line that ran this script, its path relative to the repository when it lies inside it."""
    argv = list(sys.argv)
    if argv and argv[0]:
        script = Path(argv[0]).resolve()
        if script.is_relative_to(ROOT):
            argv[0] = str(script.relative_to(ROOT))
    return shlex.join(["python", *argv])


def collect() -> dict:
    """The provenance record; call it after the script has set its thread count."""
    import torch

    import qfp8
    from qfp8.library import cpu

    record = {
        "commit": git_commit(),
        **cpu_identity(),
        "isa": cpu.cpu_kernel_isa(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command(),
        "qfp8": qfp8.__version__,
        "python": platform.python_version(),
    }
    if torch.cuda.is_available():
        record["gpu"] = torch.cuda.get_device_name(0)
    return record
