"""Files written whole or not at all: what a reader (another process, the next run) finds is the old file or
the new one, never half of the new one after an interrupted or failing write."""
from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def replacing(path: str | Path) -> Iterator[Path]:
    """A temporary file beside `path` to write (its name carries the process id: two writers do not share
    it), moved over `path` only when the block ends without error; removed otherwise."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


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
