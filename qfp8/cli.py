"""``python -m qfp8`` (also installed as ``qfp8``): the library from a shell.

Each subcommand lives beside the code it drives and provides
``add_arguments(parser)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module providing add_arguments/run, one-line help)
SUBCOMMANDS = {
    "demo": ("qfp8.demo", "quantize SmolLM2-135M (or --model PATH) and compare bf16 with each FP8 scheme"),
    "quantize": ("qfp8.checkpoint.stream", "stream-quantize a float safetensors checkpoint into an FP8 one"),
    "inspect": ("qfp8.checkpoint.inspect", "describe a checkpoint: format, scheme per module group, sizes"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="qfp8", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    modules = {}
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub = commands.add_parser(name, help=help_text)
        try:
            modules[name] = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if error.name != module_name:
                raise
            continue
        modules[name].add_arguments(sub)
    args = parser.parse_args(argv)
    if args.command not in modules:
        parser.error(f"'{args.command}' is not available in this build")
    return int(modules[args.command].run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
