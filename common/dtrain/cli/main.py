"""`dtrain`: the project's command line.

    dtrain runs [PATHS...]      list run directories and their status
    dtrain plan ...             choose a parallelism layout (cost model)
    dtrain backtest             the cost model against published GPU training runs
    dtrain guide ...            regenerate PARALLELISM_GUIDE.md
    dtrain capstone ...         run every experiment at small size, then the guide

Subcommands live beside the code they drive; each module exposes `add_parser(subparsers)` and
the parser's `func(args) -> int`.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import warnings

from dtrain.core.errors import UserError

# module -> provides add_parser(subparsers); optional ones are skipped until they exist
SUBCOMMAND_MODULES = [
    "dtrain.cli.runs",
    "dtrain.costmodel.plan_cli",
    "dtrain.costmodel.moe_backtest",  # `dtrain backtest`, with --moe
    "dtrain.guide.guide_cli",
    "dtrain.cli.capstone",
]
SUBCOMMAND_OF = {"plan": "dtrain.costmodel.plan_cli", "backtest": "dtrain.costmodel.moe_backtest"}


class OneLineParser(argparse.ArgumentParser):
    """Bad arguments are one `error:` line and exit 2, like every other bad input."""

    def error(self, message: str):
        raise UserError(f"{self.prog}: {message} (see {self.prog} --help)")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser; ``only``: import just the module of that subcommand (``dtrain plan`` then
    loads neither pandas nor torch, which the other subcommands import)."""
    parser = OneLineParser(prog="dtrain", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    modules = [SUBCOMMAND_OF[only]] if only in SUBCOMMAND_OF else SUBCOMMAND_MODULES
    for name in modules:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name and name.startswith(e.name):
                continue
            raise
        module.add_parser(sub)
    return parser


SIGPIPE_EXIT = 128 + 13  # as a shell reports a command killed by SIGPIPE (`yes | head -1`)


def _reader_gone() -> int:
    """The reader of stdout closed it (`dtrain runs | head -1`): stop quietly, as `head`'s writers
    do. stdout goes to /dev/null so the interpreter's final flush cannot fail again (the Python
    docs' recipe, "Note on SIGPIPE")."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return SIGPIPE_EXIT


def main(argv: list[str] | None = None) -> int:
    try:
        argv = sys.argv[1:] if argv is None else argv
        args = build_parser(argv[0] if argv else None).parse_args(argv)
        with warnings.catch_warnings():
            warnings.simplefilter("default")
            code = int(args.func(args) or 0)
        sys.stdout.flush()  # here, where a closed pipe is caught, not at exit
        return code
    except BrokenPipeError:
        return _reader_gone()
    except (UserError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
