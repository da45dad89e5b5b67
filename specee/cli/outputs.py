"""Output destinations (`-o`, `--out`) checked as the flags are parsed: a command that cannot write its
result fails in one line before it loads a model or runs, not after minutes of work."""
from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path


def writable_destination(path: Path, directory: bool) -> Path:
    """`path` if a directory (or file) can be made or replaced there; else a one-line error. Nothing is
    left behind: the nearest existing ancestor is probed with a temporary file that vanishes on close."""
    if path.exists() and path.is_dir() != directory:
        raise ValueError(f"{path} exists and is {'not ' if directory else ''}a directory")
    if path.exists() and not os.access(path, os.W_OK):
        raise ValueError(f"{path} is not writable")
    ancestor = path if directory and path.is_dir() else path.parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ValueError(f"cannot create {path}: {ancestor} is a file, not a directory")
    try:
        with tempfile.TemporaryFile(dir=ancestor):
            pass
    except OSError as e:
        raise ValueError(f"cannot write in {ancestor} ({e.strerror or type(e).__name__})") from None
    return path


def _flag_type(directory: bool):
    def check(value: str) -> Path:
        try:
            return writable_destination(Path(value).expanduser(), directory)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    check.__name__ = "directory" if directory else "file"
    return check


output_dir = _flag_type(directory=True)  # argparse type= of an output directory flag
output_file = _flag_type(directory=False)  # argparse type= of an output file flag
