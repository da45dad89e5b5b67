"""End-to-end tests of the `specee` command line, run in-process through `specee.cli.main`."""
from __future__ import annotations

import argparse
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import run_cli as run

import specee
from specee import LLM, SamplingParams
from specee import cli
from specee.tokenizer import Tokenizer

SHARED = Path(__file__).resolve().parents[2] / "shared"
STORIES = SHARED / "models" / "stories260K"
TARGET = SHARED / "models" / "ref-target-24L"

needs_stories = pytest.mark.skipif(not STORIES.is_dir(), reason=f"shared models not found at {STORIES} (../shared is absent)")
needs_target = pytest.mark.skipif(not TARGET.is_dir(), reason=f"shared models not found at {TARGET} (../shared is absent)")

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def stories_llm() -> LLM:
    if not STORIES.is_dir():
        pytest.skip(f"shared models not found at {STORIES} (../shared is absent)")
    return LLM(STORIES)


# ---- generate ------------------------------------------------------------------------------
@needs_stories
def test_generate_matches_llm_generate(capsys, stories_llm):
    code, out, err = run(capsys, "generate", "--model", str(STORIES), "--prompt", PROMPT, "--no-chat",
                         "--max-new-tokens", "24")
    assert code == 0, err
    expected = stories_llm.generate(PROMPT, SamplingParams(max_tokens=24))[0]
    assert expected.text.strip()
    assert out == expected.text + "\n"
    assert "24 tokens in" in err and "tokens/s" in err
    assert "note:" not in err  # --no-chat: no template fallback note


@needs_stories
@pytest.mark.parametrize("extra", [[], ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']])
def test_generate_sizes_the_kv_pool_to_its_request(capsys, monkeypatch, stories_llm, extra):
    """One request: a pool of its prompt + max tokens + the decoding's extra rows (not the default 1 GiB),
    with the same text; --kv-cache-memory still wins."""
    from specee.cli import run as cli_run

    built = []
    real = cli_run.load_llm
    monkeypatch.setattr(cli_run, "load_llm", lambda args: built.append(real(args)) or built[-1])
    code, out, err = run(capsys, "generate", "--model", str(STORIES), "--prompt", PROMPT, "--no-chat",
                         "--max-new-tokens", "24", *extra)
    assert code == 0, err
    llm = built[-1]
    needed = len(llm.encode(PROMPT)) + 24 + llm.engine.decoding.extra_rows
    assert needed <= llm.engine.kv.capacity < needed + 16  # whole blocks of 16 slots
    assert llm.engine.decoding.extra_rows == (4 if extra else 0)
    assert out == stories_llm.generate(PROMPT, SamplingParams(max_tokens=24))[0].text + "\n"
    code, _, err = run(capsys, "generate", "--model", str(STORIES), "--prompt", PROMPT, "--no-chat",
                       "--max-new-tokens", "24", "--kv-cache-memory", "4096", *extra)
    assert code == 0, err
    assert built[-1].engine.kv.capacity == 4096


@needs_stories
def test_generate_json(capsys, stories_llm):
    code, out, err = run(capsys, "generate", "--model", str(STORIES), "--prompt", PROMPT, "--no-chat",
                         "--max-new-tokens", "12", "--json")
    assert code == 0, err
    record = json.loads(out)
    expected = stories_llm.generate(PROMPT, SamplingParams(max_tokens=12))[0]
    assert record["text"] == expected.text
    assert record["token_ids"] == expected.token_ids
    assert record["prompt_token_ids"] == expected.prompt_token_ids
    assert record["finish_reason"] == "length"
    assert record["chat"] is False
    assert record["stats"]["generated_tokens"] == 12
    assert record["stats"]["prompt_tokens"] == len(expected.prompt_token_ids)


@needs_stories
def test_generate_without_template_falls_back_to_raw_text(capsys, stories_llm):
    code, out, err = run(capsys, "generate", "--model", str(STORIES), "--prompt", PROMPT, "--max-new-tokens", "8")
    assert code == 0, err
    assert "no chat template" in err and err.count("note:") == 1
    assert out == stories_llm.generate(PROMPT, SamplingParams(max_tokens=8))[0].text + "\n"


@needs_stories
def test_generate_prompt_from_stdin(capsys, monkeypatch, stories_llm):
    monkeypatch.setattr(sys, "stdin", io.StringIO(PROMPT + "\n"))
    code, out, err = run(capsys, "generate", "--model", str(STORIES), "--prompt", "-", "--no-chat",
                         "--max-new-tokens", "8")
    assert code == 0, err
    assert out == stories_llm.generate(PROMPT, SamplingParams(max_tokens=8))[0].text + "\n"


@pytest.mark.parametrize("prompt, stdin", [("", ""), ("  \n", ""), ("-", "\n")])
def test_empty_prompt_is_refused_before_loading(capsys, monkeypatch, prompt, stdin):
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    code, out, err = run(capsys, "generate", "--model", "/nonexistent/model", "--prompt", prompt)
    assert_clean_error(code, err, "empty prompt")
    assert out == ""


@needs_stories
def test_generate_stop_string_and_detailed_stats(capsys, stories_llm):
    full = stories_llm.generate(PROMPT, SamplingParams(max_tokens=40))[0].text
    assert "." in full
    code, out, err = run(capsys, "generate", "--model", str(STORIES), "--prompt", PROMPT, "--no-chat",
                         "--max-new-tokens", "40", "--stop", ".", "--stats")
    assert code == 0, err
    assert out == full[: full.index(".")] + "\n"
    assert "decode_tokens_per_second" in err and "prompt_tokens" in err


@needs_stories
def test_generate_seeded_sampling_is_reproducible(capsys):
    args = ("generate", "--model", str(STORIES), "--prompt", PROMPT, "--no-chat", "--max-new-tokens", "16",
            "--temperature", "1.0", "--top-k", "20", "--top-p", "0.9", "--seed", "7", "--json")
    first = json.loads(run(capsys, *args)[1])
    second = json.loads(run(capsys, *args)[1])
    assert first["token_ids"] == second["token_ids"]


@needs_target
def test_generate_applies_chat_template(capsys):
    code, out, err = run(capsys, "generate", "--model", str(TARGET), "--prompt", "What is 2+2?",
                         "--max-new-tokens", "6", "--json")
    assert code == 0, err
    record = json.loads(out)
    assert record["chat"] is True
    tok = Tokenizer(TARGET)
    assert record["prompt_token_ids"] == tok.encode_chat([{"role": "user", "content": "What is 2+2?"}])


# ---- errors --------------------------------------------------------------------------------
def assert_clean_error(code: int, err: str, *needles: str) -> None:
    assert code == 2
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("specee: error: "), err
    for needle in needles:
        assert needle in lines[0]


def test_bad_model_path_is_a_clean_error(capsys, tmp_path):
    missing = tmp_path / "no-such-model"
    code, out, err = run(capsys, "generate", "--model", str(missing), "--prompt", "hi")
    assert_clean_error(code, err, "model directory not found", str(missing))
    assert out == ""


def test_directory_without_config_is_a_clean_error(capsys, tmp_path):
    code, _, err = run(capsys, "info", "--model", str(tmp_path))
    assert_clean_error(code, err, "config.json")


@needs_stories
def test_library_value_errors_are_clean(capsys):
    code, _, err = run(capsys, "generate", "--model", str(STORIES), "--prompt", PROMPT, "--no-chat",
                       "--temperature", "-1")
    assert_clean_error(code, err, "temperature")
    code, _, err = run(capsys, "generate", "--model", str(STORIES), "--prompt", PROMPT, "--no-chat",
                       "--max-new-tokens", "1000")  # stories260K has a 512-token context
    assert_clean_error(code, err, "context")


@needs_stories
def test_early_exit_flag_errors_name_the_flags(capsys):
    """Each combination that cannot run names the flags the user typed, not the library's field names."""
    code, _, err = run(capsys, "generate", "--model", str(STORIES), "--prompt", PROMPT, "--mode", "lossless")
    assert_clean_error(code, err, "--mode lossless", "--draft")
    for flag, value in (("--kv-policy", "skip"), ("--threshold-scale", "2.5"), ("--k", "8"), ("--max-pending", "1")):
        code, _, err = run(capsys, "generate", "--model", str(STORIES), "--prompt", PROMPT, flag, value)
        assert_clean_error(code, err, f"{flag} {value} is early exit", "--draft")  # it ran full depth, silently
    code, _, err = run(capsys, "generate", "--model", str(STORIES), "--prompt", PROMPT, "--draft", "ngram",
                       "--mode", "lossless", "--kv-policy", "skip")
    assert_clean_error(code, err, "--mode lossless needs --kv-policy recompute", "--kv-policy skip")
    code, _, err = run(capsys, "generate", "--model", str(STORIES), "--prompt", PROMPT, "--speculative-config",
                       '{"method": "ngram", "num_speculative_tokens": 0}')
    assert_clean_error(code, err, "--speculative-config: num_speculative_tokens")


def test_missing_default_model_asks_for_model(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(cli.args, "default_model_candidates", lambda: [tmp_path / "absent"])
    code, _, err = run(capsys, "generate", "--prompt", "hi")
    assert_clean_error(code, err, "--model")


def test_usage_errors_exit_2(capsys):
    code, _, err = run(capsys, "generate")  # --prompt is required
    assert code == 2 and "--prompt" in err
    code, _, err = run(capsys, "generate", "--prompt", "hi", "--max-new-tokens", "0")
    assert code == 2 and "positive integer" in err
    code, _, err = run(capsys, "calibrate", "-o", "x", "--draft-vocab", "-5")
    assert code == 2 and "non-negative integer" in err
    code, _, err = run(capsys, "frobnicate")
    assert code == 2


# ---- info ----------------------------------------------------------------------------------
@needs_stories
def test_info(capsys):
    code, out, err = run(capsys, "info", "--model", str(STORIES))
    assert code == 0, err
    fields = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in out.splitlines())
    assert fields["architecture"] == "LlamaForCausalLM"
    assert fields["layers"] == "5"
    assert fields["hidden size"].startswith("64")
    assert fields["heads / kv heads"].startswith("8 / 4 (GQA)")
    assert fields["vocab"] == "512"
    assert fields["context"].startswith("512")
    assert fields["dtype"].startswith("float32")
    assert fields["tied embeddings"] == "no"
    assert "chat template: no" in fields["tokenizer"]
    assert fields["parameters"].startswith("0.29 M")


@needs_target
def test_info_json(capsys):
    code, out, err = run(capsys, "info", "--model", str(TARGET), "--json")
    assert code == 0, err
    info = json.loads(out)
    assert (info["layers"], info["hidden_size"], info["attention_heads"], info["kv_heads"]) == (24, 256, 4, 2)
    assert (info["vocab_size"], info["context"], info["checkpoint_dtype"]) == (8192, 2048, "bfloat16")
    assert info["tied_embeddings"] is True and info["chat_template"] is True


# ---- chat ----------------------------------------------------------------------------------
@needs_target
def test_chat_keeps_history_and_resets(capsys, monkeypatch):
    seen: list[list[dict[str, str]]] = []
    original = Tokenizer.encode_chat

    def spy(self, messages):
        seen.append([dict(m) for m in messages])
        return original(self, messages)

    monkeypatch.setattr(Tokenizer, "encode_chat", spy)
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello\nWhat next?\n/reset\n\nAgain\n/exit\nnever read\n"))
    code, out, err = run(capsys, "chat", "--model", str(TARGET), "--max-new-tokens", "5", "--system", "Be brief.")
    assert code == 0, err
    check, *seen = seen  # before loading: does the system prompt leave room for --max-new-tokens?
    assert check == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": ""}]
    assert [[m["role"] for m in msgs] for msgs in seen] == [
        ["system", "user"], ["system", "user", "assistant", "user"], ["system", "user"]]
    first_reply = seen[1][2]["content"]
    assert seen[1][3]["content"] == "What next?" and seen[2][1]["content"] == "Again"
    expected = LLM(TARGET).generate(Tokenizer(TARGET).encode_chat(seen[0]), SamplingParams(max_tokens=5))[0].text
    assert first_reply == expected
    assert out.startswith(expected + "\n")
    assert "conversation cleared" in err


@needs_stories
def test_chat_needs_a_template(capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\n"))
    code, _, err = run(capsys, "chat", "--model", str(STORIES))
    assert_clean_error(code, err, "no chat template")


# ---- python -m specee ----------------------------------------------------------------------
@needs_stories
def test_python_dash_m():
    env = {**os.environ, "PYTHONPATH": str(Path(specee.__file__).resolve().parents[1])}
    done = subprocess.run([sys.executable, "-m", "specee", "info", "--model", str(STORIES)],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "LlamaForCausalLM" in done.stdout


def test_generate_defaults_to_the_fastest_measured_weights():
    """generate and chat pass LLM's own default, auto (on CPU a GGUF's own quantized blocks natively; on
    CUDA, where nothing is measured yet, LLM runs float); the benchmark keeps float weights as its reference."""
    from specee.bench.cli import add_bench_parser

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    cli.add_generate_parser(sub)
    cli.add_chat_parser(sub)
    add_bench_parser(sub)
    mode = lambda *argv: cli.args.quantization_mode(parser.parse_args(list(argv)))  # noqa: E731
    assert mode("generate", "--prompt", "x") == "auto" and mode("chat") == "auto"
    assert mode("generate", "--prompt", "x", "--device", "cuda") == "auto"
    assert mode("generate", "--prompt", "x", "--quantization", "none") is None
    assert mode("generate", "--prompt", "x", "--quantization", "int8", "--device", "cuda") == "int8"
    assert mode("bench", "speed", "--draft", "ngram") is None
    assert mode("bench", "speed", "--draft", "ngram", "--quantization", "int4") == "int4"


@needs_stories
@pytest.mark.parametrize("mean_layers, warned", [(4.8, True), (3.0, False)])
def test_generate_says_when_early_exit_cannot_pay(capsys, tmp_path, stories_llm, mean_layers, warned):
    """The note comes from the bank's calibrated depth: under 20% of layers saved it says so, and
    decoding goes on either way."""
    import math

    import torch

    from specee.exit.bank import PredictorBank

    L, k = stories_llm.model.cfg.num_layers, 4
    bank = PredictorBank(torch.zeros(L, 3 * k, 4), torch.zeros(L, 4), torch.zeros(L, 4), torch.zeros(L),
                         [math.inf] * L, [], k, stories_llm.fingerprint, "ngram-n3",
                         summary={"num_layers": L, "cross_validated": {"mean_exit_layer": mean_layers}})
    bank.save(tmp_path / "bank")
    code, out, err = run(capsys, "generate", "--model", str(STORIES), "--no-chat", "--draft", "ngram", "--bank",
                         str(tmp_path / "bank"), "--prompt", "Once upon a time", "--max-new-tokens", "4")
    assert code == 0 and out.strip()
    saved = round(100 * (1 - mean_layers / L))
    assert (f"expected to skip {saved}% of the layers" in err) == warned


def test_generate_and_chat_prefill_whole_prompts_and_serve_in_parts():
    """One request (generate, chat): nobody decodes beside its prompt, which prefills at once; a
    server cuts long prompts into parts unless told otherwise."""
    from specee.cli import build_parser
    from specee.cli.args import scheduling
    from specee.engine.scheduling import DEFAULT_MAX_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS, DEFAULT_PREFILL_CHUNK

    parser = build_parser()
    assert scheduling(parser.parse_args(["generate", "--prompt", "hi"])) == {"prefill_chunk": 0}
    assert scheduling(parser.parse_args(["chat"])) == {"prefill_chunk": 0}
    assert scheduling(parser.parse_args(["serve"])) == {"max_num_seqs": DEFAULT_MAX_NUM_SEQS,
                                                        "max_num_batched_tokens": DEFAULT_MAX_BATCHED_TOKENS,
                                                        "prefill_chunk": DEFAULT_PREFILL_CHUNK}
    assert scheduling(parser.parse_args(["serve", "--prefill-chunk", "64"]))["prefill_chunk"] == 64


@needs_stories
def test_serve_max_num_seqs_reaches_the_engine_and_admission():
    """`serve --max-num-seqs` bounds the engine's running batch (it once set only the 429 arithmetic), and
    the server's admission counts from the same number."""
    pytest.importorskip("fastapi")
    from specee.cli import build_parser
    from specee.cli.args import load_llm
    from specee.server import create_app

    args = build_parser().parse_args(["serve", "--model", str(STORIES), "--max-num-seqs", "3", "--threads", "1"])
    llm = load_llm(args)
    assert llm.scheduling["max_num_seqs"] == 3 and llm.engine.scheduler.max_num_seqs == 3
    assert create_app(llm).state.specee.max_num_seqs == 3
    llm.close()


@pytest.mark.parametrize("argv, says", [
    (["generate", "--model", "", "--prompt", "hi"], "--model is empty"),  # Path("") loaded the cwd's one .gguf
    (["serve", "--model", "/nonexistent/model", "--replicas", "2"], "--replicas 2 needs --ray"),  # was ignored
    (["serve", "--model", "/nonexistent/model", "--api-key", ""], "--api-key (or $SPECEE_API_KEY) is empty"),
    (["serve", "--model", "/nonexistent/model", "--served-model-name", " "], "--served-model-name is empty"),
])
def test_empty_or_idle_flags_are_refused_before_loading(capsys, tmp_path, monkeypatch, argv, says):
    """An empty --api-key let a bare `Authorization: Bearer` header in; the others did nothing or the wrong thing."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.gguf").write_bytes(b"")
    code, out, err = run(capsys, *argv)
    assert_clean_error(code, err, says)


@pytest.mark.parametrize("command", [["serve"], ["generate", "--prompt", "hi"]])
def test_a_truncated_gguf_is_refused_before_the_server_starts(capsys, tmp_path, monkeypatch, command):
    """`serve` read a truncated GGUF only inside the started server, and printed its error twice."""
    import uvicorn

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 7)  # a header cut short
    monkeypatch.setattr(uvicorn.Server, "run", lambda self: pytest.fail("the server started"))
    monkeypatch.setattr("specee.cli.serve.check_address", lambda host, port: None)  # port 8000 may be taken
    code, out, err = run(capsys, *command, "--model", str(gguf))
    assert_clean_error(code, err, f"{gguf}: not a readable GGUF file (truncated or corrupt")
