"""Files written whole or not at all: what a reader (another process, the next run) finds is the old file or
the new one, never half of the new one after an interrupted or failing write."""
from __future__ import annotations

import os
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
