"""The kernel build is keyed by the sources' content, not their path, and says when it builds
(model/kernels/build.py): two checkouts sharing torch's extension cache used to rebuild each
other's kernels on every run, silently."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from specee.model import kernels
from specee.model.kernels import build

# a module on Python's C API, not pybind11's: it builds in about a second, where pybind11's headers took ten
TINY = """#include <Python.h>
#define CAT(a, b) a##b
#define INIT(name) CAT(PyInit_, name)
#define STR(x) #x
#define NAME(x) STR(x)
static PyObject* answer(PyObject*, PyObject*) { return PyLong_FromLong(42); }
static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, nullptr}, {nullptr, nullptr, 0, nullptr}};
static PyModuleDef module = {PyModuleDef_HEAD_INIT, NAME(TORCH_EXTENSION_NAME), nullptr, -1, methods};
PyMODINIT_FUNC INIT(TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&module); }
"""
REPO = Path(__file__).resolve().parents[1]


def copy_kernels(to: Path) -> list[Path]:
    shutil.copytree(kernels.HERE, to, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    return kernels.sources(to)


def test_equal_sources_in_two_trees_resolve_to_one_build_and_a_changed_byte_to_another(tmp_path):
    a, b = copy_kernels(tmp_path / "a"), copy_kernels(tmp_path / "b")
    name = build.build_name(kernels.PREFIX, a, kernels.CFLAGS)
    assert name == build.build_name(kernels.PREFIX, b, kernels.CFLAGS)
    assert name == build.build_name(kernels.PREFIX, kernels.sources(), kernels.CFLAGS)  # the package's own
    assert build.build_dir(name) == build.build_dir(build.build_name(kernels.PREFIX, b, kernels.CFLAGS))
    header = next(p for p in b if p.suffix == ".h")
    header.write_text(header.read_text() + "\n")
    assert build.build_name(kernels.PREFIX, b, kernels.CFLAGS) != name  # a header counts too
    assert build.build_name(kernels.PREFIX, a, ["-O2"]) != name  # and the flags


def load_in_subprocess(source: Path, ext_dir: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    code = ("import sys; from pathlib import Path; from specee.model.kernels import build; "
            f"print(build.load('tiny', [Path({str(source)!r})], ['-O0']).answer())")
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "TORCH_EXTENSIONS_DIR": str(ext_dir)})


def test_a_build_says_so_and_a_second_tree_with_the_same_sources_does_not_rebuild(tmp_path):
    """Each load in a fresh process, as two checkouts' runs would be."""
    ext = tmp_path / "ext"
    first, second = tmp_path / "one" / "tiny.cpp", tmp_path / "two" / "tiny.cpp"
    for src in (first, second):
        src.parent.mkdir()
        src.write_text(TINY)
    built = load_in_subprocess(first, ext)
    if built.returncode:
        pytest.skip(f"no C++ toolchain here: {built.stderr.strip().splitlines()[-1:]}")
    assert built.stdout.strip() == "42" and "specee: building the C++ extension" in built.stderr
    (so,) = ext.glob("tiny_*/tiny_*.so")
    stamp = so.stat().st_mtime_ns
    again = load_in_subprocess(second, ext)
    assert again.returncode == 0 and again.stdout.strip() == "42"
    assert "building" not in again.stderr and so.stat().st_mtime_ns == stamp
    assert len(list(ext.glob("tiny_*"))) == 1
    (copy,) = ext.glob("tiny_*/src/tiny.cpp")  # what the build reads: touched, ninja rebuilds, and says so
    os.utime(copy, ns=(stamp + 10**9, stamp + 10**9))
    touched = load_in_subprocess(second, ext)
    assert touched.returncode == 0 and "specee: rebuilt the C++ extension" in touched.stderr


def test_a_lock_left_by_a_killed_build_is_removed_with_a_note_instead_of_hanging_every_later_run(tmp_path):
    """torch waits forever while its build directory holds a `lock` file; a build killed midway left one."""
    ext, source = tmp_path / "ext", tmp_path / "tiny.cpp"
    source.write_text(TINY)
    built = load_in_subprocess(source, ext)
    if built.returncode:
        pytest.skip(f"no C++ toolchain here: {built.stderr.strip().splitlines()[-1:]}")
    (root,) = ext.glob("tiny_*")
    (root / "lock").touch()  # what torch's FileBaton leaves when its process dies mid-build
    again = load_in_subprocess(source, ext, timeout=120)
    assert again.returncode == 0 and again.stdout.strip() == "42"
    assert "left by a build that was killed" in again.stderr and not (root / "lock").exists()
