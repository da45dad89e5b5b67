"""The `specee` command line: `specee generate | chat | info | calibrate | bench | train-draft | distill | serve |
tune` (also `python -m specee`).

Layout, so that more subcommands and flags slot in without touching the others:

* `add_model_args(parser)`    --model / --device / --dtype, shared by every command that loads a model
* `add_sampling_args(parser)` --max-new-tokens / --temperature / --top-k / --top-p / --seed / --stop
* `load_llm(args)`            the one place an `LLM` is built from parsed arguments (early-exit
                              options such as --draft / --bank / --no-exit / --mode belong here)
* one `add_<name>_parser(subparsers)` + one `cmd_<name>(args) -> int` per subcommand, listed in
  `SUBCOMMANDS`; `main(argv=None)` parses, dispatches and turns library errors into one line
  `specee: error: ...` with exit status 2.

Modules: `args` (shared flags, `load_llm`), `arg_types` (the flags' value checks), `run` (generate, chat,
info), `train` (calibrate, train-draft, distill), `serve` (the HTTP server), `tune` (the fastest mode on this
machine); `specee bench` lives in `specee/bench/cli.py` (its flags) and `specee/bench/commands.py` (its runs).
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from .args import EXIT_USAGE, PROG, CLIError, Parser, cli_wording
from .run import add_chat_parser, add_generate_parser, add_info_parser
from .serve import add_serve_parser
from .train import add_calibrate_parser, add_distill_parser, add_train_draft_parser
from .tune import add_tune_parser


# ---- entry point ---------------------------------------------------------------------------
def add_bench_parser(sub) -> argparse.ArgumentParser:
    from ..bench.cli import add_bench_parser as add

    return add(sub)


SUBCOMMANDS: list[Callable[[Any], argparse.ArgumentParser]] = [
    add_generate_parser, add_chat_parser, add_info_parser, add_calibrate_parser, add_bench_parser,
    add_train_draft_parser, add_distill_parser, add_serve_parser, add_tune_parser]


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    parser = Parser(
        prog=PROG, description="specee: faster decoding of Hugging Face causal LMs by speculative early exiting")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status (0 ok, 2 usage or library error, 130 interrupted)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version, usage errors: argparse already printed the message
        return e.code if isinstance(e.code, int) else (0 if e.code is None else EXIT_USAGE)
    try:
        return args.func(args)
    except BrokenPipeError:  # `specee generate ... | head`: the reader left; stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    except (CLIError, ValueError, OSError, ImportError) as e:
        sys.stdout.flush()
        message = cli_wording(" ".join(str(e).split()) or type(e).__name__)
        print(f"{PROG}: error: {message}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
