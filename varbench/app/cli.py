"""`varbench ...` command line: thin subcommands that parse, call the library and print.

Each subcommand lives beside the code it drives, in a module exposing
``register(subparsers) -> None``; the parser built there sets ``func=handler(args) -> int``.
User errors (ValueError, TypeError, FileNotFoundError, KeyError from bad input) print one line
and exit 2, without a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Modules that register subcommands, in the order `varbench --help` lists them.
_COMMAND_MODULES: list[str] = [
    "varbench.app.cmd_runner",
    "varbench.app.cmd_train",
    "varbench.app.cmd_foundation",
    "varbench.app.cmd_analysis",
]


class UsageError(Exception):
    """Bad input on the command line: printed as one line, exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    """Return the top-level parser with every subcommand registered."""
    from varbench import __version__

    parser = argparse.ArgumentParser(
        prog="varbench",
        description="Measure gradient variance and credit assignment in RL fine-tuning of LMs.",
    )
    parser.add_argument("--version", action="version", version=f"varbench {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `varbench` console script; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except (UsageError, ValueError, TypeError, FileNotFoundError, KeyError) as err:
        msg = err.args[0] if isinstance(err, KeyError) and err.args else err
        print(f"varbench {args.command}: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"varbench {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
