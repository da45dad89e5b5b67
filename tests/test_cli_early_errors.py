"""Bad input to calibrate, train-draft, bench and model resolution is refused in one line naming the flag,
before any weights load, and leaves nothing half-written: each case here was found only after loading, or
not at all (a clamped value, an ignored revision, an untrained head written with exit status 0)."""
from __future__ import annotations

import time
from pathlib import Path

import pytest
from cli_helpers import assert_one_line_error, run_cli
from conftest import MODELS

STORIES = MODELS / "stories260K"
needs_stories = pytest.mark.skipif(not STORIES.is_dir(), reason=f"shared model not found: {STORIES}")


@pytest.fixture
def no_model_loads(monkeypatch):
    import specee.engine.llm as llm_module
    from specee.model.llama import Transformer

    def never(*_a, **_k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(llm_module.LLM, "__init__", never)
    monkeypatch.setattr(Transformer, "load", never)


@needs_stories
@pytest.mark.parametrize("argv, needles", [
    (["calibrate", "--model", "{stories}", "--draft", "ngram", "--draft-vocab", "100", "-o", "{tmp}/bank"],
     ["--draft-vocab 100: ", "--draft ngram scores no vocabulary"]),
    (["train-draft", "--model", "{stories}", "-o", "{tmp}/head", "--minutes", "0.5"],
     ["--minutes", "0.5 is too short", "give at least 1"]),
    (["bench", "speed", "--model", "{stories}", "--draft", "ngram", "--oracle-layers", "9"],
     ["--oracle-layers 9: ", "between 1 and the model's 5 layers"]),
    (["bench", "quality", "--model", "{stories}", "--draft", "ngram", "--ppl-window", "4096"],
     ["--ppl-window 4096: ", "the model's context of 512 tokens"]),
    (["bench", "quality", "--model", "{stories}", "--draft", "ngram", "--parts", "ppl,bogus"],
     ["--parts: unknown ['bogus']"]),
], ids=["calibrate-ngram-draft-vocab", "train-draft-minutes", "oracle-layers", "ppl-window", "quality-parts"])
def test_bad_values_fail_before_the_model_loads(capsys, no_model_loads, tmp_path, argv, needles):
    argv = [a.replace("{tmp}", str(tmp_path)).replace("{stories}", str(STORIES)) for a in argv]
    code, _, err = run_cli(capsys, *argv, "--threads", "1")
    assert_one_line_error(code, err, *needles)
    assert not list(tmp_path.iterdir())  # no bank, head or report begun


@needs_stories
def test_train_draft_over_a_checkpoint_without_resume_fails_before_loading(capsys, no_model_loads, tmp_path):
    (tmp_path / "head" / "checkpoint").mkdir(parents=True)
    code, _, err = run_cli(capsys, "train-draft", "--model", str(STORIES), "--threads", "1", "-o",
                           str(tmp_path / "head"))
    assert_one_line_error(code, err, f"-o {tmp_path / 'head'} already holds a training checkpoint", "--resume")
    assert not list((tmp_path / "head" / "checkpoint").iterdir())


@needs_stories
def test_train_draft_needs_its_default_data_before_loading(capsys, no_model_loads, tmp_path, monkeypatch):
    import specee.calibration.prompts as prompts

    monkeypatch.setattr(prompts, "default_calibration_dir", lambda: None)
    code, _, err = run_cli(capsys, "train-draft", "--model", str(STORIES), "--threads", "1", "-o", str(tmp_path / "h"))
    assert_one_line_error(code, err, "no calibration data", "pass a path")


def test_a_ppl_window_is_checked_against_the_context_not_shortened():
    from specee.bench.common import BenchError
    from specee.bench.quality import checked_ppl_window

    assert checked_ppl_window(None, 2048) == 512 and checked_ppl_window(None, 128) == 128  # the default fits
    assert checked_ppl_window(128, 128) == 128
    for window in (2, 129):
        with pytest.raises(BenchError, match=rf"--ppl-window {window}: .* context of 128 tokens"):
            checked_ppl_window(window, 128)


# ---- train-draft: no untrained head, no checkpoint that blocks the next run ----------------------------
@needs_stories
def test_a_run_that_trains_no_step_writes_no_head_and_keeps_a_resumable_checkpoint(real_llm, tmp_path):
    from specee.calibration import Recipe, train_draft
    from specee.calibration.train_draft import check_run

    out = tmp_path / "head"
    recipe = Recipe(max_steps=0, max_sequences=8, held_out_every=4)  # no step, as when recording eats the budget
    with pytest.raises(ValueError, match=r"minutes \(--minutes\) 1 left no time to train .* --resume"):
        train_draft(real_llm("stories260K"), out, minutes=1, recipe=recipe, progress=False)
    assert not (out / "head.safetensors").exists() and not (out / "manifest.json").exists()
    check_run(out, 1, resume=True)  # a whole checkpoint: --resume trains on its recording


@needs_stories
def test_too_little_recorded_text_leaves_no_checkpoint(real_llm, tmp_path):
    """It left checkpoint/record.safetensors: the next run was refused without --resume, and with it."""
    from specee.calibration import Recipe, train_draft

    out = tmp_path / "head"
    with pytest.raises(ValueError, match="too little training text recorded"):
        train_draft(real_llm("stories260K"), out, minutes=1, recipe=Recipe(max_sequences=1), progress=False)
    assert not out.exists()


# ---- bench reports: whole or not at all -------------------------------------------------------------
def fail_halfway(monkeypatch):
    """Path.write_text writes half of its text, then fails as a full disk does."""
    write = Path.write_text

    def half(self, text, *args, **kwargs):
        write(self, text[: len(text) // 2], *args, **kwargs)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", half)


@pytest.mark.parametrize("writer", ["json", "text"])
def test_a_failing_report_write_keeps_the_previous_report(tmp_path, monkeypatch, writer):
    from specee.bench.report import write_json, write_text

    path = tmp_path / "report.out"
    path.write_text("the previous report\n")
    fail_halfway(monkeypatch)
    with pytest.raises(OSError, match="No space left"):
        write_json(path, {"x": "y" * 100}) if writer == "json" else write_text(path, "z" * 100)
    monkeypatch.undo()
    assert path.read_text() == "the previous report\n"
    assert [p.name for p in tmp_path.iterdir()] == ["report.out"]  # no temporary file left
    written = write_json(path, {"x": 1}) if writer == "json" else write_text(path, "new")
    assert written == path and path.read_text() in ('{\n  "x": 1\n}\n', "new\n")


def test_a_failing_figure_keeps_the_previous_figure(tmp_path):
    from specee.bench.plots import _save

    class HalfDrawn:
        def tight_layout(self):
            pass

        def savefig(self, path, format):
            Path(path).write_bytes(b"\x89PNG half")
            raise KeyboardInterrupt

    path = tmp_path / "pareto.png"
    path.write_bytes(b"\x89PNG the previous figure")
    with pytest.raises(KeyboardInterrupt):
        _save(HalfDrawn(), path)
    assert path.read_bytes() == b"\x89PNG the previous figure" and list(tmp_path.iterdir()) == [path]


# ---- model resolution ------------------------------------------------------------------------------
@needs_stories
def test_a_revision_of_a_local_model_is_refused(capsys, no_model_loads):
    """It was ignored: the local files loaded whatever revision was asked for."""
    from specee.model.resolve import resolve_model

    with pytest.raises(ValueError, match=r"^revision \(--revision\) 'v2' applies to Hugging Face hub ids only"):
        resolve_model(STORIES, revision="v2")
    code, _, err = run_cli(capsys, "generate", "--model", str(STORIES), "--threads", "1", "--revision", "v2",
                           "--prompt", "hi")
    assert_one_line_error(code, err, "--revision) 'v2' applies to Hugging Face hub ids only", str(STORIES))


def test_a_hub_file_fails_fast_when_the_hub_is_unreachable(tmp_path, monkeypatch):
    """huggingface_hub's hf_hub_download retried an unreachable hub for ~25 s before failing."""
    pytest.importorskip("huggingface_hub")
    import huggingface_hub.constants as constants

    from specee.model.resolve import resolve_model

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens: connection refused
    start = time.monotonic()
    with pytest.raises(FileNotFoundError, match=r"model 'org/name/file.gguf' is not a local path"):
        resolve_model("org/name/file.gguf")
    assert time.monotonic() - start < 5


@needs_stories
def test_the_weights_note_names_what_the_layers_hold_not_the_flag(capsys):
    """`--quantization auto` on a float checkpoint said "auto weights"; it names the stored format."""
    code, _, err = run_cli(capsys, "generate", "--model", str(STORIES), "--quantization", "auto", "--prompt", "hi",
                           "--max-new-tokens", "1", "--threads", "1")
    assert code == 0 and "note: float32 weights:" in err, err
    gguf = MODELS / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if gguf.is_file():
        code, _, err = run_cli(capsys, "generate", "--model", str(gguf), "--quantization", "auto", "--prompt", "hi",
                               "--max-new-tokens", "1", "--threads", "1")
        assert code == 0 and "note: int4 weights:" in err, err
