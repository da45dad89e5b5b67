"""Shared fixtures: the real models in ../shared (loaded once per session) and tiny random
checkpoints built with transformers (built once per session, in a temporary directory)."""
from __future__ import annotations

import functools
import gc
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))  # `import checkpoints` from the test modules

SHARED = TESTS.parents[1] / "shared"  # ../shared from the repository root
MODELS = SHARED / "models"
REAL_MODELS = ("stories260K", "ref-target-24L")


@pytest.fixture(scope="session", autouse=True)
def no_tuned_profiles(tmp_path_factory):
    """Every test decodes in the mode it names: profiles `specee tune` stored on this machine (read by
    generate, chat and serve when no mode is given) are not seen; tests of `tune` point at their own."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECEE_TUNE_DIR", str(tmp_path_factory.mktemp("no-tuned-profiles")))
        yield


@pytest.fixture(scope="module", autouse=True)
def collect_after_module():
    """Free a module's models when it ends. Tests leave LLMs and transformers models in reference
    cycles that only a full collection frees; each LLM reserves a 1 GiB KV pool (untouched, so
    cheap), and after ~40 modules the reserved memory exceeded RAM, so the Ray test's fork
    failed with ENOMEM."""
    yield
    gc.collect()


@pytest.fixture(scope="module")
def single_thread():
    """Run a module's tests with one torch thread, then restore the setting.

    On a small shared CPU box (2 cores, other jobs running) torch's multi-threaded kernels stall
    on each other: a 64-token batched decode of stories260K measured 0.13 s with one thread and
    7-9 s with two. Correctness tests do not need the parallelism; both sides of every parity
    comparison run under the same setting. Opt in with
    `pytestmark = pytest.mark.usefixtures("single_thread")`."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def real_model_dir(name: str) -> Path:
    """The path of a real model under ../shared/models, or skip the test with the reason."""
    path = MODELS / name
    if not (path / "config.json").exists():
        pytest.skip(f"real model {name!r} not available: {path} is absent (the shared models folder "
                    "../shared/models is not mounted next to the repository)")
    return path


@pytest.fixture(scope="session")
def real_llm():
    """real_llm(name) -> specee LLM in float32, loaded once per session."""
    from specee import LLM

    return functools.cache(lambda name: LLM(real_model_dir(name), dtype="float32"))


@pytest.fixture(scope="session")
def gguf_llm():
    """gguf_llm(path) -> specee LLM (float32 weights, dequantized) on a GGUF file, loaded once per session
    (tests skip first when the file is absent)."""
    from specee import LLM

    return functools.cache(lambda path: LLM(path, dtype="float32", quantization=None))


@pytest.fixture(scope="session")
def gguf_hf_tokenizer():
    """gguf_hf_tokenizer(path) -> transformers' tokenizer of a GGUF file, built once per session."""
    from transformers import AutoTokenizer

    return functools.cache(lambda path: AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name))


@pytest.fixture(scope="session")
def real_hf():
    """real_hf(name) -> transformers model in float32 (the reference), loaded once per session."""
    from checkpoints import load_hf

    return functools.cache(lambda name: load_hf(real_model_dir(name)))


@pytest.fixture(scope="session")
def real_hf_tokenizer():
    from transformers import AutoTokenizer

    return functools.cache(lambda name: AutoTokenizer.from_pretrained(str(real_model_dir(name))))


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """tiny_checkpoint(variant) -> directory of a tiny random transformers checkpoint, built once."""
    from checkpoints import make_checkpoint

    return functools.cache(lambda variant: make_checkpoint(tmp_path_factory.mktemp(f"ckpt-{variant}") / "model",
                                                           variant))


@pytest.fixture(scope="session")
def tiny_llm(tiny_checkpoint):
    """tiny_llm(variant) -> specee LLM (float32) on a tiny random checkpoint, loaded once."""
    from specee import LLM

    return functools.cache(lambda variant: LLM(tiny_checkpoint(variant), dtype="float32"))


def greedy_with_margins(model, prompt: list[int], steps: int) -> tuple[list[int], list]:
    """One-token greedy decoding of a Transformer, with each step's logits (the plain reference)."""
    import torch

    cache = model.new_cache(1, len(prompt) + steps)
    ids, logits = list(prompt), []
    with torch.inference_mode():
        h = model.forward(torch.tensor([prompt]), model.range_inputs(0, len(prompt)), cache)[:, -1:]
        for _ in range(steps):
            row = model.logits(h)[0, -1]
            logits.append(row)
            ids.append(int(row.argmax()))
            n = len(ids) - 1
            h = model.forward(torch.tensor([[ids[-1]]]), model.range_inputs(n, 1), cache)
    return ids[len(prompt):], logits


SMOLLM2_GGUF = MODELS / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def gguf_smollm2():
    """SmolLM2-135M-Instruct on the default path (quantization "auto": its 4-bit blocks, the C++ layer),
    loaded once per session; skips when the file is absent."""
    from specee import LLM

    if not SMOLLM2_GGUF.exists():
        pytest.skip(f"SmolLM2 GGUF not available: {SMOLLM2_GGUF} is absent")
    return LLM(SMOLLM2_GGUF, quantization="auto")
