"""Sampling parameters (shaped like vLLM's) and the token choice from logits."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .model.kernels import loaded_cpu_kernels


SEED_LIMIT = 2**64  # torch.Generator.manual_seed takes seeds below this
NONFINITE_TOKEN = -1  # what sampling returns for a row whose logits hold NaN or Inf: Sequence ends it as an error
# Temperatures below this are greedy, as in vLLM: logits divided by 1e-38 overflow float32, and a step that
# drew from the NaNs failed every request beside the one that asked for it
GREEDY_BELOW = 1e-5


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 (or below GREEDY_BELOW) means greedy. top_k 0 and top_p 1.0 disable those filters
    (top-p keeps at least the best token, however small top_p is). stop: a string, a
    list of strings or None. Every field is checked here, so a bad value fails before any work."""

    max_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        stop = () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise TypeError(f"stop must be a string or a list of strings, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(stop))
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens (max_new_tokens) must be a positive integer, got {self.max_tokens!r}")
        for name in ("temperature", "top_p"):
            if not _is_number(getattr(self, name)):
                raise TypeError(f"{name} must be a number, got {getattr(self, name)!r}")
        if not (0.0 <= self.temperature < float("inf")):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = disabled), got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise TypeError(f"seed must be an integer or None, got {self.seed!r}")
        if self.seed is not None and not 0 <= self.seed < SEED_LIMIT:
            raise ValueError(f"seed must be in [0, 2**64), got {self.seed}")
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        if any(not s for s in self.stop):
            raise ValueError(f"stop must hold non-empty strings, got {list(self.stop)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def make_generator(self, device: torch.device) -> torch.Generator | None:
        if self.greedy:
            return None
        g = torch.Generator(device=device)
        g.manual_seed(self.seed if self.seed is not None else int(torch.randint(0, 2**62, ()).item()))
        return g


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution sampling draws from: temperature, then top-k, then top-p. logits: [B, V]."""
    logits = logits.float() / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass strictly above each token
        cut = before >= params.top_p
        cut[..., 0] = False  # the best token stays (a top_p below float32's smallest number rounds to 0)
        sorted_probs = sorted_probs.masked_fill(cut, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample(logits: torch.Tensor, params: SamplingParams,
           generators: torch.Generator | list[torch.Generator | None] | None) -> torch.Tensor:
    """Next token per row, [B] int64, from logits [B, V]. With one generator per row (one per
    request), a seeded request draws the same tokens whatever it is batched with at full depth.
    (Speculation and early exit draw per verified row, and whether a step drafts is measured, so
    there a seed fixes the distribution, not the tokens: speculative/gate.py, row_gate.py.) A row whose
    logits hold NaN or Inf gets NONFINITE_TOKEN (no extra host read: it travels with the tokens)."""
    if params.greedy:
        return greedy(logits)
    bad = ~logits.amax(dim=-1).isfinite()
    probs = probabilities(logits.masked_fill(bad[:, None], 0.0), params)  # bad rows: any draw, replaced below
    if not isinstance(generators, list):
        tokens = torch.multinomial(probs, 1, generator=generators).squeeze(-1)
    else:
        tokens = torch.cat([torch.multinomial(p, 1, generator=g) for p, g in zip(probs, generators)])
    return torch.where(bad, NONFINITE_TOKEN, tokens)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """The argmax per row (its first index), or NONFINITE_TOKEN where the row's best logit is NaN or
    Inf (a NaN anywhere in a row makes its max NaN). On the CPU one C++ call (greedy.cpp) does what
    torch does in three, several times faster a row."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2 and (
            kernels := loaded_cpu_kernels()) is not None:
        return kernels.greedy_rows(logits.contiguous())
    best, tokens = logits.max(dim=-1)
    return torch.where(best.isfinite(), tokens, NONFINITE_TOKEN)


def top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """The indices of the k largest along the last dim (a quantized LM head's candidates for exact
    rescoring, model/quant.py): on the CPU one C++ call over float32 rows (greedy.cpp; torch.topk took
    121 us of a SmolLM2 token), else torch.topk."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and (kernels := loaded_cpu_kernels()) is not None:
        rows = logits.reshape(-1, logits.shape[-1]).contiguous()
        return kernels.top_k_rows(rows, k).view(*logits.shape[:-1], k)
    return logits.topk(k, dim=-1).indices

