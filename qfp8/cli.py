"""``python -m qfp8`` (also installed as ``qfp8``): the library from a shell.

Each subcommand lives beside the code it drives and provides
``add_arguments(parser)`` and ``run(args) -> int``.

From the command line, a user error (the ``ValueError``, ``TypeError`` or
``FileNotFoundError`` the library raises for bad arguments, files or models)
prints ``qfp8 <command>: error: <message>`` and exits with status 2, as
argparse does for bad options; ``QFP8_TRACEBACK=1`` shows the traceback
instead. ``main(argv)`` called with a list (from Python) raises them.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys

__all__ = [
    "SOURCE_ARGUMENTS",
    "SUBCOMMANDS",
    "SubcommandParser",
    "USER_ERRORS",
    "check_source_path",
    "main",
]

# subcommand -> (module providing add_arguments/run, one-line help)
SUBCOMMANDS = {
    "demo": ("qfp8.demo", "quantize SmolLM2-135M (or --model PATH) and compare bf16 with each FP8 scheme"),
    "quantize": ("qfp8.checkpoint.stream", "stream-quantize a float safetensors checkpoint into an FP8 one"),
    "inspect": ("qfp8.checkpoint.inspect", "describe a checkpoint: format, scheme per module group, sizes"),
}
# subcommand -> its argument naming a checkpoint folder or Hub repo id
SOURCE_ARGUMENTS = {"quantize": "src", "inspect": "path"}
USER_ERRORS = (ValueError, TypeError, FileNotFoundError)
_REPO_ID = re.compile(r"[\w.-]+/[\w.-]+")


def check_source_path(path: str) -> None:
    """Raises FileNotFoundError for a missing path that cannot be a Hub repo id (``owner/name``).

    Such a path (``./x``, ``/x``, ``~/x``, ``a/b/c``, or ``a/b`` where the
    local folder ``a`` exists) is a mistyped local folder: say so, rather than
    look it up on the Hub and report the network's errors.
    """
    if os.path.exists(path):
        return
    first = path.split("/", 1)[0]
    if not _REPO_ID.fullmatch(path) or path.startswith((".", "~")) or os.path.isdir(first):
        raise FileNotFoundError(f"{path}: no such file or folder (taken as a local path, not a Hub repo id)")


class SubcommandParser(argparse.ArgumentParser):
    """A subcommand's parser. An option taking any number of values (``nargs="*"`` or ``"+"``, as
    ``--exclude``) also takes the positional arguments written after it (``--exclude lm_head SRC DST``), and
    argparse then says only that they are missing: this says which option took them, and how to write it."""

    def parse_known_args(self, args=None, namespace=None):
        self.given = list(sys.argv[1:] if args is None else args)  # the subcommand's own arguments
        return super().parse_known_args(args, namespace)

    def error(self, message: str):
        if message.startswith("the following arguments are required"):
            message += self.greedy_option_hint()
        super().error(message)

    def greedy_option_hint(self) -> str:
        """Which options of any number of values took values ('' when none did), and how to write the line."""
        greedy = {
            option: action
            for action in self._actions
            if action.option_strings and action.nargs in ("*", "+")
            for option in action.option_strings
        }
        positionals = " ".join(action.dest for action in self._actions if not action.option_strings)
        given = getattr(self, "given", [])
        took = []
        for i, arg in enumerate(given):
            if arg == "--":
                break
            # argparse also takes a unique prefix of a long option (--excl)
            actions = {
                greedy[o] for o in greedy if o == arg or (self.allow_abbrev and len(arg) > 2 and o.startswith(arg))
            }
            values = []
            for value in given[i + 1 :]:
                if value.startswith("-"):
                    break
                values.append(value)
            if len(actions) == 1 and values:
                took.append(
                    f"{arg} took {', '.join(map(repr, values))} as its values: write {positionals} before {arg}"
                )
        if not took:
            return ""
        return f" ({'; '.join(took)}, or end its values with -- and put {positionals} last)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="qfp8", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True, parser_class=SubcommandParser)
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
    if argv is None and args.command == "quantize":
        # The installed command's own process: freed tensors go back to the system at once, instead of piling up
        # in glibc's heap from shard to shard (which doubles the peak to twice the largest tensor).
        from qfp8.library.memory import release_large_frees

        release_large_frees()
    try:
        if args.command in SOURCE_ARGUMENTS:
            check_source_path(getattr(args, SOURCE_ARGUMENTS[args.command]))
        return int(modules[args.command].run(args) or 0)
    except USER_ERRORS as error:
        if argv is not None or os.environ.get("QFP8_TRACEBACK", "") not in ("", "0"):
            raise
        print(f"qfp8 {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
