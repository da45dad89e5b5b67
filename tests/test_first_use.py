"""What a new user meets first: one default for Python and the CLI, output paths checked before any
work, chat commands, progress bars in logs, and where `calibrate` puts its bank."""
from __future__ import annotations

import inspect
import io
import sys

import pytest
from checkpoints import clone_checkpoint, edit_json
from conftest import MODELS

from specee import LLM, cli
from specee.tokenizer import Tokenizer

STORIES = MODELS / "stories260K"
SMOLLM2 = MODELS / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def no_model_loads(monkeypatch):
    import specee.engine.llm as llm_module

    def never(*_a, **_k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(llm_module.LLM, "__init__", never)


# ---- one default: LLM(model) runs what `specee generate` runs -----------------------------------
def test_python_and_cli_default_to_the_same_weights(capsys, monkeypatch):
    import specee.engine.llm as llm_module

    seen = {}

    def record(self, model, **kwargs):
        seen.update(kwargs)
        raise ValueError("recorded")

    default = inspect.signature(LLM.__init__).parameters["quantization"].default
    monkeypatch.setattr(llm_module.LLM, "__init__", record)
    if not STORIES.is_dir():
        pytest.skip(f"shared models not found at {STORIES}")
    run_cli(capsys, "generate", "--model", str(STORIES), "--prompt", "hi")
    assert seen["quantization"] == default == "auto"


def test_python_default_runs_the_gguf_blocks_natively():
    from specee.model.quant import FloatLinear

    if not SMOLLM2.exists():
        pytest.skip(f"SmolLM2 GGUF not available: {SMOLLM2} is absent")
    llm = LLM(SMOLLM2)
    assert llm.quantization == "auto" and not isinstance(llm.model.layers[0].qkv, FloatLinear)


# ---- output destinations: checked before any work, one line naming the flag -----------------------
@pytest.mark.parametrize("argv, flag", [
    (["calibrate", "--draft", "ngram", "-o"], "-o/--output"),
    (["train-draft", "-o"], "-o/--output"),
    (["distill", "-o"], "-o/--output"),
    (["bench", "speed", "--draft", "ngram", "--out"], "--out"),
])
def test_unwritable_outputs_fail_before_any_work(capsys, tmp_path, no_model_loads, argv, flag):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    for dest, needle in ((tmp_path / "a-file" / "out", "a-file is a file, not a directory"),
                         ("/proc/specee-out", "cannot write in /proc")):
        code, _, err = run_cli(capsys, *argv, str(dest))
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and f"argument {flag}: " in lines[0] and needle in lines[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]  # nothing half-written


def test_calibrate_into_a_directory_of_other_files_fails_before_any_work(capsys, tmp_path, no_model_loads):
    (tmp_path / "notes.txt").write_text("mine")
    code, _, err = run_cli(capsys, "calibrate", "--model", str(STORIES), "--draft", "ngram", "-o", str(tmp_path))
    assert code == 2 and "-o " in err and "holds files that are not a predictor bank (notes.txt)" in err


# ---- specee chat: unknown commands are not sent to the model -------------------------------------
def test_chat_refuses_unknown_commands(tiny_checkpoint, tmp_path, capsys, monkeypatch):
    path = clone_checkpoint(tiny_checkpoint("llama2"), tmp_path / "model")
    edit_json(path / "tokenizer_config.json", chat_template="{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    seen = []
    original = Tokenizer.encode_chat

    def spy(self, messages):
        seen.append([m["content"] for m in messages])
        return original(self, messages)

    monkeypatch.setattr(Tokenizer, "encode_chat", spy)
    monkeypatch.setattr(sys, "stdin", io.StringIO("/foo bar\n/help\n//etc is a folder\n/exit\n"))
    code, _, err = run_cli(capsys, "chat", "--model", str(path), "--max-new-tokens", "3")
    assert code == 0, err
    assert "unknown command /foo; commands: /reset" in err and "/exit" in err
    assert seen == [[""], ["/etc is a folder"]]  # the check before loading, then only the escaped line


# ---- logs: no progress-bar frames; calibrate's bank outside the repository -------------------------
def test_calibrate_writes_no_bar_frames_and_its_bank_is_the_one_generate_reads(capsys, tmp_path, monkeypatch):
    if not STORIES.is_dir():
        pytest.skip(f"shared models not found at {STORIES}")
    monkeypatch.setenv("SPECEE_CACHE", str(tmp_path / "cache"))
    code, _, err = run_cli(capsys, "calibrate", "--model", str(STORIES), "--draft", "ngram", "--prompts", "4",
                           "--max-new-tokens", "8")
    assert code == 0, err
    assert "\r" not in err  # stderr is not a terminal here: no bars
    (bank,) = (tmp_path / "cache" / "banks").iterdir()
    assert (bank / "manifest.json").exists() and f"bank written to {bank}" in err
    code, out, err = run_cli(capsys, "generate", "--model", str(STORIES), "--no-chat", "--draft", "ngram",
                             "--prompt", "Once upon a time", "--max-new-tokens", "4")
    assert code == 0 and out.strip() and "calibrating once" not in err, err


def test_progress_bars_are_drawn_on_a_terminal_only(monkeypatch):
    from specee.progress import progress_bar

    for tty in (False, True):
        stream = io.StringIO()
        stream.isatty = lambda tty=tty: tty
        monkeypatch.setattr(sys, "stderr", stream)
        with progress_bar(total=3, desc="work") as bar:
            bar.update(3)
        assert ("\r" in stream.getvalue()) == tty


def test_an_unwritable_bank_cache_is_refused_before_calibrating(monkeypatch, tmp_path):
    """$SPECEE_CACHE on a file: the bank's save failed after minutes of calibration, naming no setting."""
    import specee.calibration as calibration
    from specee.exit.config import EarlyExitConfig

    if not STORIES.is_dir():
        pytest.skip(f"shared models not found at {STORIES}")
    (tmp_path / "afile").write_text("")
    monkeypatch.setenv("SPECEE_CACHE", str(tmp_path / "afile"))
    monkeypatch.setattr(calibration, "calibrate", lambda *a, **k: pytest.fail("calibrated first"))
    llm = LLM(STORIES, dtype="float32", early_exit=EarlyExitConfig(draft="ngram"))
    with pytest.raises(ValueError, match=r"predictor bank's cache \(\$SPECEE_CACHE\).*afile is a file"):
        llm.calibrate()
