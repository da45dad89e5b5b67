"""The drafter interface: where the speculative tokens come from.

While token x_n is decoded, a drafter proposes the k most likely tokens for position n+1.
SpecEE's exit features look only at those k tokens, and an exit is taken only if the
exiting layer's argmax is one of them, so a drafter's quality bounds how often the target
can exit early; its cost is paid on every token, so `propose` must be cheap.

A drafter's state is the token history it has consumed (prompt + emitted tokens):
`reset(prompt)` starts it, `advance(token)` appends one token, `truncate(length)` rolls it
back (lossless mode), and `propose()` is the top-k for the position after the history.

Speculative decoding (specee/speculative/) asks for several tokens ahead instead: `draft(n, ...)`
returns a chain of n tokens for the positions after the history (and, when sampled, the
distributions they were drawn from) without consuming them; `commit(tokens, matched, ...)`
then consumes what the target accepted. Drafters that read the target's hidden states (the
EAGLE head) get them through `begin` and `commit`; the others ignore them. SpecEE's exits
inside a verification pass also need every row's top-k: `row_candidates(draft)`.
"""
from __future__ import annotations

import copy

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

import torch

from ..sampling import SamplingParams, probabilities


@dataclass
class Draft:
    """A chain of draft tokens for the positions after the drafter's history.

    tokens: LongTensor [n] on the target's device (n may be below what was asked, even 0);
    probs: [n, width] distributions the tokens were sampled from, or None when they were chosen
    deterministically (greedy, prompt lookup): verification then treats each as a point mass;
    ids: the same tokens on the host, when the drafter had them there (no device read to get them)."""

    tokens: torch.Tensor
    probs: torch.Tensor | None = None
    ids: list[int] | None = None

    def host_ids(self) -> list[int]:
        return self.ids if self.ids is not None else self.tokens.tolist()


class DraftChain:
    """Builds a Draft token by token from a drafter's scores over `columns` (token ids of the
    score columns; None = ids 0..n-1): greedy takes the argmax, sampling draws from the
    distribution q and keeps it, spread over the target's `width`, for rejection sampling."""

    def __init__(self, params: SamplingParams, generator: torch.Generator | None, columns: torch.Tensor | None,
                 width: int, device: torch.device):
        self.params, self.generator, self.columns, self.width, self.device = params, generator, columns, width, device
        self.tokens: list[torch.Tensor] = []
        self.probs: list[torch.Tensor] = []

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        """The next draft token ([1], on the device) for scores [1, columns]."""
        if self.params.greedy:
            col = logits.argmax(dim=-1)
        else:
            q = probabilities(logits, self.params)
            col = torch.multinomial(q, 1, generator=self.generator).view(1)
            self.probs.append(q)
        token = col if self.columns is None else self.columns[col]
        self.tokens.append(token)
        return token

    def draft(self) -> Draft:
        n = len(self.tokens)
        out = torch.cat(self.tokens) if n else torch.empty(0, dtype=torch.long, device=self.device)
        if not self.probs:
            return Draft(out)
        q = torch.cat(self.probs)
        full = torch.zeros(n, self.width, device=self.device, dtype=q.dtype)
        if self.columns is None:
            full[:, : q.shape[1]] = q
        else:
            full.index_copy_(1, self.columns, q)
        return Draft(out, full)


class DrafterMismatchError(ValueError):
    """A drafter cannot serve this target (different tokenizer / vocabulary); the message is one short
    line, `details` lists where the tokenizers differ."""

    def __init__(self, message: str, details: str = ""):
        super().__init__(message)
        self.details = details


class Drafter(ABC):
    k: int
    name: str
    fingerprint: str
    scores_vocabulary = False  # True: proposals are an LM head's top-k (`restrict_vocab` applies)

    @abstractmethod
    def reset(self, prompt_ids: list[int], max_new_tokens: int | None = None) -> None:
        """Start a request: the history becomes `prompt_ids`; `max_new_tokens` lets a drafter with a
        cache size it for the request."""

    @abstractmethod
    def advance(self, token: int) -> None:
        """Consume one emitted token; `propose()` is then for the position after it."""

    @abstractmethod
    def propose(self) -> torch.Tensor:
        """LongTensor [k] of distinct token ids (on the target's device): the drafter's top-k
        for the position after the history, most likely first."""

    @abstractmethod
    def truncate(self, length: int) -> None:
        """Roll back: afterwards the state equals having consumed exactly history[:length]."""

    @abstractmethod
    def teacher_forced_top_k(self, ids: list[int], start: int) -> torch.Tensor:
        """[len(ids) - start, k]: row j is what `propose()` returns for token ids[start + j]
        having consumed ids[:start + j]. Does not change the drafter's request state."""

    def fork(self) -> "Drafter":
        """A drafter sharing this one's weights and settings with request state of its own (call
        `reset` before use): each request of a batch drafts with one. Default: a shallow copy, for
        drafters whose `reset` rebinds all of their request state."""
        return copy.copy(self)

    def restrict_vocab(self, token_ids: torch.Tensor | None) -> None:
        """Propose only among `token_ids` (a frequency-ranked shortlist, see `frequency_shortlist`);
        None = the whole vocabulary. Only drafters that score a vocabulary with an LM head can."""
        if token_ids is not None:
            raise TypeError(f"{self.name} does not score a vocabulary; it cannot be restricted to a shortlist")

    def extend(self, tokens: list[int]) -> None:
        """Consume several tokens (default: `advance` each)."""
        for t in tokens:
            self.advance(t)

    # ---- speculative decoding ----------------------------------------------------------------
    feature_layers: tuple[int, ...] = ()  # target layers whose outputs the drafter reads (EAGLE)
    free_chains = False  # a chain is a lookup, not a forward: the row gate (speculative/row_gate.py) looks up
    # `chain(n)` where a draft may pay; `match` is the last chain's matched suffix, at most `max_ngram`

    def begin(self, history: list[int], features: torch.Tensor | None = None) -> None:
        """Start a request whose history (prompt + the prefill's token) is `history`; features:
        the target's features at positions 0..len(history)-2 ([1, len - 1, W]), when it reads them."""
        self.reset(history)

    def pending(self) -> int:
        """Tokens of the history the drafter runs before its next draft (a draft model's catch-up on
        what it skipped; the speculation gate weighs it before switching drafts on). Default: none."""
        return 0

    def draft(self, n: int, params: SamplingParams, generator: torch.Generator | None, width: int) -> Draft:
        """Up to n tokens for the positions after the history, without consuming them; width: the
        target's vocabulary rows (the width of `Draft.probs`)."""
        raise NotImplementedError(f"{self.name} cannot draft several tokens ahead")

    def draft_all(self, drafters: list["Drafter"], ns: list[int], params: list[SamplingParams],
                  generators: list[torch.Generator | None], width: int) -> list[Draft]:
        """Drafts for several requests (forks of this drafter) at once; default: one after another.
        A drafter that runs a model batches its forwards across the requests."""
        return [d.draft(n, p, g, width) for d, n, p, g in zip(drafters, ns, params, generators)]

    def row_candidates(self, draft: Draft) -> torch.Tensor:
        """[n + 1, k] for the last `draft` of n tokens: row j is what `propose()` gives after the
        history and the draft's first j tokens (the speculative tokens of verification row j).
        The state is left as it was. Default: advance through the draft and roll back."""
        base = len(self.history)
        rows = [self.propose()]
        for token in draft.host_ids():
            self.advance(token)
            rows.append(self.propose())
        self.truncate(base)
        return torch.stack(rows)

    def commit(self, tokens: list[int], matched: int, features: torch.Tensor | None = None) -> None:
        """Consume what a speculative step emitted: the first `matched` tokens are the last draft's
        own (state computed for them may be kept), the last one is the target's. features: the
        target's features at the rows before each token ([1, len(tokens), W])."""
        self.extend(tokens)

    @property
    def history(self) -> list[int]:
        """The tokens consumed so far (a copy-free view; do not mutate)."""
        return self._history  # type: ignore[attr-defined]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, k={self.k}, fingerprint={self.fingerprint!r})"


def _vocab(tokenizer) -> dict[str, int]:
    tok = getattr(tokenizer, "tok", tokenizer)  # specee Tokenizer wraps a `tokenizers.Tokenizer`
    return tok.get_vocab(with_added_tokens=True)


def _special_tokens(tokenizer) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    # pad is left out: checkpoints of one family often differ only in it (Llama 2 has none, TinyLlama
    # uses </s>), and padding never reaches the drafter's proposals
    for name in ("bos_token", "eos_token"):
        out[name] = getattr(tokenizer, name, None)
    tok = getattr(tokenizer, "tok", tokenizer)
    if hasattr(tok, "get_added_tokens_decoder"):
        for i, added in sorted(tok.get_added_tokens_decoder().items()):
            if added.special:
                out[f"special[{i}]"] = added.content
    return out


def check_same_tokenizer(target_tokenizer, draft_tokenizer, target_dir: str | Path | None = None,
                         draft_dir: str | Path | None = None) -> None:
    """Refuse a drafter whose token ids do not mean the same strings as the target's.

    Compares the full vocabularies (token string -> id, added tokens included) of the
    underlying `tokenizers` objects and the special tokens (bos/eos/pad and added special
    tokens). Raises DrafterMismatchError naming the sizes; its `details` name a few differing tokens.
    """
    target_name, draft_name = str(target_dir or "target"), str(draft_dir or "draft")
    tv, dv = _vocab(target_tokenizer), _vocab(draft_tokenizer)
    problems: list[str] = []
    if tv != dv:
        only_t = sorted(set(tv) - set(dv), key=lambda s: tv[s])
        only_d = sorted(set(dv) - set(tv), key=lambda s: dv[s])
        moved = sorted((s for s in set(tv) & set(dv) if tv[s] != dv[s]), key=lambda s: tv[s])
        msg = f"vocabularies differ ({len(tv)} tokens in the target's, {len(dv)} in the draft's)"
        if only_t:
            msg += f"; {len(only_t)} only in the target, e.g. {[(s, tv[s]) for s in only_t[:3]]}"
        if only_d:
            msg += f"; {len(only_d)} only in the draft, e.g. {[(s, dv[s]) for s in only_d[:3]]}"
        if moved:
            examples = [(s, tv[s], dv[s]) for s in moved[:3]]
            msg += f"; {len(moved)} with different ids, e.g. {examples} (token, target id, draft id)"
        problems.append(msg)
    ts, ds = _special_tokens(target_tokenizer), _special_tokens(draft_tokenizer)
    diff = {k: (ts.get(k), ds.get(k)) for k in sorted(set(ts) | set(ds)) if ts.get(k) != ds.get(k)}
    if diff:
        shown = ", ".join(f"{k}: {a!r} vs {b!r}" for k, (a, b) in list(diff.items())[:4])
        problems.append(f"special tokens differ (target vs draft): {shown}")
    if problems:
        sizes = f"{len(dv)} tokens vs {len(tv)}" if len(tv) != len(dv) else "special tokens or ids differ"
        raise DrafterMismatchError(
            f"draft {draft_name} has another tokenizer than target {target_name} ({sizes}); a drafter must share "
            "the target's tokenizer: use a draft model of the same family, or ngram", "; ".join(problems))


def frequency_shortlist(sequences: list[list[int]], vocab_size: int, size: int) -> torch.Tensor:
    """The `size` most frequent token ids in `sequences` (ties and unseen ids: lowest id first),
    ascending: FR-Spec's vocabulary shortlist for a draft model's LM head.

    A draft LM head over the whole vocabulary reads vocab x hidden weights for every token
    (on the reference draft: as many bytes as its four decoder layers together); the rare
    tokens it skips are rarely the target's answer, and an early exit needs its token among
    the proposals anyway."""
    if not 1 <= size <= vocab_size:
        raise ValueError(f"shortlist size must be in [1, {vocab_size}], got {size}")
    ids = torch.tensor([t for seq in sequences for t in seq if 0 <= t < vocab_size], dtype=torch.long)
    counts = torch.bincount(ids, minlength=vocab_size)
    order = torch.sort(counts, descending=True, stable=True).indices  # stable: ties keep the lowest id first
    return order[:size].sort().values
