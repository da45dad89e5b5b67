"""Weights holding NaN or Inf are refused at load, naming the tensor; logits that turn NaN while
decoding end the request as an error instead of producing text."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from checkpoints import clone_checkpoint
from conftest import MODELS
from cli_helpers import assert_one_line_error, run_cli

from specee import LLM, SamplingParams
from specee.model.weights import CheckpointError

SMOLLM2 = MODELS / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def random_data(good: Path, out: Path, seed: int = 0) -> Path:
    """`good`'s header (metadata and tensor table) with every byte after it random: what the new user tried."""
    from gguf import GGUFReader

    offset = GGUFReader(good).data_offset
    data = good.read_bytes()
    noise = np.random.default_rng(seed).integers(0, 256, len(data) - offset, dtype=np.uint8).tobytes()
    out.write_bytes(data[:offset] + noise)
    return out


@pytest.mark.parametrize("types", [("Q4_1", "Q8_0"), ("Q4_K", "Q6_K"), ("F16",)])
def test_gguf_with_random_tensor_data_is_refused(tmp_path, capsys, types):
    from gguf_checkpoints import TinyGGUF, write_gguf

    from specee.model.llama import Transformer

    bad = random_data(write_gguf(tmp_path / "good.gguf", TinyGGUF("llama", types, True)), tmp_path / "bad.gguf")
    for quantization in ("auto", None):  # raw blocks kept for the kernels, and dequantized floats
        with pytest.raises(CheckpointError, match=r"bad.gguf: tensor \S+ holds NaN or infinite values"):
            Transformer.load(bad, quantization=quantization)
    code, _, err = run_cli(capsys, "info", "--model", str(bad))
    assert_one_line_error(code, err, "holds NaN or infinite values (the file is corrupt)")


def test_the_tensor_with_a_nan_scale_is_named(tmp_path):
    from gguf import GGUFReader
    from gguf_checkpoints import TinyGGUF, write_gguf

    path = write_gguf(tmp_path / "m.gguf", TinyGGUF("llama", ("Q8_0",), True))
    tensor = next(t for t in GGUFReader(path).tensors if t.name == "blk.1.ffn_down.weight")
    data = bytearray(path.read_bytes())
    data[tensor.data_offset : tensor.data_offset + 2] = np.float16("nan").tobytes()  # the first block's scale
    path.write_bytes(bytes(data))
    from specee.model.llama import Transformer

    with pytest.raises(CheckpointError, match="tensor blk.1.ffn_down.weight holds NaN"):
        Transformer.load(path, quantization="auto")


def test_real_gguf_with_random_data_is_refused(tmp_path, capsys):
    if not SMOLLM2.exists():
        pytest.skip(f"SmolLM2 GGUF not available: {SMOLLM2} is absent")
    bad = random_data(SMOLLM2, tmp_path / "bad.gguf")
    with pytest.raises(CheckpointError, match="holds NaN or infinite values"):
        LLM(bad, quantization=None)
    code, _, err = run_cli(capsys, "generate", "--model", str(bad), "--prompt", "hi")  # auto: the raw blocks
    assert_one_line_error(code, err, "bad.gguf: tensor", "holds NaN or infinite values")


def test_safetensors_with_an_inf_is_refused(tiny_checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    path = clone_checkpoint(tiny_checkpoint("llama2"), tmp_path / "model")
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"][3, 5] = float("inf")
    (path / "model.safetensors").unlink()  # the clone's weights are a link to the shared checkpoint
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(CheckpointError, match="tensor model.layers.1.mlp.up_proj.weight holds NaN or infinite"):
        LLM(path)


# ---- NaN logits while decoding ----------------------------------------------------------------
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_nan_logits_end_that_request_as_an_error(tiny_checkpoint, temperature):
    llm = LLM(tiny_checkpoint("llama2"), dtype="float32")
    prompts = ["Once upon a time", "Tom and his friend"]
    params = SamplingParams(max_tokens=8, temperature=temperature, seed=3, ignore_eos=True)
    clean = llm.generate(prompts, params)
    real, calls = llm.model.logits, []

    def poisoned(h: torch.Tensor) -> torch.Tensor:
        logits = real(h)
        calls.append(None)
        if len(calls) == 3:  # the first request's third token
            logits[0, 7] = float("nan")
        return logits

    llm.model.logits = poisoned
    first, second = llm.generate(prompts, params)
    assert first.finish_reason == "error" and "NaN or infinite at output token 3" in first.error
    assert first.token_ids == clean[0].token_ids[:2] and first.text and clean[0].text.startswith(first.text)
    assert second.finish_reason == "length" and second.error is None and second.token_ids == clean[1].token_ids


def test_nan_logits_in_generate_are_a_one_line_error(tiny_checkpoint, capsys, monkeypatch):
    from specee.model.llama import Transformer

    monkeypatch.setattr(Transformer, "logits", lambda self, h: torch.full((h.shape[0], self.cfg.vocab_size), torch.nan))
    code, out, err = run_cli(capsys, "generate", "--model", str(tiny_checkpoint("llama2")), "--prompt", "hi",
                             "--no-chat")
    assert_one_line_error(code, err, "logits are NaN or infinite at output token 1")
    assert out.strip() == ""
