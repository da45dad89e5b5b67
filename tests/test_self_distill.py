"""Self-distillation (specee/calibration/self_distill.py, `specee distill`): the target's own
answers become draft-head training text."""
from __future__ import annotations

import json

import pytest

from specee import SamplingParams
from specee.calibration.record import training_sequences, user_message
from specee.calibration.self_distill import distill
from specee.cli import main

pytestmark = pytest.mark.usefixtures("single_thread")
MODEL = "ref-target-24L"  # has a chat template


@pytest.fixture(scope="module")
def llm(real_llm):
    return real_llm(MODEL)


def write_records(path, records):
    path.write_text(json.dumps(records))
    return path


RECORDS = [
    {"instruction": "Name a fruit.", "input": "", "output": "An apple."},
    {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"},
    {"text": "raw text has no question and is skipped"},
    {"instruction": "Write one word about the sea, then stop.", "output": "Blue."},
]


def test_answers_are_the_targets_own_greedy_answers(llm, tmp_path):
    data = write_records(tmp_path / "in.json", RECORDS)
    n, left_out = distill(llm, tmp_path / "out.json", data, max_new_tokens=12, batch_size=2, progress=False)
    out = json.loads((tmp_path / "out.json").read_text())
    assert n == len(out) == 3 and left_out == 0
    by_instruction = {r["instruction"]: r for r in out}
    for rec in (r for r in RECORDS if "instruction" in r):
        got = by_instruction[rec["instruction"]]
        assert got["input"] == (rec.get("input") or "")
        # each answer is what the target decodes for that prompt alone (batching changes nothing)
        (alone,) = llm.generate(user_message(rec), SamplingParams(max_tokens=12), chat=True)
        assert got["output"] == alone.text
        assert got["output"] != rec["output"]  # the human answer is replaced
    # train-draft reads the file: a user turn and the target's answer per record
    seqs, loss_from = training_sequences(llm.tokenizer, tmp_path / "out.json")
    assert len(seqs) == 3
    for ids, start, rec in zip(seqs, loss_from, out):  # the loss starts where the target's answer does
        prompt = llm.encode(user_message(rec), chat=True)
        assert ids[: len(prompt)] == prompt and start == len(prompt) - 1


def test_time_budget_stops_after_a_batch_and_the_file_is_whole(llm, tmp_path):
    data = write_records(tmp_path / "in.json", [{"instruction": f"Count to {i}."} for i in range(6)])
    n, _ = distill(llm, tmp_path / "out.json", data, max_new_tokens=4, batch_size=2, minutes=1e-9, progress=False)
    assert n == 2  # the first batch passes the budget
    assert len(json.loads((tmp_path / "out.json").read_text())) == 2
    assert not list(tmp_path.glob("*.tmp"))


def test_bad_input_is_refused_before_any_work(llm, tmp_path):
    data = write_records(tmp_path / "text.json", [{"text": "no instructions here"}])
    with pytest.raises(ValueError, match="no instruction records"):
        distill(llm, tmp_path / "out.json", data, progress=False)
    with pytest.raises(ValueError, match="max_new_tokens and batch_size must be >= 1"):
        distill(llm, tmp_path / "out.json", data, batch_size=0, progress=False)
    assert not (tmp_path / "out.json").exists()


def test_a_max_new_tokens_that_leaves_no_prompt_room_keeps_the_old_file(llm, tmp_path):
    """It wrote [] over the output (every prompt left out, none said so) and exited 0."""
    context = llm.model.cfg.context_limit
    data = write_records(tmp_path / "in.json", RECORDS + [{"instruction": "word " * 2 * context}])
    out = tmp_path / "out.json"
    out.write_text("[\"the previous answers\"]")
    with pytest.raises(ValueError, match=rf"max_new_tokens \(--max-new-tokens\) {context} leaves no room"):
        distill(llm, out, data, max_new_tokens=context, progress=False)
    with pytest.raises(ValueError, match=r"no instruction fits .* \(--max-new-tokens\) %d" % (context - 3)):
        distill(llm, out, data, max_new_tokens=context - 3, progress=False)
    assert json.loads(out.read_text()) == ["the previous answers"]
    n, left_out = distill(llm, out, data, max_new_tokens=8, batch_size=4, progress=False)
    assert (n, left_out) == (3, 1)  # the long instruction does not fit beside its answer


def test_cli_errors_are_one_line(tmp_path, capsys):
    assert main(["distill", "--model", str(tmp_path / "missing"), "-o", str(tmp_path / "o.json")]) == 2
    assert main(["distill", "--model", str(tmp_path), "-o", str(tmp_path / "o.json"), "--minutes", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("specee: error: ") for line in err)
    assert "--minutes: expected a finite number > 0" in err[1]
