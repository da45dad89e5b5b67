"""The target's own answers as draft-head training text (self-distillation).

A draft head is judged by how often it guesses what the target will generate. Human-written
answers are a different distribution from the target's own (on SmolLM2-135M a head trained on
the calibration answers accepts about one draft token in five); the target's greedy answers to
the same instructions are exactly the text speculation later meets, which is why EAGLE's recipes
regenerate their conversations with the target. Batched full-depth decoding keeps this
affordable on a CPU (SmolLM2-135M: about 200 tokens/s at batch 64 on 2 cores).

The output is an alpaca-style .json file ({instruction, input, output} with the target's output)
that `specee train-draft --data` reads like any other.
"""
from __future__ import annotations

import json
import time
from pathlib import Path


from ..files import replacing
from ..progress import progress_bar
from ..records import question
from ..sampling import SamplingParams
from .record import read_records


def instructions(data: str | Path | None = None) -> list[dict]:
    """The alpaca-style records (with an instruction) of a .json/.jsonl file or directory
    (default: ../shared/data/calibration; see read_records); raw-text records have no question to
    answer and are skipped."""
    recs = [r for r in read_records(data) if isinstance(r.get("instruction"), str) and r["instruction"].strip()]
    if not recs:
        raise ValueError(f"{data or '../shared/data/calibration'}: no instruction records to answer "
                         "(expected alpaca-style {instruction, input, output} records)")
    return recs


def distill(llm, output: str | Path, data: str | Path | None = None, max_new_tokens: int = 256,
            batch_size: int = 32, minutes: float | None = None, progress: bool = True) -> tuple[int, int]:
    """Answer the instructions of `data` with `llm` (greedy, full depth, chat template, batches of
    similar prompt length) and write them to `output` as alpaca records; stops after the batch that
    passes the time budget; instructions too long for the context beside max_new_tokens are left out.
    Returns the number of records written and of those left out. The file is replaced atomically:
    an interrupted run leaves the previous file (or none), never half of one."""
    if max_new_tokens < 1 or batch_size < 1:
        raise ValueError(f"max_new_tokens and batch_size must be >= 1, got {max_new_tokens} and {batch_size}")
    if minutes is not None and minutes <= 0:
        raise ValueError(f"minutes must be positive, got {minutes}")
    if llm.tokenizer.chat_template is None:
        raise ValueError(f"{llm.model_dir}: no chat template; self-distillation answers instructions as a chat")
    if llm.early_exit is not None or llm.speculative is not None:
        raise ValueError("self-distillation decodes at full depth: load the target without early exit or speculation")
    context = llm.model.cfg.context_limit
    if max_new_tokens >= context:
        raise ValueError(f"max_new_tokens (--max-new-tokens) {max_new_tokens} leaves no room for a prompt in the "
                         f"model's context of {context} tokens")
    recs = instructions(data)
    messages = [question(r) for r in recs]
    limit = context - max_new_tokens
    prompts = [llm.encode(m, chat=True) for m in messages]
    order = sorted((i for i in range(len(recs)) if len(prompts[i]) <= limit), key=lambda i: len(prompts[i]))
    if not order:  # nothing would be written over the output
        raise ValueError(f"no instruction fits the context of {context} tokens with max_new_tokens "
                         f"(--max-new-tokens) {max_new_tokens}: the shortest takes {min(map(len, prompts))}")
    deadline = None if minutes is None else time.monotonic() + 60 * minutes
    params = SamplingParams(max_tokens=max_new_tokens)
    out: list[dict] = []
    bar = progress_bar(total=len(order), desc="answering instructions", unit="answer", enabled=progress)
    for b in range(0, len(order), batch_size):
        batch = order[b : b + batch_size]
        for i, result in zip(batch, llm.generate([prompts[i] for i in batch], params)):
            out.append({"instruction": recs[i]["instruction"], "input": recs[i].get("input") or "",
                        "output": result.text})
        bar.update(len(batch))
        if deadline is not None and time.monotonic() > deadline:
            break
    bar.close()
    with replacing(output) as tmp:
        tmp.write_text(json.dumps(out, ensure_ascii=False, indent=0))
    return len(out), len(recs) - len(order)
