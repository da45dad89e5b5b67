"""The shared reader of prompt/record files (specee/records.py) and the four commands that use it:
calibration prompts, draft-head training text, self-distillation instructions, benchmark prompts."""
from __future__ import annotations

import json

import pytest

from specee.bench.common import BenchError
from specee.bench.tasks import read_prompt_file
from specee.calibration import ChatPrompt, load_calibration_prompts
from specee.calibration.record import read_records, training_sequences, user_message
from specee.calibration.self_distill import instructions
from specee.records import data_files, question, raw_text, read_file

ALPACA = [{"instruction": " Translate ", "input": "bonjour\n", "output": "hello"},
          {"instruction": "Count to 3", "input": "", "output": "1 2 3"}]


def test_alpaca_json(tmp_path):
    f = tmp_path / "a.json"
    f.write_text(json.dumps(ALPACA))
    recs = read_file(f)
    assert recs == ALPACA
    assert [question(r) for r in recs] == ["Translate\n\nbonjour", "Count to 3"]
    assert raw_text(recs[0]) is None
    (f2 := tmp_path / "wrapped.json").write_text(json.dumps({"version": 1, "data": ALPACA}))
    assert read_file(f2) == ALPACA  # a top-level object holding the list


def test_jsonl_text_records(tmp_path):
    f = tmp_path / "c4.jsonl"
    f.write_text(json.dumps({"text": " a document "}) + "\n\n" + json.dumps({"text": "another"}) + "\n")
    recs = read_file(f)
    assert [raw_text(r) for r in recs] == ["a document", "another"]
    assert [question(r) for r in recs] == [None, None]


def test_spec_bench_turns(tmp_path):
    f = tmp_path / "question.jsonl"
    rows = [{"question_id": 81, "category": "writing", "turns": ["First turn?", "Second turn"]},
            {"question_id": 82, "category": "qa", "prompt": "A prompt"},
            {"question_id": 83, "category": "qa", "question": "A question"}]
    f.write_text("\n".join(json.dumps(r) for r in rows))
    assert [question(r) for r in read_file(f)] == ["First turn?", "A prompt", "A question"]
    prompts = read_prompt_file(f)
    assert [(p.id, p.category, p.text) for p in prompts] == [
        ("81", "writing", "First turn?"), ("82", "qa", "A prompt"), ("83", "qa", "A question")]
    assert all(isinstance(p, ChatPrompt) for p in load_calibration_prompts(f))  # questions go through the template


def test_plain_text_lines(tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("hello\n\n  world  \ntwo\\nlines\n")
    assert read_file(f) == ["hello", "  world  ", "two\nlines"]
    assert [raw_text(r) for r in read_file(f)] == ["hello", "world", "two\nlines"]
    assert [p.text for p in read_prompt_file(f)] == ["hello", "world", "two\nlines"]
    calib = load_calibration_prompts(f)
    assert calib == ["hello", "world", "two\nlines"] and not any(isinstance(p, ChatPrompt) for p in calib)


def test_directory_reads_its_files_in_name_order(tmp_path):
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "b0"}) + "\n" + json.dumps({"text": "b1"}))
    (tmp_path / "a.json").write_text(json.dumps([{"instruction": "a0"}, {"instruction": "a1"}]))
    (tmp_path / "c.txt").write_text("c0\n")
    (tmp_path / "notes.md").write_text("ignored")
    assert data_files(tmp_path, (".json", ".jsonl"), "records") == [tmp_path / "a.json", tmp_path / "b.jsonl"]
    assert [question(r) or raw_text(r) for r in read_records(tmp_path)] == ["a0", "a1", "b0", "b1"]
    # calibration interleaves its files in proportion to their sizes, in file order
    assert load_calibration_prompts(tmp_path) == ["a0", "b0", "c0", "a1", "b1"]
    with pytest.raises(FileNotFoundError, match="not found"):
        data_files(tmp_path / "missing", (".json",), "records")
    with pytest.raises(FileNotFoundError, match=r"no records in it \(looked for \.csv files\)"):
        data_files(tmp_path, (".csv",), "records")


def test_corrupt_files_give_one_line_errors_naming_the_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('[{"instruction": "ok"},\n {oops}]')
    with pytest.raises(ValueError) as e:
        read_file(bad)
    assert str(bad) in str(e.value) and "\n" not in str(e.value)
    bad_line = tmp_path / "bad.jsonl"
    bad_line.write_text('{"text": "fine"}\n{"text": \n')
    with pytest.raises(ValueError, match=r"bad\.jsonl, line 2: bad JSON"):
        read_file(bad_line)
    latin = tmp_path / "latin.txt"
    latin.write_bytes("caf\xe9\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin\.txt: not UTF-8"):
        read_file(latin)
    (tmp_path / "scalar.json").write_text("3")
    with pytest.raises(ValueError, match="expected a JSON list"):
        read_file(tmp_path / "scalar.json")
    # each caller keeps its own error type, with the same message
    with pytest.raises(ValueError, match="bad.json"):
        load_calibration_prompts(bad)
    with pytest.raises(ValueError, match="bad.json"):
        read_records(bad)
    with pytest.raises(ValueError, match="bad.json"):
        instructions(bad)
    with pytest.raises(BenchError, match="bad.json") as e:
        read_prompt_file(bad)
    assert "\n" not in str(e.value)


class CharTokenizer:
    """One token per character, no chat template: training text is "question\\n\\nanswer"."""

    chat_template = None

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]


def test_the_four_callers_ask_the_same_question(tmp_path):
    f = tmp_path / "alpaca.json"
    f.write_text(json.dumps(ALPACA))
    expected = "Translate\n\nbonjour"
    calibration = load_calibration_prompts(f)[0]
    assert calibration == expected and isinstance(calibration, ChatPrompt)
    assert user_message(read_records(f)[0]) == expected
    assert question(instructions(f)[0]) == expected  # what self-distillation sends the target
    assert read_prompt_file(f)[0].text == expected
    seqs, loss_from = training_sequences(CharTokenizer(), f, max_len=512)
    assert "".join(map(chr, seqs[0])) == expected + "\n\nhello"
    assert loss_from[0] == len(expected + "\n\n") - 1  # the loss starts at the answer
