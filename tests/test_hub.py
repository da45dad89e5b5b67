"""Hugging Face hub ids resolve through huggingface_hub against a local cache laid out the way it lays
one out (models--org--name/snapshots/<commit>/..., refs/<branch>); no hub is reachable here, so the
cache is built by the test and read offline."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from gguf_checkpoints import TinyGGUF, write_gguf

import specee
from specee import LLM, SamplingParams
from specee.model.resolve import resolve_model
from specee.model.weights import CheckpointError

pytest.importorskip("huggingface_hub")
pytestmark = pytest.mark.usefixtures("single_thread")

COMMIT_A, COMMIT_B = "a" * 40, "b" * 40


def snapshot(cache: Path, repo: str, commit: str, refs: tuple[str, ...] = ("main",)) -> Path:
    root = cache / ("models--" + repo.replace("/", "--"))
    snap = root / "snapshots" / commit
    snap.mkdir(parents=True)
    (root / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (root / "refs" / ref).write_text(commit)
    return snap


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty hub cache, used offline (huggingface_hub reads these two settings at call time)."""
    import huggingface_hub.constants as constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint("llama2")


def test_hub_id_loads_the_cached_snapshot(hub_cache, ckpt, tiny_llm):
    snap = snapshot(hub_cache, "acme/tiny-llama", COMMIT_A)
    shutil.copytree(ckpt, snap, dirs_exist_ok=True)
    assert resolve_model("acme/tiny-llama") == snap
    llm = LLM("acme/tiny-llama", dtype="float32")
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    assert llm.generate("Once upon a time", params)[0].token_ids == \
        tiny_llm("llama2").generate("Once upon a time", params)[0].token_ids
    assert llm.fingerprint == tiny_llm("llama2").fingerprint


def test_revision_picks_a_branch_or_commit(hub_cache, ckpt):
    main = snapshot(hub_cache, "acme/tiny-llama", COMMIT_A)
    v2 = snapshot(hub_cache, "acme/tiny-llama", COMMIT_B, refs=("v2",))
    for snap in (main, v2):
        shutil.copytree(ckpt, snap, dirs_exist_ok=True)
    assert resolve_model("acme/tiny-llama") == main
    assert resolve_model("acme/tiny-llama", revision="v2") == v2
    assert resolve_model("acme/tiny-llama", revision=COMMIT_B) == v2
    with pytest.raises(FileNotFoundError, match=r"model 'acme/tiny-llama' at revision 'v3' is not a local path"):
        resolve_model("acme/tiny-llama", revision="v3")


def test_gguf_repository(hub_cache):
    snap = snapshot(hub_cache, "acme/tiny-gguf", COMMIT_A)
    spec = TinyGGUF("llama", ("Q8_0",), True)
    for name in ("tiny.Q8_0.gguf", "tiny.Q4_0.gguf"):
        write_gguf(snap / name, spec)
    assert resolve_model("acme/tiny-gguf/tiny.Q8_0.gguf") == snap / "tiny.Q8_0.gguf"
    with pytest.raises(CheckpointError, match=r"holds 2 GGUF files \(tiny.Q4_0.gguf, tiny.Q8_0.gguf\)"):
        resolve_model("acme/tiny-gguf")


def test_id_missing_from_the_cache_is_named(hub_cache):
    with pytest.raises(FileNotFoundError, match=r"model 'acme/absent' is not a local path and could not be found "
                                                 r"in the Hugging Face hub cache"):
        LLM("acme/absent")


def test_cli_resolves_hub_ids_offline(tmp_path, ckpt):
    cache = tmp_path / "hub"
    shutil.copytree(ckpt, snapshot(cache, "acme/tiny-llama", COMMIT_A), dirs_exist_ok=True)
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": str(Path(specee.__file__).resolve().parents[1])}

    def specee_cli(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "specee", *argv], capture_output=True, text=True, env=env,
                              timeout=120)

    done = specee_cli("info", "--model", "acme/tiny-llama", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["model"].endswith(f"snapshots/{COMMIT_A}")
    done = specee_cli("info", "--model", "acme/absent")
    assert done.returncode == 2 and done.stderr.startswith("specee: error: model 'acme/absent' is not a local path")
