"""`specee tune`: it measures, prints the table and stores a profile; `generate` uses a profile that fits
this model, machine and thread count, says so, and ignores (with the reason) one that does not fit, a
corrupt one, and any under --no-tune or an explicit mode. Tiny budgets on the shared fixtures."""
from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch
from cli_helpers import assert_one_line_error, run_cli

from specee import cli
from specee.model.weights import fingerprint_weights
from specee.tune import profile

SHARED = Path(__file__).resolve().parents[2] / "shared" / "models"
STORIES, TARGET, DRAFT = SHARED / "stories260K", SHARED / "ref-target-24L", SHARED / "ref-draft-4L"
TINY = ("--prompts", "2", "--max-new-tokens", "12", "--rounds", "1", "--threads", "1")
NGRAM_2 = {"label": "n-gram speculation, 2 tokens", "speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}


def needs(*paths: Path):
    missing = [p for p in paths if not p.is_dir()]
    return pytest.mark.skipif(bool(missing), reason=f"shared models not found: {missing} (../shared is absent)")


@pytest.fixture(autouse=True)
def profiles(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("SPECEE_TUNE_DIR", str(tmp_path / "profiles"))
    monkeypatch.setenv("SPECEE_CACHE", str(tmp_path / "cache"))  # no predictor bank unless a test saves one
    before = torch.get_num_threads()
    yield tmp_path / "profiles"
    torch.set_num_threads(before)  # --threads 1 set it for the process


@pytest.fixture(scope="module")
def stories_tuned(tmp_path_factory) -> tuple[dict, str, str]:
    """(the stored profile, stdout, stderr) of one `specee tune` on stories260K, in a directory of its own."""
    if not STORIES.is_dir():
        pytest.skip(f"shared models not found at {STORIES}")
    root = tmp_path_factory.mktemp("tuned")
    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        mp.setenv("SPECEE_TUNE_DIR", str(root))
        mp.setenv("SPECEE_CACHE", str(root / "cache"))
        code = cli.main(["tune", "--model", str(STORIES), *TINY, "--lengths", "1,3"])
        assert code == 0, err.getvalue()
        return json.loads(profile.profile_path(STORIES).read_text()), out.getvalue(), err.getvalue()


def generate(capsys, *extra: str) -> tuple[dict, str]:
    code, out, err = run_cli(capsys, "generate", "--model", str(STORIES), "--no-chat", "--prompt", "Once upon a time",
                             "--max-new-tokens", "16", "--threads", "1", "--json", *extra)
    assert code == 0, err
    return json.loads(out), err


def write_profile(data: dict) -> Path:
    path = profile.profile_path(STORIES)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return path


def with_entry(data: dict, **changes) -> dict:
    """The profile with its one entry changed."""
    (entry,) = data["entries"]
    return {**data, "entries": [{**entry, **changes}]}


# ---- tune, then generate ------------------------------------------------------------------------------
@needs(STORIES)
def test_tune_writes_a_profile_that_generate_uses(stories_tuned, capsys):
    data, out, err = stories_tuned
    rows = [line for line in out.splitlines() if line.startswith("| ") and "configuration" not in line]
    assert [r.split(" | ")[0] for r in rows] == ["| full depth", "| n-gram speculation, 1 token",
                                                 "| n-gram speculation, 3 tokens"]
    assert sum("**chosen**" in r for r in rows) == 1
    assert "no predictor bank cached" in err and "stored in" in err  # early exit skipped, and said so
    (entry,) = data["entries"]
    assert data["fingerprint"] == fingerprint_weights(STORIES)
    assert entry["threads"] == 1 and entry["dtype"] == "float32" and entry["machine"] == profile.machine("cpu")
    chosen = next(r for r in rows if "**chosen**" in r)
    assert chosen.startswith(f"| {entry['config']['label']} |")
    assert [r["name"] for r in entry["results"]] == ["full", "ngram-1", "ngram-3"]
    assert all(r["differing_prompts"] == 0 for r in entry["results"])  # speculation is lossless

    write_profile(data)
    record, err = generate(capsys)
    assert f"using the tuned configuration for this model and CPU ({entry['config']['label']}" in err
    spec = entry["config"].get("speculative_config")
    assert record["stats"].get("speculative", {}).get("method") == (spec and spec["method"])


@needs(STORIES)
def test_generate_uses_a_speculative_profile_and_no_tune_ignores_it(stories_tuned, capsys):
    write_profile(with_entry(stories_tuned[0], config=NGRAM_2, ratio=1.3))
    tuned, err = generate(capsys)
    assert "(n-gram speculation, 2 tokens: 1.30x full depth, measured" in err
    assert tuned["stats"]["speculative"]["method"] == "ngram"
    plain, err = generate(capsys, "--no-tune")
    assert "tuned" not in err and "speculative" not in plain["stats"]
    assert tuned["token_ids"] == plain["token_ids"]  # greedy speculation equals full depth
    explicit, err = generate(capsys, "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 1}')
    assert "tuned" not in err and len(explicit["stats"]["speculative"]["acceptance_rate_per_position"]) == 1


@needs(STORIES)
@pytest.mark.parametrize("field, value, reason", [
    ("fingerprint", "0123456789abcdef", "measured on other weights"),
    ("machine", "Some Other CPU (avx2 kernels)", "measured on Some Other CPU (avx2 kernels)"),
    ("threads", 3, "measured with threads 3, and this run has 1"),
    ("quantization", "int8", "measured with quantization int8"),
])
def test_a_profile_for_other_conditions_is_ignored_with_the_reason(stories_tuned, capsys, field, value, reason):
    data = with_entry(stories_tuned[0], config=NGRAM_2, ratio=1.3)
    data = {**data, field: value} if field == "fingerprint" else with_entry(data, **{field: value})
    path = write_profile(data)
    record, err = generate(capsys)
    notes = [line for line in err.splitlines() if "tuned" in line]
    assert len(notes) == 1 and f"ignoring the tuned profile {path}: " in notes[0] and reason in notes[0], err
    assert "speculative" not in record["stats"]


@needs(STORIES)
def test_a_profile_measured_with_other_kernels_on_this_cpu_is_ignored(stories_tuned, capsys):
    """The kernels' build is part of the key: a ranking measured before a kernel change (session 11's
    threads and int8 activations changed it) must not pick the mode after it."""
    here = profile.machine("cpu")
    assert " build " in here and here.endswith(")")
    older = here.rsplit(" build ", 1)[0] + " build 0000000000000000)"
    path = write_profile(with_entry(stories_tuned[0], config=NGRAM_2, ratio=1.3, machine=older))
    record, err = generate(capsys)
    assert f"ignoring the tuned profile {path}: measured on {older}, and this run has {here}" in err, err
    assert "speculative" not in record["stats"]


@needs(STORIES)
@pytest.mark.parametrize("text, reason", [("{\"format\": ", "unreadable"), ("[]", "not a specee-tune-profile file"),
                                          (None, "an entry's 'threads' is missing"),
                                          ({"label": "x", "draft": {}}, "an entry's config 'draft' has no 'path' str"),
                                          ({"label": "x", "early_exit": {"draft": "ngram", "bank": "b"}},
                                           "an entry's config 'early_exit' has no 'k' int")])
def test_a_corrupt_profile_is_ignored_with_a_note(stories_tuned, capsys, text, reason):
    """Including configs without what applying them reads (an empty draft was a KeyError traceback)."""
    path = profile.profile_path(STORIES)
    path.parent.mkdir(parents=True)
    if text is None:  # valid JSON, an entry without its key
        (entry,) = stories_tuned[0]["entries"]
        text = json.dumps({**stories_tuned[0], "entries": [{k: v for k, v in entry.items() if k != "threads"}]})
    elif isinstance(text, dict):  # a config
        text = json.dumps(with_entry(stories_tuned[0], config=text, ratio=1.3))
    path.write_text(text)
    record, err = generate(capsys)
    assert f"ignoring the tuned profile {path}: {reason}" in err and "speculative" not in record["stats"]


def test_store_keeps_other_conditions_replaces_the_same_and_is_atomic(tmp_path, monkeypatch):
    entry = {"machine": "cpu A", "threads": 1, "quantization": "auto", "dtype": "float32", "measured": "2026-01-01",
             "ratio": 1.0, "config": {"label": "full depth"}}
    model = tmp_path / "model"
    path = profile.store(model, "f1", entry)
    assert path.stat().st_mode & 0o777 == 0o644  # readable by others sharing the directory (it was 0600)
    profile.store(model, "f1", {**entry, "threads": 2})
    profile.store(model, "f1", {**entry, "ratio": 1.5, "config": NGRAM_2})
    data = profile.read_profile(path)
    assert sorted((e["threads"], e["ratio"]) for e in data["entries"]) == [(1, 1.5), (2, 1.0)]
    assert profile.lookup(model, "f1", {k: entry[k] for k in profile.KEY_FIELDS}).entry["config"] == NGRAM_2
    profile.store(model, "f2", entry)  # the weights changed: the old measurements go
    assert [e["threads"] for e in profile.read_profile(path)["entries"]] == [1]

    before = path.read_bytes()

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(profile.json, "dump", interrupted)
    with pytest.raises(KeyboardInterrupt):
        profile.store(model, "f2", {**entry, "threads": 4})
    assert path.read_bytes() == before and list(path.parent.iterdir()) == [path]  # no half-written file


# ---- what tune measures ----------------------------------------------------------------------------------
@needs(TARGET, DRAFT)
def test_tune_measures_the_draft_model_and_generate_uses_it(capsys):
    code, out, err = run_cli(capsys, "tune", "--model", str(TARGET), "--draft", str(DRAFT), *TINY, "--lengths", "2")
    assert code == 0, err
    assert "| draft model speculation, 2 tokens |" in out and "| n-gram speculation, 2 tokens |" in out
    data = json.loads(profile.profile_path(TARGET).read_text())
    (entry,) = data["entries"]
    assert [r["differing_prompts"] for r in entry["results"]] == [0, 0, 0]
    draft = {"path": str(DRAFT.resolve()), "fingerprint": fingerprint_weights(DRAFT)}
    config = {"label": "draft model speculation, 2 tokens", "draft": draft, "speculative_config":
              {"method": "draft_model", "num_speculative_tokens": 2, "model": str(DRAFT.resolve())}}
    profile.profile_path(TARGET).write_text(json.dumps(with_entry(data, config=config, ratio=1.1)))
    code, out, err = run_cli(capsys, "generate", "--model", str(TARGET), "--prompt", "Hello", "--max-new-tokens", "8",
                             "--threads", "1", "--json")
    assert code == 0, err
    assert "(draft model speculation, 2 tokens: 1.10x" in err
    assert json.loads(out)["stats"]["speculative"]["method"] == "draft_model"


@needs(STORIES)
@pytest.mark.parametrize("extra_load, busy", [(0.1, False), (0.8, True)])
def test_the_busy_note_counts_only_load_beyond_the_timings_own_threads(capsys, monkeypatch, extra_load, busy):
    """The timing's own threads keep the load average at about the core count (2.03 on 2 idle cores with
    --threads 2 said "busy" before); half a core more is another process's."""
    import os

    from specee.tune import measure

    monkeypatch.setattr(measure, "load_average", lambda: (os.cpu_count() or 1) + extra_load)
    code, out, err = run_cli(capsys, "tune", "--model", str(STORIES), *TINY, "--lengths", "1")
    assert code == 0, err
    assert ("the machine was busy while timing" in err) == busy


@needs(TARGET, DRAFT)
def test_a_drafters_fingerprint_is_known_without_loading_it(monkeypatch):
    """tune finds a drafter's cached bank by its fingerprint; it used to load the draft model for it."""
    from specee import LLM
    from specee.drafters import draft_model

    llm = LLM(TARGET, progress=False, threads=1)
    want = {d: llm.make_drafter(d, 2).fingerprint for d in ("ngram", str(DRAFT))}
    monkeypatch.setattr(draft_model.Transformer, "load", lambda *a, **k: pytest.fail("loaded the draft model"))
    assert {d: llm.drafter_fingerprint(d) for d in want} == want


@needs(STORIES)
def test_tune_measures_early_exit_with_a_cached_bank_and_never_chooses_lossy(capsys):
    from specee import LLM
    from specee.exit.bank import PredictorBank
    from specee.tune.measure import EXIT_K

    llm = LLM(STORIES, progress=False, threads=1)
    L, hidden, drafter = llm.model.cfg.num_layers, 4, llm.make_drafter("ngram", EXIT_K)
    g = torch.Generator().manual_seed(0)  # random predictors: some fire, so lossy exits change tokens
    bank = llm.bank_cache_path(drafter.fingerprint, EXIT_K)
    PredictorBank(torch.randn(L, 3 * EXIT_K, hidden, generator=g), torch.zeros(L, hidden),
                  torch.randn(L, hidden, generator=g), torch.zeros(L), [0.3] * L, list(range(L - 1)), EXIT_K,
                  llm.fingerprint, drafter.fingerprint).save(bank)
    code, out, err = run_cli(capsys, "tune", "--model", str(STORIES), *TINY, "--lengths", "2")
    assert code == 0, err
    for label in ("lossless early exit, n-gram drafter", "lossy early exit, n-gram drafter",
                  "n-gram speculation, 2 tokens + lossless exits in verification"):
        assert f"| {label} |" in out, out
    (entry,) = json.loads(profile.profile_path(STORIES).read_text())["entries"]
    results = {r["name"]: r for r in entry["results"]}
    assert results["exit-ngram-lossless"]["differing_prompts"] == 0
    assert results["ngram-2+exits"]["differing_prompts"] == 0 and results["ngram-2+exits"]["second_pass"]
    assert not results["exit-ngram-lossy"]["lossless"] and "lossy" not in entry["config"]["label"]

    config = {"label": "lossless early exit, n-gram drafter", "speculative_config": None,
              "early_exit": {"draft": "ngram", "k": EXIT_K, "bank": str(bank)}}
    write_profile(with_entry(json.loads(profile.profile_path(STORIES).read_text()), config=config, ratio=1.2))
    record, err = generate(capsys)
    assert "(lossless early exit, n-gram drafter: 1.20x" in err and record["stats"]["early_exit"]["mode"] == "lossless"


# ---- bad input: one line, before any model loads -----------------------------------------------------------
@pytest.mark.parametrize("argv, needle", [
    (("--draft", "ngram"), "--draft ngram"),
    (("--draft", "/nonexistent/draft"), "--draft /nonexistent/draft"),
    (("--lengths", "0,2"), "--lengths"),
    (("--lengths", "two"), "--lengths"),
    (("--prompts", "99"), "--prompts 99"),
    (("--prompt-file", "/nonexistent/prompts.jsonl"), "/nonexistent/prompts.jsonl"),
    (("--rounds", "0"), "--rounds"),
    (("--max-new-tokens", "100000"), "--max-new-tokens 100000"),
])
@needs(STORIES)
def test_bad_tune_input_is_one_line_naming_the_flag(capsys, profiles, argv, needle):
    code, out, err = run_cli(capsys, "tune", "--model", str(STORIES), *argv)
    assert_one_line_error(code, err, needle)
    assert not profiles.exists()


def test_choose_takes_the_fastest_lossless_candidate_only_when_faster_beyond_chance():
    from specee.tune.measure import Candidate, Result, choose

    def result(name, ratio, wins, pairs=8, lossless=True, differing=0):
        return Result(Candidate(name, name, {"label": name}, lossless=lossless), 100 * ratio, ratio, differing, "",
                      wins, pairs)

    full = result("full", 1.0, 0, 0)
    assert choose([full, result("noise", 1.3, 5)]) is full  # faster overall, in 5 of 8 pairs: chance
    assert choose([full, result("tiny gain", 1.01, 8)]) is full  # below the margin
    assert choose([full, result("lossy", 1.5, 8, lossless=False)]) is full
    assert choose([full, result("differs", 1.5, 8, differing=1)]) is full
    better, best = result("better", 1.2, 7), result("best", 1.3, 8)
    assert choose([full, better, best, result("lossy", 1.9, 8, lossless=False)]) is best


def test_a_prompt_file_with_fewer_prompts_than_the_default_times_on_all_of_them(tmp_path):
    """It was refused, blaming --prompts 4, a flag the user never gave; an empty file names the file."""
    import argparse

    from specee.cli import CLIError
    from specee.cli.tune import prompt_texts

    three = tmp_path / "three.txt"
    three.write_text("What is 2+2?\nName a colour.\nWrite a haiku.\n")
    assert prompt_texts(argparse.Namespace(prompt_file=str(three), prompts=None)) == [
        "What is 2+2?", "Name a colour.", "Write a haiku."]
    assert len(prompt_texts(argparse.Namespace(prompt_file=None, prompts=None))) == 4
    with pytest.raises(CLIError, match="--prompts 5: there are 3"):
        prompt_texts(argparse.Namespace(prompt_file=str(three), prompts=5))
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(CLIError, match="--prompt-file: no prompts in"):
        prompt_texts(argparse.Namespace(prompt_file=str(tmp_path / "empty.txt"), prompts=None))
