"""Compiling C++ sources once per content, wherever the checkout lies.

torch.utils.cpp_extension keys a build by its name and rebuilds, silently, whenever the source paths
or include paths in its ninja file change: two checkouts sharing the extension cache rebuilt each
other's kernels on every run (25 s instead of 2 s). Here the name carries a hash of the sources'
bytes, the flags and the torch/Python versions, and the sources are compiled from a copy inside the
build directory, so identical sources give one build command whatever their path, and different
sources never share a directory. A build that is about to happen says so on stderr (and one that
ninja starts on its own, on a newer source or header, says so when it is done).

torch marks a build in progress with a `lock` file in its directory and waits, forever, while one is
there: a build killed midway (Ctrl-C during the first run's build, an OOM kill) left every later run
hanging without a word. Builds here hold an advisory lock instead, which the system drops with its
process, so a `lock` file found while holding it is a dead build's and is removed, saying so.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import tempfile
from pathlib import Path
from types import ModuleType

KEY_CHARS = 16  # hex digits of the content hash in the extension's name


def build_name(prefix: str, sources: list[Path], cflags: list[str]) -> str:
    """`prefix_<hash>`: the same for byte-identical sources (by file name) and flags, on the same
    torch and Python; different as soon as one byte, flag or version differs."""
    import torch

    h = hashlib.sha256()
    for part in (torch.__version__, sys.version, os.environ.get("CXX", ""), *cflags):
        h.update(part.encode() + b"\0")
    for src in sorted(sources, key=lambda p: p.name):
        h.update(src.name.encode() + b"\0" + src.read_bytes() + b"\0")
    return f"{prefix}_{h.hexdigest()[:KEY_CHARS]}"


def build_dir(name: str) -> Path:
    """Where torch builds extension `name` ($TORCH_EXTENSIONS_DIR, else torch's per-Python cache)."""
    from torch.utils import cpp_extension

    return Path(cpp_extension._get_build_directory(name, False))


def load(prefix: str, sources: list[Path], cflags: list[str], what: str = "C++ extension",
         duration: str = "") -> ModuleType:
    """Build (if this content has no build yet) and import the extension; raises what torch raises."""
    from torch.utils import cpp_extension

    name = build_name(prefix, sources, cflags)
    root = build_dir(name)
    src = root / "src"
    copies = [_place(s, src) for s in sources]  # the build reads these, so its command names no checkout
    so = root / f"{name}.so"
    with _building(root, so):
        before = _stamp(so)
        if before is None:
            print(f"specee: building the {what} for this machine (once for these sources{duration}) in {root}",
                  file=sys.stderr, flush=True)
        module = cpp_extension.load(name, [str(c) for c in copies if c.suffix == ".cpp"], extra_cflags=cflags,
                                    extra_include_paths=[str(src)], build_directory=str(root), verbose=False)
    if before is not None and _stamp(so) != before:  # ninja found something newer (torch's headers?)
        print(f"specee: rebuilt the {what} in {root}", file=sys.stderr, flush=True)
    return module


@contextlib.contextmanager
def _building(root: Path, so: Path):
    """Hold the build directory's advisory lock (waiting while another process builds or loads, and
    saying so when it builds); remove torch's `lock` file if a killed build left one."""
    import fcntl

    root.mkdir(parents=True, exist_ok=True)
    with open(root / "specee-build.lock", "w") as held:
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not so.exists():
                print(f"specee: waiting for another process's build in {root}", file=sys.stderr, flush=True)
            fcntl.flock(held, fcntl.LOCK_EX)
        stale = root / "lock"
        if stale.exists():
            print(f"specee: removing {stale}, left by a build that was killed before it finished",
                  file=sys.stderr, flush=True)
            stale.unlink(missing_ok=True)
        yield


def _stamp(path: Path) -> int | None:
    try:
        return path.stat().st_mtime_ns
    except FileNotFoundError:
        return None


def _place(source: Path, folder: Path) -> Path:
    """`source`'s bytes at folder/name, written (atomically) only when absent: its name is keyed by
    content, and an untouched timestamp keeps ninja from rebuilding."""
    target = folder / source.name
    if not target.exists():
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, delete=False, suffix=".tmp") as f:
            f.write(source.read_bytes())
        os.replace(f.name, target)
    return target
