"""Bad values are refused in one line naming the flag or argument, before any model loads: the CLI's
flags (argparse errors included), SamplingParams, LLM's arguments, speculative configs, a draft with
another tokenizer, and prompts that are not valid UTF-8."""
from __future__ import annotations

import io
import re
import sys

import pytest
from conftest import MODELS
from cli_helpers import assert_one_line_error, run_cli

from specee import LLM, SamplingParams
from specee.drafters import DrafterMismatchError

STORIES, TARGET = MODELS / "stories260K", MODELS / "ref-target-24L"
needs_models = pytest.mark.skipif(not (STORIES.is_dir() and TARGET.is_dir()),
                                  reason=f"shared models not found under {MODELS} (../shared is absent)")


@pytest.fixture
def no_model_loads(monkeypatch):
    import specee.engine.llm as llm_module

    def never(*_a, **_k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(llm_module.LLM, "__init__", never)


# ---- the command line ------------------------------------------------------------------------
@pytest.mark.parametrize("argv, needles", [
    (["generate", "--prompt", "hi", "--draft", "ngram", "--threshold-scale", "nan"], ["--threshold-scale", "'nan'"]),
    (["generate", "--prompt", "hi", "--seed", str(2**70)], ["--seed", "2**64"]),
    (["generate", "--prompt", "hi", "--draft", "ngram", "--online-window", "-1"], ["--online-window"]),
    (["generate", "--prompt", "hi", "--temperature", "-0.5"], ["--temperature"]),
    (["generate", "--prompt", "hi", "--temperature", "inf"], ["--temperature"]),
    (["generate", "--prompt", "hi", "--top-p", "0"], ["--top-p"]),
    (["generate", "--prompt", "hi", "--top-k", "-2"], ["--top-k"]),
    (["generate", "--prompt", "hi", "--stop", ""], ["--stop must hold non-empty strings"]),
    (["generate", "--prompt", "hi", "--draft", "ngram", "--bank", "/nonexistent/bank"], ["--bank", "no such file"]),
    (["train-draft", "-o", "/tmp/specee-head", "--data", "/nonexistent"], ["--data", "no such file"]),
    (["distill", "-o", "/tmp/specee-distilled.json", "--data", "/nonexistent"], ["--data", "no such file"]),
    (["bench", "speed", "--draft-tokens", "100000"], ["--draft-tokens", "0 to 64"]),  # it ran, reporting 100000
    (["bench", "oracle", "--draft-tokens", "65"], ["--draft-tokens", "0 to 64"]),
    (["bench", "speed", "--oracle-layers=-5"], ["--oracle-layers", "'-5'"]),  # a negative speedup ceiling, once
    (["bench", "speed", "--check-cost", "nan"], ["--check-cost", "'nan'"]),
    (["bench", "quality", "--ppl-file", "/nonexistent"], ["--ppl-file", "no such file"]),
    (["bench", "quality", "--ppl-file", "/tmp"], ["--ppl-file", "is not a file"]),
    (["bench", "quality", "--ppl-file", "/dev/null"], ["--ppl-file", "is not a file"]),
    (["bench", "speed", "--bank", "/nonexistent"], ["--bank", "no such file"]),
    (["tune", "--prompt-file", "/nonexistent"], ["--prompt-file: /nonexistent is not found"]),
    (["bench", "quality", "--policies", "bogus"], ["--policies: unknown ['bogus']"]),  # found after loading, once
    (["bench", "sweep", "--scales", "x"], ["--scales: bad list"]),
    (["bench", "sweep", "--scales", "nan"], ["--scales must be finite and > 0"]),
    (["bench", "sweep", "--online-windows", "x"], ["--online-windows: bad list"]),
    (["bench", "sweep", "--offline-sizes=-1"], ["--offline-sizes must be >= 0"]),
    (["generate"], ["required: --prompt", "specee generate --help"]),
    (["frobnicate"], ["invalid choice: 'frobnicate'"]),
    (["generate", "--prompt", "hi", "--max-tokens", "3"],  # named `specee --help`
     ["generate: unrecognized arguments: --max-tokens 3", "`specee generate --help`"]),
    (["bench", "speed", "--bogus"], ["bench speed: unrecognized arguments: --bogus", "`specee bench speed --help`"]),
    (["bench", "speed", "--threshold-scale", "0"], ["bench speed", "--threshold-scale"]),
    (["generate", "--prompt", "hi", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 100000}'],
     ["num_speculative_tokens", "100000"]),
    (["serve", "--prefill-chunk", "5"], ["--prefill-chunk", "0 (whole prompts) or at least 32", "'5'"]),
    (["serve", "--max-num-batched-tokens", "0"], ["--max-num-batched-tokens"]),
    (["serve", "--port", "99999"], ["--port", "from 1 to 65535", "'99999'"]),
    (["serve", "--port", "0"], ["--port"]),
])
def test_bad_flags_are_one_line_before_any_work(capsys, no_model_loads, argv, needles):
    code, _, err = run_cli(capsys, *argv)
    assert_one_line_error(code, err, *needles)
    assert "usage:" not in err


@needs_models
@pytest.mark.parametrize("ray", [[], ["--ray"]], ids=["uvicorn", "ray"])
@pytest.mark.parametrize("host", ["127.0.0.1", "no-such-host.invalid", "192.0.2.1"])
def test_serve_on_a_busy_port_or_unknown_host_fails_before_the_model_loads(capsys, no_model_loads, monkeypatch, host,
                                                                           ray):
    """uvicorn found a busy port only after start-up (its own log lines, exit status 3); with --ray, after a
    local Ray cluster had started. 192.0.2.1 (TEST-NET-1) is no address of this machine."""
    import socket

    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # a local cluster, whose proxy binds on this machine
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, _, err = run_cli(capsys, "serve", "--model", str(STORIES), "--host", host, "--port", str(port), *ray)
    assert_one_line_error(code, err, *(["--port", f"127.0.0.1:{port}", "in use"] if host == "127.0.0.1" else
                                       ["--host", repr(host)]))


@needs_models
@pytest.mark.parametrize("argv, needles", [
    (["--speculative-config", '{"method": "ngramm"}'], ["--speculative-config", "method must be one of"]),
    (["--mode", "lossless"], ["--mode lossless is early exit", "--draft"]),
    (["--speculative-config", '{"method": "draft_model", "model": 5}'], ["--speculative-config", "needs 'model'"]),
])
def test_serve_refuses_bad_decoding_flags_before_its_server_starts(capsys, no_model_loads, monkeypatch, argv, needles):
    """They were found by the model's load in the started server: uvicorn's start-up and shutdown lines, then
    the error twice."""
    import uvicorn

    monkeypatch.setattr(uvicorn.Server, "run", lambda self: pytest.fail("the server started"))
    code, _, err = run_cli(capsys, "serve", "--model", str(STORIES), "--port", "8391", *argv)
    assert_one_line_error(code, err, *needles)


@needs_models
def test_chat_without_a_template_or_past_the_context_fails_before_the_model_loads(capsys, no_model_loads, monkeypatch):
    """Both were found after loading; the second then printed an error at every turn and exited 0."""
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n"))
    code, _, err = run_cli(capsys, "chat", "--model", str(STORIES))
    assert_one_line_error(code, err, "has no chat template, which chat needs")
    code, _, err = run_cli(capsys, "chat", "--model", str(TARGET), "--max-new-tokens", "100000")
    assert_one_line_error(code, err, "--max-new-tokens:", "exceeds the model's context of")


@needs_models
def test_a_prompt_longer_than_the_context_fails_before_the_model_loads(capsys, no_model_loads):
    """Only the tokenizer and the config are read: on a first run the kernels' build (minutes) came first."""
    code, _, err = run_cli(capsys, "generate", "--model", str(STORIES), "--no-chat", "--prompt", "once upon a time " * 400)
    assert_one_line_error(code, err, "--prompt:", "exceeds the model's context of", "--max-new-tokens")
    code, _, err = run_cli(capsys, "generate", "--model", str(STORIES), "--no-chat", "--prompt", "once",
                           "--max-new-tokens", "100000")
    assert_one_line_error(code, err, "--prompt:", "--max-new-tokens (100000)")


@needs_models
@pytest.mark.parametrize("argv, needles", [
    (["generate", "--prompt", "hi", "--draft", "ngram", "--bank", "{tmp}"],
     ["argument --bank: ", "not a predictor bank (manifest.json is missing)"]),
    (["bench", "speed", "--bank", "{tmp}"], ["argument --bank: ", "not a predictor bank (manifest.json is missing)"]),
    (["generate", "--model", "{stories}", "--prompt", "hi", "--speculative-config", '{"method": "eagle", "model": "{tmp}"}'],
     ["--speculative-config: model {tmp}: not an EAGLE head directory"]),
    (["train-draft", "--model", "{stories}", "-o", "{tmp}/head", "--resume"], ["--resume: nothing to resume"]),
    (["train-draft", "--model", "{stories}", "-o", "{tmp}/head", "--feature-layers", "99,1,2"],
     ["--feature-layers: ", "in [0, 5), got [99, 1, 2]"]),
    (["calibrate", "--model", "{stories}", "--draft", "{stories}", "-o", "{tmp}/bank", "--draft-vocab", "999999"],
     ["--draft-vocab 999999 exceeds the draft's vocabulary (512 tokens)"]),
    (["calibrate", "--model", "{stories}", "--draft", "ngram", "-o", "{tmp}/bank", "--max-new-tokens", "100000"],
     ["--max-new-tokens 100000 leaves no room", "context of 512 tokens"]),
    (["distill", "--model", "{stories}", "-o", "{tmp}/d.json", "--max-new-tokens", "100000"],
     ["--max-new-tokens 100000 leaves no room", "context of 512 tokens"]),
    (["bench", "speed", "--model", "{stories}", "--draft", "ngram", "--hf-assistant", "/nonexistent"],
     ["--hf-assistant: ", "not found: /nonexistent"]),
    (["bench", "speed", "--model", "{stories}", "--draft", "ngram", "--llama-cpp-lookup", "3"],
     ["--llama-cpp-lookup needs a .gguf target"]),
], ids=["bank", "bench-bank", "eagle-head", "resume", "feature-layers", "draft-vocab", "calibrate-max-new-tokens",
        "distill-max-new-tokens", "hf-assistant", "llama-cpp-lookup"])
def test_values_the_model_files_refuse_fail_before_the_model_loads(capsys, no_model_loads, tmp_path, argv, needles):
    """Each was found only after the model (and, for bench, its calibration) had loaded: 10-80 s later,
    some without the flag's name."""
    def fill(text: str) -> str:
        return text.replace("{tmp}", str(tmp_path)).replace("{stories}", str(STORIES))

    code, _, err = run_cli(capsys, *map(fill, argv))
    assert_one_line_error(code, err, *map(fill, needles))


@needs_models
def test_quantization_that_does_not_fit_names_the_flag(capsys):
    code, _, err = run_cli(capsys, "generate", "--model", str(STORIES), "--no-chat", "--prompt", "hi",
                           "--quantization", "int4")
    err = "\n".join(line for line in err.splitlines() if "building the CPU kernels" not in line)  # a first run's note
    assert_one_line_error(code, err, "--quantization int4: int4 needs", "--quantization none")


@needs_models
def test_draft_with_another_tokenizer_is_refused_before_weights_load(capsys, monkeypatch, tmp_path):
    from specee.model.llama import Transformer

    def never(*_a, **_k):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(Transformer, "load", never)
    spec = {"method": "draft_model", "model": str(STORIES), "num_speculative_tokens": 2}
    with pytest.raises(DrafterMismatchError) as e:
        LLM(TARGET, speculative_config=spec)
    assert "512 tokens vs 8192" in str(e.value) and len(str(e.value)) < 300
    assert "only in the target" in e.value.details  # the long comparison, on request
    code, _, err = run_cli(capsys, "generate", "--model", str(TARGET), "--prompt", "hi", "--draft", str(STORIES))
    assert_one_line_error(code, err, "has another tokenizer than target", "stories260K")
    code, _, err = run_cli(capsys, "calibrate", "--model", str(TARGET), "--draft", str(STORIES), "-o",
                           str(tmp_path / "bank"))
    assert_one_line_error(code, err, "has another tokenizer than target")


# ---- Python: SamplingParams and LLM's arguments ------------------------------------------------
@pytest.mark.parametrize("kwargs, error, needle", [
    ({"seed": "abc"}, TypeError, "seed"),
    ({"seed": 2**70}, ValueError, "seed must be in [0, 2**64)"),
    ({"seed": -1}, ValueError, "seed"),
    ({"stop": [1, 2]}, TypeError, "stop"),
    ({"stop": 5}, TypeError, "stop"),
    ({"temperature": "0.5"}, TypeError, "temperature"),
    ({"top_p": None}, TypeError, "top_p"),
    ({"top_k": True}, ValueError, "top_k"),
    ({"ignore_eos": "yes"}, TypeError, "ignore_eos"),
])
def test_sampling_params_are_checked_on_construction(kwargs, error, needle):
    with pytest.raises(error) as e:
        SamplingParams(**kwargs)
    assert needle in str(e.value)


def test_stop_none_means_no_stop_strings(tiny_llm):
    llm = tiny_llm("llama2")
    assert SamplingParams(stop=None).stop == ()
    out = llm.generate("Once upon a time", SamplingParams(max_tokens=4, stop=None, ignore_eos=True))[0]
    assert len(out.token_ids) == 4


@pytest.mark.parametrize("model, kwargs, error, needle", [
    (None, {}, TypeError, "model must be a path"),
    (123, {}, TypeError, "model must be a path"),
    ("x", {"device": "tpu"}, ValueError, "device must be 'cpu', 'cuda' or 'cuda:N', got 'tpu'"),
    ("x", {"device": "banana"}, ValueError, "device must be"),
    ("x", {"early_exit": [1]}, TypeError, "early_exit must be an EarlyExitConfig, a dict of its fields or None"),
    ("x", {"early_exit": {"draft": 5}}, TypeError, "draft must be a path"),
    # found after the weights loaded, once
    ("x", {"early_exit": {"mode": "lossy"}}, ValueError, "early_exit needs a drafter"),
    ("x", {"early_exit": {"draft": "ngram", "bank": "/nonexistent"}}, ValueError, "'/nonexistent' is not a directory"),
    ("x", {"early_exit": {"draft": "ngram", "bank": "/tmp"}}, ValueError, "/tmp: not a predictor bank (manifest.json"),
    ("x", {"kv_cache_memory": 0}, ValueError, "at least 1 token"),
    ("x", {"kv_cache_memory": "lots"}, ValueError, "is not a size like 512MiB"),
    ("x", {"kv_cache_dtype": "int8"}, ValueError, "kv_cache_dtype (--kv-cache-dtype) must be one of"),
])
def test_llm_arguments_are_checked_first(model, kwargs, error, needle):
    with pytest.raises(error) as e:
        LLM(model, **kwargs)
    assert needle in str(e.value)


def test_cuda_without_cuda_is_a_clear_error():
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(ValueError, match="device 'cuda': CUDA is not available"):
        LLM("x", device="cuda")


def test_online_window_and_threshold_scale_checked_in_python():
    from specee.exit.config import EarlyExitConfig

    with pytest.raises(ValueError, match="threshold_scale must be > 0 and finite, got nan"):
        EarlyExitConfig(draft="ngram", threshold_scale=float("nan"))
    with pytest.raises(ValueError, match="online_window must be an integer >= 0"):
        EarlyExitConfig(draft="ngram", online_window=-1)
    # a string or a number where the other belongs named no field ("'<' not supported ...") or passed
    for fields, needle in (({"threshold_scale": "1"}, "threshold_scale must be a number"),
                           ({"check_cost": "a"}, "check_cost must be a number"),
                           ({"draft": 5}, "draft must be a path"), ({"bank": 3}, "bank must be a path")):
        with pytest.raises(TypeError, match=needle):
            EarlyExitConfig(**fields)


def test_generate_and_stream_name_a_bad_argument(tiny_llm):
    """Each was a TypeError from deep inside (no len(), a dict's missing attribute, numpy's ambiguous truth
    value, an unpacking) or, for an empty list of SamplingParams, no error at all."""
    import numpy as np

    llm = tiny_llm("llama2")
    for args, error, needle in (((["a"], []), ValueError, "sampling_params: 0 SamplingParams for 1 prompts"),
                                ((["a"], {"max_tokens": 3}), TypeError, "sampling_params must be a SamplingParams"),
                                ((5,), TypeError, "prompts must be a str, a list of token ids"),
                                ((np.array([1, 2, 3]),), TypeError, "got ndarray")):
        with pytest.raises(error, match=needle):
            llm.generate(*args)
    with pytest.raises(TypeError, match="stream takes one prompt"):
        next(llm.stream(["a", "b"]))
    params = SamplingParams(max_tokens=3, ignore_eos=True)  # numpy ids are ids (they were "prompt must be a str")
    assert llm.generate([np.int64(5), np.int64(6)], params)[0].token_ids == llm.generate([5, 6], params)[0].token_ids


def test_last_output_is_this_threads_last_stream_closed_streams_included(tiny_llm):
    """`last_output` was one attribute: a stream in another thread replaced it, and a closed stream left the
    one before it (so finish_reason "abort" was never seen)."""
    import threading

    llm = tiny_llm("llama2")
    stream = llm.stream("Once upon a time", SamplingParams(max_tokens=50, ignore_eos=True))
    next(stream)
    stream.close()
    assert llm.last_output.finish_reason == "abort"
    seen = {}

    def consume(prompt: str) -> None:
        for _ in llm.stream(prompt, SamplingParams(max_tokens=30, ignore_eos=True)):
            pass
        seen[prompt] = llm.last_output.prompt

    threads = [threading.Thread(target=consume, args=(p,)) for p in ("Tom", "One day the sun")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == {"Tom": "Tom", "One day the sun": "One day the sun"}
    assert llm.last_output.finish_reason == "abort"  # this thread's own


# ---- prompts that are not valid UTF-8: refused, in the CLI and in Python ---------------------------
def test_invalid_utf8_prompt_in_argv_and_stdin(capsys, monkeypatch, no_model_loads):
    code, _, err = run_cli(capsys, "generate", "--prompt", "hi \udcff", "--no-chat")  # argv's surrogateescape
    assert_one_line_error(code, err, "--prompt is not valid UTF-8: byte 0xff at position 3")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"hi \xff\xfe")))
    code, _, err = run_cli(capsys, "generate", "--prompt", "-", "--no-chat")
    assert_one_line_error(code, err, "--prompt - (stdin) is not valid UTF-8: byte 0xff at position 3")


def test_invalid_utf8_prompt_in_python(tiny_llm):
    llm = tiny_llm("llama2")
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    for bad, needle in (("hi \udcff", "byte 0xff at position 3"), (b"hi \xfe", "byte 0xfe at position 3"),
                        ("x\ud800", "lone surrogate U+D800 at position 1")):
        with pytest.raises(ValueError, match=re.escape(f"prompt is not valid UTF-8: {needle}")):
            llm.generate(bad, params)
        with pytest.raises(ValueError, match="not valid UTF-8"):
            llm.tokenizer.encode(bad)
    assert llm.generate(b"Once upon", params)[0].token_ids == llm.generate("Once upon", params)[0].token_ids
