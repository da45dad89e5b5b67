"""Running the CLI in-process from tests, and the one-line error every bad input must give."""
from __future__ import annotations

from specee import cli


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    """Exit code, stdout and stderr of `specee ARGV`."""
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code: int, err: str, *needles: str) -> None:
    """Exit status 2 and exactly one line, `specee: error: ...`, holding every needle."""
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("specee: error: "), err
    for needle in needles:
        assert needle in lines[0], lines[0]
