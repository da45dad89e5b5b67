"""Training data for a draft head: the target's features and next-token distributions over text.

A teacher-forced pass (no generation: on a CPU it is far cheaper, and EAGLE itself trains on
fixed conversations) runs specee's own runtime layer by layer over batches of right-padded
sequences (causal attention: a valid row never reads the padding after it) and keeps, for every
position: the outputs of `feature_layers`, the last layer's output (the head's regression
target), the target's argmax over the whole vocabulary, and its top-k probabilities over the
FR-Spec shortlist (the head's soft labels).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from ..files import replacing
from ..model.llama import Transformer
from ..progress import progress_bar
from ..records import data_files, question, raw_text, read_file
from .prompts import calibration_data


# ---- text -------------------------------------------------------------------------------------
user_message = question  # an alpaca record's question: the instruction, then its input after a blank line


def read_records(data: str | Path | None = None) -> list[dict]:
    """The JSON records (objects) of a .json (a list) / .jsonl file, or of every such file in a
    directory, in name order (default: ../shared/data/calibration); see specee.records.read_file."""
    files = data_files(calibration_data(data), (".json", ".jsonl"), "training text")
    return [r for file in files for r in read_file(file) if isinstance(r, dict)]


def training_sequences(tokenizer, data: str | Path | None = None,
                       max_len: int = 512) -> tuple[list[list[int]], list[int]]:
    """Token sequences of the training text (see read_records): alpaca-style {instruction, input,
    output} records (any record with a question, see specee.records.question, and an output)
    rendered as a user/assistant exchange with the chat template (raw "question\n\noutput"
    without one), {"text"} records as raw text; each cut into pieces of at most `max_len` tokens.
    Also, per piece, the first position whose next token is trained: the answer's, as EAGLE masks
    its loss to the assistant's turns (a head is judged on what the target writes, and system
    prompts repeated in every record would inflate its accuracy)."""
    seqs: list[list[int]] = []
    starts: list[int] = []
    for rec in read_records(data):
        ids, answer = _encode_record(tokenizer, rec)
        for i in range(0, len(ids), max_len):
            piece = ids[i : i + max_len]
            if len(piece) >= 4 and answer - 1 - i < len(piece) - 1:
                seqs.append(piece)
                starts.append(max(0, answer - 1 - i))
    if not seqs:
        raise ValueError(f"{data or '../shared/data/calibration'}: no training text found (expected alpaca-style "
                         "{instruction, input, output} or {text} records in .json/.jsonl files)")
    return seqs, starts


def _encode_record(tokenizer, rec: dict) -> tuple[list[int], int]:
    """The record's tokens and where its answer starts (0 for plain text; no tokens: skipped)."""
    user, answer = question(rec), rec.get("output")
    if user and isinstance(answer, str) and answer.strip():
        if tokenizer.chat_template is None:
            return tokenizer.encode(user + "\n\n" + answer.strip()), len(tokenizer.encode(user + "\n\n"))
        asked = [{"role": "user", "content": user}]
        messages = asked + [{"role": "assistant", "content": answer.strip()}]
        prefix = tokenizer.encode(tokenizer.apply_chat_template(asked, add_generation_prompt=True),
                                  add_special_tokens=False)
        return tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=False),
                                add_special_tokens=False), len(prefix)
    text = raw_text(rec)
    return (tokenizer.encode(text), 0) if text else ([], 0)


# ---- the record -------------------------------------------------------------------------------
@dataclass
class Record:
    """Per position n of the concatenated sequences (sequence i holds rows starts[i]:starts[i+1])."""

    starts: torch.Tensor  # [num_seqs + 1] long
    sources: torch.Tensor  # [num_seqs] long: each sequence's index in the list given to `record`
    tokens: torch.Tensor  # [N] long: the input token at n
    features: torch.Tensor  # [N, W]: outputs of the feature layers at n, concatenated
    last: torch.Tensor  # [N, H] (or [0] when the last layer is a feature layer): last layer's output at n
    argmax: torch.Tensor  # [N] long: the target's next token after n (whole vocabulary)
    top_cols: torch.Tensor  # [N, K] long: shortlist columns of its top-k shortlisted tokens
    top_probs: torch.Tensor  # [N, K] float: their probabilities, renormalized to sum 1
    trained: torch.Tensor  # [N] bool: n's next token counts in the loss and the held-out metrics

    def last_hidden(self, feature_layers: tuple[int, ...], num_layers: int) -> torch.Tensor:
        """[N, H]: the last layer's output (a view of `features` when it is one of them)."""
        if num_layers - 1 not in feature_layers:
            return self.last
        H = self.features.shape[1] // len(feature_layers)
        k = feature_layers.index(num_layers - 1)
        return self.features[:, k * H : (k + 1) * H]

    def save(self, path: Path) -> None:
        from safetensors.torch import save_file

        with replacing(path) as tmp:
            save_file({f.name: getattr(self, f.name).contiguous() for f in fields(self)}, str(tmp))

    @classmethod
    def load(cls, path: Path) -> "Record":
        from safetensors.torch import load_file

        t = load_file(str(path))
        t.setdefault("trained", torch.ones(len(t["tokens"]), dtype=torch.bool))  # recorded before answer masks
        return cls(**{f.name: t[f.name] for f in fields(cls)})


@torch.no_grad()
def record(model: Transformer, sequences: list[list[int]], feature_layers: tuple[int, ...], shortlist: torch.Tensor,
           top_k: int = 8, batch_tokens: int = 4096, store_dtype: torch.dtype = torch.bfloat16,
           deadline: float | None = None, seed: int = 0, progress: bool = True,
           loss_from: list[int] | None = None) -> Record:
    """Teacher-forced pass over `sequences`, batched by similar length, the batches in a seeded random
    order; stops after the batch that passes `deadline` (time.monotonic()), so a partial record is an
    unbiased sample. loss_from: per sequence, the first trained position (default 0: all)."""
    L = model.cfg.num_layers
    dev = model.device
    keep_last = L - 1 not in feature_layers
    shortlist = shortlist.to(dev)
    k = min(top_k, len(shortlist))
    order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i]))
    batches, i = [], 0
    while i < len(order):
        width = len(sequences[order[i]])
        n = max(1, batch_tokens // width)
        batches.append(order[i : i + n])
        i += n
    shuffle = torch.randperm(len(batches), generator=torch.Generator().manual_seed(seed)).tolist()
    batches = [batches[b] for b in shuffle]
    parts: dict[str, list[torch.Tensor]] = {f.name: [] for f in fields(Record) if f.name not in ("starts", "sources")}
    covered: list[int] = []
    bar = progress_bar(total=sum(len(sequences[j]) for j in order), desc="recording target features", unit="tok",
                       enabled=progress)
    for batch in batches:
        rows = [sequences[j] for j in batch]
        T = len(rows[0])
        ids = torch.tensor([r + [0] * (T - len(r)) for r in rows], device=dev)
        valid = (torch.arange(T)[None, :] < torch.tensor([len(r) for r in rows])[:, None]).reshape(-1).to(dev)
        cache = model.new_cache(len(rows), T)
        step = model.range_inputs(0, T)
        h = model.embed(ids)
        kept: dict[int, torch.Tensor] = {}
        for layer in range(L):
            h = model.layer(layer, h, step, cache)
            if layer in feature_layers:
                kept[layer] = h.reshape(-1, h.shape[-1])[valid]
        last = h.reshape(-1, h.shape[-1])[valid]
        logits = model.logits(last).float()
        probs = torch.softmax(logits, dim=-1)
        top_probs, top_cols = torch.topk(probs.index_select(1, shortlist), k)  # the softmax is the whole vocabulary's
        parts["tokens"].append(ids.reshape(-1)[valid].cpu())
        parts["trained"].append(torch.cat([torch.arange(len(r)) >= (loss_from[j] if loss_from else 0)
                                           for j, r in zip(batch, rows)]))
        parts["features"].append(torch.cat([kept[i] for i in feature_layers], -1).to("cpu", store_dtype))
        parts["last"].append(last.to("cpu", store_dtype) if keep_last else torch.zeros(0, dtype=store_dtype))
        parts["argmax"].append(logits.argmax(-1).cpu())
        parts["top_cols"].append(top_cols.cpu())
        parts["top_probs"].append((top_probs / top_probs.sum(-1, keepdim=True).clamp_min(1e-12)).cpu())
        covered.extend(batch)
        bar.update(int(valid.sum()))
        if deadline is not None and time.monotonic() > deadline:
            break
    bar.close()
    lengths = torch.tensor([0] + [len(sequences[j]) for j in covered])
    return Record(starts=lengths.cumsum(0), sources=torch.tensor(covered, dtype=torch.long),
                  **{n: torch.cat(p) for n, p in parts.items()})
