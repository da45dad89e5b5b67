"""Helpers for the early-exit and lossless tests: controlled drafters, banks and references."""
from __future__ import annotations

import math
import random

import torch

from specee.drafters.base import Draft, Drafter
from specee.drafters.ngram import NGramDrafter
from specee.engine.early_exit import EarlyExitDecoding
from specee.exit.config import EarlyExitConfig
from specee.engine.sequence import Sequence
from specee.exit.controller import ForcedExits
from specee.exit.bank import PredictorBank
from specee.bench.timing import count_host_reads  # noqa: F401 (the tests' import point)
from specee.sampling import SamplingParams


class AllTokensDrafter(Drafter):
    """Proposes the whole vocabulary (k = vocab): every layer's argmax is a speculative token,
    so a forced exit is always taken. Lets tests choose exit layers exactly."""

    def __init__(self, vocab_size: int, device: str | torch.device = "cpu"):
        self.k, self.name, self.fingerprint = vocab_size, "all-tokens", "all-tokens"
        self._ids = torch.arange(vocab_size, device=device)
        self._history: list[int] = []

    def reset(self, prompt_ids, max_new_tokens=None):
        self._history = list(prompt_ids)

    def advance(self, token):
        self._history.append(token)

    def propose(self):
        return self._ids

    def truncate(self, length):
        del self._history[length:]

    def teacher_forced_top_k(self, ids, start):
        return self._ids.expand(len(ids) - start, -1)


class LookupAllTokens(NGramDrafter):
    """Prompt-lookup drafts, the whole vocabulary as every row's speculative tokens: a forced exit
    is always taken, so tests choose exit layers exactly."""

    def __init__(self, vocab_size: int, device: str | torch.device = "cpu"):
        super().__init__(1, vocab_size, device)
        self.k, self._all = vocab_size, torch.arange(vocab_size, device=device)

    def propose(self) -> torch.Tensor:
        return self._all

    def row_candidates(self, draft: Draft) -> torch.Tensor:
        return self._all.expand(draft.tokens.shape[0] + 1, -1)


def constant_bank(num_layers: int, k: int, thresholds: list[float], offline: list[int] | None = None,
                  target: str = "t", drafter: str = "d") -> PredictorBank:
    """A bank whose predictors output sigmoid(0) = 0.5 everywhere: a layer fires iff its
    threshold is below 0.5 (inf disables it)."""
    hidden = 4
    return PredictorBank(torch.zeros(num_layers, 3 * k, hidden), torch.zeros(num_layers, hidden),
                         torch.zeros(num_layers, hidden), torch.zeros(num_layers), thresholds,
                         offline if offline is not None else list(range(num_layers - 1)), k, target, drafter)


def never_bank(num_layers: int, k: int, **kw) -> PredictorBank:
    return constant_bank(num_layers, k, [math.inf] * num_layers, **kw)


def decoder(llm, drafter: Drafter, bank: PredictorBank | None = None, **config) -> EarlyExitDecoding:
    L = llm.model.cfg.num_layers
    return EarlyExitDecoding(llm.model, drafter, bank or never_bank(L, drafter.k), EarlyExitConfig(**config))


def forced(dec: EarlyExitDecoding, rule):
    """Exits where rule(token index, layer) says, in place of the predictors: a maker of each
    request's ForcedExits."""
    return lambda: ForcedExits(dec.model, dec.bank, dec.thresholds, rule)


def sequence(llm, prompt_ids: list[int], params: SamplingParams) -> Sequence:
    """A request of token ids, as `EarlyExitDecoding.generate` takes it."""
    return Sequence(prompt_ids, list(prompt_ids), params, llm.tokenizer, llm.eos_ids)


def run(llm, dec: EarlyExitDecoding, prompt_ids: list[int], params: SamplingParams, force=None):
    seq = sequence(llm, prompt_ids, params)
    return seq, dec.generate(seq, forced(dec, force) if force is not None else None)


def random_forcing(seed: int, rate: float):
    """An exit rule (token index, layer) -> bool decided by a seeded hash: reproducible, different per (step, layer)."""

    def force(step: int, layer: int) -> bool:
        return random.Random(seed * 1_000_003 + step * 1009 + layer).random() < rate

    return force


@torch.inference_mode()
def reference_forced_tokens(model, drafter: Drafter, prompt_ids: list[int], n_tokens: int, force) -> list[int]:
    """The tokens forced exits must give, computed without the engine's cache or loop: at each
    position a fresh full forward (logit lens over all layers) on the history; the token is the
    argmax of the first forced layer whose argmax is a speculative token, else the last layer's."""
    history = list(prompt_ids)
    L = model.cfg.num_layers
    out: list[int] = []
    for step in range(n_tokens):
        lens = model.logits(model.hidden_states(history)[1:, -1])  # [L, V]
        spec = set(drafter.teacher_forced_top_k(history + [0], len(history))[0].tolist())
        token = int(lens[L - 1].argmax())
        for layer in range(L - 1):
            if force(step, layer) and int(lens[layer].argmax()) in spec:
                token = int(lens[layer].argmax())
                break
        out.append(token)
        history.append(token)
    return out


# early exit, with exits forced at seeded (token, layer) draws: each KV policy, lossless, and exits
# inside verification passes (lossy and lossless)
EXIT_MODES = {
    "exit_skip": dict(kv_policy="skip"),
    "exit_propagate": dict(kv_policy="propagate"),
    "exit_recompute": dict(kv_policy="recompute"),
    "exit_lossless": dict(mode="lossless"),
    "exit_in_verification": dict(kv_policy="recompute", num_draft_tokens=3),
    "exit_lossless_verification": dict(mode="lossless", num_draft_tokens=3),
}


def exit_decoding(llm, config: dict):
    """Early exit whose drafter proposes every token (a forced exit is always taken) and drafts by
    prompt lookup; exits where a seeded draw per (token index, layer) says, alike for every request."""
    dec = decoder(llm, LookupAllTokens(llm.model.cfg.vocab_size, llm.model.device), max_pending=3, **config)
    dec.make_exits = forced(dec, random_forcing(seed=7, rate=0.3))
    return dec
