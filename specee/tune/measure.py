"""`specee tune`'s measurements: every decoding mode specee has, timed on this machine in one process.

Candidates: full depth; n-gram speculation and, with a draft model, draft-model speculation at several
lengths; lossless early exit (and lossy, reported but never chosen) with each drafter whose predictor
bank is cached (or calibrated on request: minutes); then, in a second pass beside full depth again,
lossless exits inside the verification passes of each drafter's fastest length. The metric is greedy
decode tokens/s, EOS ignored, on short prompts the predictors were not calibrated on. As in
`specee bench speed`, runs are interleaved (per prompt and round every candidate runs once, the order
alternating), so a machine whose load drifts slows them alike; a prompt's time is its median round.
A candidate is eligible only if it is lossless and its greedy tokens equal full depth's on every
prompt. It replaces full depth only when at least MARGIN faster overall and faster per token in so many
of its runs paired with full depth's (same prompt, same round) that chance would rarely give as many
(a one-sided sign test, p < ALPHA): on a busy 2-core machine four runs of 4 prompts x 2 rounds put
n-gram speculation at 4 tokens at 1.37x, 0.82x, 0.77x and 0.94x full depth (SmolLM2 Q4_1), and the
overall ratio alone chose a different configuration in each.
"""
from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..bench.common import fit_prompt, median, resolve_chat
from ..bench.speculative import aggregate_speculative
from ..bench.timing import Run, in_turns, specee_run
from ..progress import progress_bar

# Short prompts of several kinds (not from the calibration data, which banks are fitted on): summaries
# and translations copy their input (n-gram lookup's best case), code, reasoning and free writing do not.
BUILTIN_PROMPTS = (
    "Summarize in two sentences: The city council voted on Tuesday to extend the bike lane network by twelve "
    "kilometres. The new lanes will connect the train station with the university and the old harbour. "
    "Construction starts in spring and should be finished before the end of next year.",
    "Write a Python function that returns the n-th Fibonacci number, with a docstring and a short example.",
    "Explain in a few sentences why the sky is blue.",
    "A shop sells pencils at 3 for 45 cents. How much do 12 pencils cost? Explain step by step.",
    "Translate to French: The weather is nice today, so we will walk to the market and buy fresh bread.",
    "Answer from the text. Text: Marie Curie was born in Warsaw in 1867. She moved to Paris in 1891, where she "
    "studied physics and mathematics. Question: Where did Marie Curie study physics?",
    "Write a short story about a robot that learns to paint.",
    "List five tips for staying focused while studying.",
)
LENGTHS = (1, 2, 3, 4)  # num_speculative_tokens tried by default
EXIT_K = 4  # the drafter's top-k that early exit's predictors read (generate's --k default, banks' cache key)
MARGIN = 1.02  # within 2% of full depth: not worth a drafter's memory and variance
ALPHA = 0.05  # the sign test's level: with 4 prompts x 2 rounds, faster in at least 7 of the 8 pairs
WARMUP_TOKENS = 8


@dataclass
class Candidate:
    name: str
    label: str
    config: dict[str, Any]  # what a profile stores: label, speculative_config, early_exit, draft (profile.apply)
    decoding: Any = None  # the SpeculativeDecoding or EarlyExitDecoding installed for its runs (None: full depth)
    lossless: bool = True
    exits: bool = False  # an EarlyExitDecoding


@dataclass
class Result:
    candidate: Candidate
    decode_tokens_per_second: float
    ratio: float  # to full depth measured in the same pass
    differing: int  # prompts whose greedy tokens differ from full depth's
    detail: str
    wins: int = 0  # runs faster per token than full depth's run of the same prompt and round
    pairs: int = 0
    second_pass: bool = False

    @property
    def eligible(self) -> bool:
        return self.candidate.lossless and self.differing == 0

    @property
    def significant(self) -> bool:
        """Faster than full depth in more paired runs than chance gives (one-sided sign test, p < ALPHA)."""
        return self.pairs > 0 and sign_test(self.wins, self.pairs) < ALPHA


def sign_test(wins: int, pairs: int) -> float:
    """P(at least `wins` of `pairs` fair coin flips): how often chance alone would win as often."""
    return sum(math.comb(pairs, i) for i in range(wins, pairs + 1)) / 2 ** pairs


@dataclass
class Tuning:
    results: list[Result]
    chosen: Result
    settings: dict[str, Any]


# ---- candidates ------------------------------------------------------------------------------------
def count(n: int, word: str) -> str:
    return f"{n} {word}{'s' if n != 1 else ''}"


def speculation_candidates(llm, lengths: tuple[int, ...], draft: Path | None) -> list[Candidate]:
    """n-gram speculation and, with `draft`, draft-model speculation at each length; the lengths of one
    method share one drafter (a draft model is loaded once)."""
    from ..model.weights import fingerprint_weights
    from ..speculative.config import make_decoder
    from ..speculative.speculative import SpeculativeDecoding

    methods = [("ngram", "n-gram", None)] + ([("draft_model", "draft model", draft)] if draft else [])
    out = []
    for method, what, model in methods:
        first = None
        draft_record = None if model is None else {"path": str(model), "fingerprint": fingerprint_weights(model)}
        for n in lengths:
            spec = {"method": method, "num_speculative_tokens": n} | ({} if model is None else {"model": str(model)})
            if first is None:
                decoding = first = make_decoder(llm, spec)
            else:
                decoding = SpeculativeDecoding(llm.model, first.drafter, n, None, method)
            label = f"{what} speculation, {count(n, 'token')}"
            out.append(Candidate(f"{method}-{n}", label, {"label": label, "speculative_config": spec,
                                                          "draft": draft_record}, decoding))
    return out


def exit_bases(llm, drafts: list[str], calibrate: bool, say: Callable[[str], None]) -> dict[str, tuple[Any, Path]]:
    """Per drafter ("ngram" or a draft model path) whose predictor bank is cached, or calibrated when
    `calibrate`: a lossless early-exit decoder and its bank's path. A drafter without one is skipped
    with a note (calibrating takes minutes)."""
    from ..exit.config import EarlyExitConfig

    bases = {}
    for draft in drafts:
        bank = llm.bank_cache_path(llm.drafter_fingerprint(draft), EXIT_K)
        what = "n-gram" if draft == "ngram" else f"draft model {Path(draft).name}"
        cached = (bank / "manifest.json").exists()
        if not cached and not calibrate:
            say(f"early exit with the {what} drafter not measured: no predictor bank cached for it "
                "(--early-exit calibrates one first: minutes)")
            continue
        config = EarlyExitConfig(draft=draft, bank=str(bank) if cached else None, k=EXIT_K, mode="lossless")
        llm.enable_early_exit(config)
        llm.calibrate()  # the bank, when not cached (with its progress bars)
        bases[draft] = (llm.early_exit, bank)
    llm.early_exit = None
    return bases


def exit_candidate(llm, base, bank: Path, draft: str, mode: str, spec: dict[str, Any] | None = None) -> Candidate:
    """Early exit (`mode`) with the base decoder's drafter and bank; with `spec`, inside its verification passes."""
    from ..engine.early_exit import EarlyExitDecoding
    from ..engine.loading import merged_config

    config = replace(base.config, bank=str(bank), mode=mode)
    if spec is not None:
        config = merged_config(config, spec)
    what = "n-gram" if draft == "ngram" else "draft model"
    if spec is not None:
        label = f"{what} speculation, {count(spec['num_speculative_tokens'], 'token')} + lossless exits in verification"
        name = f"{spec['method']}-{spec['num_speculative_tokens']}+exits"
    else:
        label = f"{'lossless' if mode == 'lossless' else 'lossy'} early exit, {what} drafter"
        name = f"exit-{'ngram' if draft == 'ngram' else 'draft_model'}-{mode}"
    stored = {"label": label, "speculative_config": spec,
              "early_exit": {"draft": draft, "k": config.k, "bank": str(bank)},
              "draft": None if draft == "ngram" else {"path": draft, "fingerprint": base.drafter.fingerprint}}
    return Candidate(name, label, stored, EarlyExitDecoding(llm.model, base.drafter, base.bank, config),
                     lossless=mode == "lossless", exits=True)


# ---- measuring ----------------------------------------------------------------------------------------
class Tuner:
    """Times candidates on the prompts (token ids), in interleaved rounds, under one thread count."""

    def __init__(self, llm, prompts: list[list[int]], max_new_tokens: int, rounds: int, progress: bool):
        self.llm, self.prompts, self.max_new_tokens, self.rounds, self.progress = \
            llm, prompts, max_new_tokens, rounds, progress

    def run(self, candidate: Candidate, ids: list[int], n: int) -> Run:
        llm = self.llm
        if candidate.exits:
            llm.speculative, llm.early_exit = None, candidate.decoding
        else:
            llm.early_exit, llm.speculative = None, candidate.decoding
        return specee_run(llm, ids, n)

    def measure(self, candidates: list[Candidate], desc: str, second_pass: bool = False) -> list[Result]:
        """Results in the candidates' order; the first candidate is full depth, the ratios' reference."""
        runs: dict[str, list[list[Run]]] = {c.name: [[] for _ in self.prompts] for c in candidates}
        total = len(candidates) * (1 + len(self.prompts) * self.rounds)
        bar = progress_bar(total=total, enabled=self.progress, desc=desc, unit="run", leave=False)
        try:
            for c in candidates:  # warm-up: first use of each drafter and pool, and the speculation gates
                bar.set_postfix_str(f"warm-up {c.name}")
                self.run(c, self.prompts[0], min(self.max_new_tokens, WARMUP_TOKENS))
                bar.update(1)
            for turn, c in in_turns(candidates, len(self.prompts) * self.rounds):
                i = turn // self.rounds
                bar.set_postfix_str(f"prompt {i + 1}/{len(self.prompts)} {c.name}")
                runs[c.name][i].append(self.run(c, self.prompts[i], self.max_new_tokens))
                bar.update(1)
        finally:
            bar.close()
            self.llm.early_exit, self.llm.speculative = None, None
        reference = runs[candidates[0].name]
        speeds = {c.name: _speed(runs[c.name]) for c in candidates}
        full = speeds[candidates[0].name]
        results = []
        for c in candidates:
            pairs = [(run, ref) for rs, refs in zip(runs[c.name], reference) for run, ref in zip(rs, refs)]
            wins = sum(run.decode_seconds / run.decode_tokens < ref.decode_seconds / ref.decode_tokens
                       for run, ref in pairs)
            differing = sum(rs[0].token_ids != refs[0].token_ids for rs, refs in zip(runs[c.name], reference))
            results.append(Result(c, speeds[c.name], speeds[c.name] / full, differing, _detail(runs[c.name]),
                                  wins, len(pairs), second_pass))
        return results


def _speed(per_prompt: list[list[Run]]) -> float:
    """Decode tokens over the sum of each prompt's median decode time."""
    tokens = sum(rs[0].decode_tokens for rs in per_prompt)
    seconds = sum(median(r.decode_seconds for r in rs) for rs in per_prompt)
    return tokens / seconds if seconds > 0 else 0.0


def _detail(per_prompt: list[list[Run]]) -> str:
    """What the mode did: tokens per target pass of speculation, the mean exit layer of early exit."""
    first = [rs[0] for rs in per_prompt]
    if first[0].early_exit is not None:
        layers = first[0].early_exit["num_layers"]
        mean = sum(r.early_exit["mean_exit_layer"] for r in first) / len(first)
        return f"mean exit layer {mean:.1f} of {layers}"
    if first[0].speculative is not None:
        spec = aggregate_speculative([r.speculative for r in first])
        if not spec["drafts"]:
            return "no step drafted"
        return f"{spec['mean_accepted_length']:.2f} tokens per drafted pass"
    return ""


def fit_prompts(llm, texts: list[str], max_new_tokens: int) -> list[list[int]]:
    """Token ids of the prompts (through the chat template where the model has one), each shortened to
    fit the context with `max_new_tokens`; a one-line error naming --max-new-tokens where none can."""
    chat = resolve_chat(llm, "auto")
    return [fit_prompt(llm, text, chat, max_new_tokens)[0] for text in texts]


def choose(results: list[Result]) -> Result:
    """The fastest eligible candidate at least MARGIN faster than full depth (results[0]) and faster in
    significantly many paired runs; else full depth."""
    better = [r for r in results[1:] if r.eligible and r.significant and r.ratio >= MARGIN]
    return max(better, key=lambda r: r.ratio, default=results[0])


def tune(llm, texts: list[str], *, draft: Path | None = None, lengths: tuple[int, ...] = LENGTHS,
         max_new_tokens: int = 96, rounds: int = 2, early_exit: bool = False, progress: bool = True,
         say: Callable[[str], None] = lambda _: None) -> Tuning:
    """Measure every candidate on `texts` and choose. `early_exit`: calibrate the predictor banks that
    are not cached (else early exit runs only with cached ones); `say`: notes, as they arise."""
    llm.threads.hold()  # one thread count for every candidate: the one the profile is stored for
    load_before = load_average()
    tuner = Tuner(llm, fit_prompts(llm, texts, max_new_tokens), max_new_tokens, rounds, progress)
    full = Candidate("full", "full depth", {"label": "full depth"})
    speculation = speculation_candidates(llm, lengths, draft)
    drafts = ["ngram"] + ([str(draft)] if draft else [])
    bases = exit_bases(llm, drafts, early_exit, say)
    exits = [exit_candidate(llm, base, bank, d, mode) for d, (base, bank) in bases.items()
             for mode in ("lossless", "lossy")]
    first = [full, *speculation, *exits]
    say(f"timing {len(first)} configurations on {count(len(texts), 'prompt')} x {max_new_tokens} tokens, "
        f"{count(rounds, 'round')} each, with {count(llm.threads.choice.threads, 'thread')}")
    results = tuner.measure(first, "tune")
    merged = []
    for d, (base, bank) in bases.items():  # exits inside the verification passes of this drafter's best length
        method = "ngram" if d == "ngram" else "draft_model"
        own = [r for r in results if not r.candidate.exits and r.candidate.decoding is not None
               and r.candidate.config["speculative_config"]["method"] == method]
        spec = max(own, key=lambda r: r.ratio).candidate.config["speculative_config"]
        merged.append(exit_candidate(llm, base, bank, d, "lossless", spec))
    if merged:
        results += tuner.measure([full, *merged], "tune: exits in verification", second_pass=True)[1:]
    load = max(load_before, load_average())
    if competed(load, os.cpu_count() or 1):
        say(f"the machine was busy while timing (load average {load:.1f} on {count(os.cpu_count() or 1, 'core')}): "
            "the ratios vary more than on an idle one; run again when it is idle, or with more --rounds")
    settings = {"prompts": len(texts), "max_new_tokens": max_new_tokens, "rounds": rounds, "lengths": list(lengths),
                "threads": llm.threads.choice.threads, "load_average": round(load, 2)}
    return Tuning(results, choose(results), settings)


def competed(load: float, cores: int) -> bool:
    """Whether other processes competed with the timed runs: the timing's own threads keep the load near
    the core count (2.0-2.1 with 2 threads on 2 idle cores), so only half a core more counts."""
    return load > cores + 0.5


def load_average() -> float:
    """The 1-minute load average (0 where the platform has none): above the core count, other processes
    competed with the timed runs."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return 0.0
