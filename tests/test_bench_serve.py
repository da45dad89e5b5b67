"""`specee bench serve` against a live specee server on loopback: every level's requests finish,
tokens and latencies are counted, and the command writes its report and figure."""
from __future__ import annotations

import json

import pytest
from conftest import real_model_dir

pytest.importorskip("fastapi", reason="the server extra (pip install 'specee[server]') is not installed")
pytest.importorskip("openai", reason="the openai client (requirements-ci.txt) is not installed")

from server_helpers import LiveServer  # noqa: E402

from specee import LLM  # noqa: E402
from specee.bench.serve import run_serve_bench  # noqa: E402
from specee.bench.tasks import Prompt  # noqa: E402
from specee.cli import main  # noqa: E402
from specee.server import create_app  # noqa: E402


@pytest.fixture(scope="module")
def server():
    server = LiveServer(create_app(LLM(real_model_dir("stories260K"), dtype="float32"), model_name="stories"))
    yield server
    server.stop()


def test_refused_requests_are_counted_as_errors(server):
    prompts = [Prompt(str(i), "story", t) for i, t in enumerate(["Once upon a time", "The little dog"])]
    # stories260K has no chat template: every request is refused, and counted as an error
    report = run_serve_bench({"specee": server.url}, prompts, concurrency=[1, 4], max_tokens=8, requests=4)
    assert [(r["concurrency"], r["errors"]) for r in report["rows"]] == [(1, 4), (4, 4)]
    assert "no chat template" in report["rows"][0]["first_error"]


def test_a_server_without_ignore_eos_gets_min_tokens(server):
    """llama-cpp-python's server drops fields it does not know; it is sent min_tokens instead (specee, which
    refuses unknown fields, shows which field was sent)."""
    prompts = [Prompt("0", "story", "Once upon a time")]
    report = run_serve_bench({"other": server.url}, prompts, concurrency=[1], max_tokens=8, requests=1,
                             eos_fields={"other": "min_tokens"})
    row = report["rows"][0]
    assert row["eos_field"] == "min_tokens" and row["errors"] == 1 and "min_tokens" in row["first_error"]


def test_the_command_writes_its_report_and_figure(tmp_path):
    llm = LLM(real_model_dir("ref-target-24L"), dtype="float32")  # a chat template: chat completions run
    server = LiveServer(create_app(llm, model_name="ref"))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("What is the capital of France?\nName three colours.\n")
    try:
        code = main(["bench", "serve", "--server", f"ref={server.url}", "--concurrency", "1,2", "--requests", "4",
                     "--max-new-tokens", "6", "--prompts", str(prompts), "--out", str(tmp_path / "out")])
    finally:
        server.stop()
    assert code == 0
    rows = json.loads((tmp_path / "out" / "report.json").read_text())["rows"]
    assert [(r["concurrency"], r["errors"], r["tokens"]) for r in rows] == [(1, 0, 24), (2, 0, 24)]
    assert all(r["ttft_p50"] > 0 and r["itl_p50"] > 0 and r["tokens_per_second"] > 0 for r in rows)
    assert all(r["short_answers"] == 0 and len(r["load_average"]) == 2 for r in rows)
    assert "load avg" in (tmp_path / "out" / "report.md").read_text()
    assert (tmp_path / "out" / "serve.png").stat().st_size > 0


@pytest.mark.parametrize("flag,value,says", [
    ("--concurrency", "0", "expected comma-separated positive integers, got '0'"),  # waited forever on a Semaphore(0)
    ("--concurrency", "1,-1", "expected comma-separated positive integers"),  # said only "Semaphore initial value"
    ("--out", "/proc/nope", "--out: cannot write in /proc"),  # ran the whole load test first
])
def test_bad_flags_are_refused_before_any_request(capsys, flag, value, says):
    from specee.cli import main

    args = ["bench", "serve", "--server", "x=http://127.0.0.1:9", "--served-model", "m", flag, value]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err


def test_a_run_whose_every_request_fails_is_one_error_and_writes_nothing(server, tmp_path, capsys):
    """It wrote report.json, then failed in matplotlib's log scale (no latency to plot), leaving a half report."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Once upon a time\n")
    code = main(["bench", "serve", "--server", f"stories={server.url}", "--concurrency", "1", "--requests", "2",
                 "--max-new-tokens", "4", "--prompts", str(prompts), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and "every request failed" in err and "no chat template" in err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
