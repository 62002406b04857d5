"""`varbench ...` command line: thin subcommands that parse, call the library and print.

Each group of subcommands lives in a ``varbench.app.cmd_*`` module exposing
``register(subparsers) -> None``; the parser built there sets ``func=handler(args) -> int``.

Exit codes: 0 success; 1 a check or a comparison failed (``run``: a ``check`` case failed), or
an internal error (a line saying so, then its traceback: that is a bug to report); 2 bad input
(a :class:`~varbench._util.checks.UsageError` raised at the boundary: printed as one line naming
the argument, the value and the choices; an OSError: the path and the reason, e.g. permission
denied; another process holding the output directory); 130 interrupted.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from varbench._util.checks import UsageError

# Modules that register subcommands, in the order `varbench --help` lists them.
_COMMAND_MODULES: list[str] = [
    "varbench.app.cmd_runner",
    "varbench.app.cmd_train",
    "varbench.app.cmd_foundation",
    "varbench.app.cmd_analysis",
]


class _ArgumentsError(UsageError):
    """A command line argparse refused; the message is the whole line to print."""


class _Parser(argparse.ArgumentParser):
    """argparse's parser whose errors are one line (exit 2), like every other bad input: the
    flag, the value and what is valid (a bound from :mod:`varbench._util.bounds`, a choice),
    then where the usage is, instead of the usage block above the line."""

    def error(self, message: str):
        """Raise the line ``<prog>: error: <message> (see <prog> --help)`` (main: exit 2)."""
        raise _ArgumentsError(f"{self.prog}: error: {message} (see {self.prog} --help)")


def build_parser() -> argparse.ArgumentParser:
    """Return the top-level parser with every subcommand registered."""
    from varbench._util.version import VERSION as __version__

    parser = _Parser(
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
    try:
        args = parser.parse_args(argv)
    except _ArgumentsError as err:
        print(err, file=sys.stderr)
        return 2
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except UsageError as err:
        print(f"varbench {args.command}: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # a path the user named: a file in the way, no permission, no space
        print(f"varbench {args.command}: error: {os_error_text(err)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"varbench {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception:
        print(f"varbench {args.command}: internal error (a bug in varbench, not in your "
              "input); please report it with the traceback below", file=sys.stderr)
        raise


def os_error_text(err: OSError) -> str:
    """``"<path>: <reason>"`` for an OSError (both paths of a rename)."""
    paths = [repr(str(p)) for p in (err.filename, err.filename2) if p is not None]
    reason = err.strerror or str(err) or type(err).__name__
    return f"{' -> '.join(paths)}: {reason}" if paths else reason


if __name__ == "__main__":
    sys.exit(main())
