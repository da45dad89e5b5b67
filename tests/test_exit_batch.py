"""Early exit over a batch of requests on the engine core (each request exits on its own): checked
against each request decoded alone, the full model's cache, and full depth."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from checkpoints import Variant, make_checkpoint
from ee_helpers import AllTokensDrafter, constant_bank, decoder, forced, never_bank, random_forcing, run

from specee import LLM, SamplingParams
from specee.engine.full_depth import prefill
from specee.engine.sequence import Sequence
from specee.exit.config import EarlyExitConfig
from specee.exit.controller import ForcedExits

POLICIES = ("skip", "propagate", "recompute")
DEEP = Variant("deep6", "llama", dict(num_hidden_layers=6, num_key_value_heads=2))
TEXTS = ("Once upon a time there was", "The", "In a small village by the sea, an old fisherman")


@pytest.fixture(scope="module")
def deep_llm(tmp_path_factory):
    return LLM(make_checkpoint(tmp_path_factory.mktemp("deep") / "m", DEEP, seed=3), dtype="float32")


def sequences(llm, max_tokens: list[int]) -> list[Sequence]:
    """Prompts of different lengths (one of a single token: nothing to prefill)."""
    out = []
    for text, n in zip(TEXTS, max_tokens):
        ids = llm.encode(text)[:1] if text == "The" else llm.encode(text)
        out.append(Sequence(ids, list(ids), SamplingParams(max_tokens=n, ignore_eos=True), llm.tokenizer, llm.eos_ids))
    return out


@pytest.mark.parametrize("policy", POLICIES)
def test_a_batch_with_forced_exits_equals_each_request_alone(deep_llm, policy):
    """Exits forced by the same rule for every request: each request of the batch (its KV policy
    acting on its own cache) emits what it emits decoded alone, and the one that finishes first
    leaves without changing the others."""
    drafter = AllTokensDrafter(deep_llm.model.cfg.vocab_size)
    dec = decoder(deep_llm, drafter, kv_policy=policy, max_pending=64)
    force = random_forcing(seed=11, rate=0.3)
    seqs = sequences(deep_llm, [20, 9, 20])
    dec.generate(seqs, forced(dec, force))
    for s in seqs:
        alone, _ = run(deep_llm, dec, s.prompt_ids, s.params, force)
        assert s.output_ids == alone.output_ids
    hist = seqs[0].stats.early_exit["exit_histogram"]
    assert sum(hist[:-1]) >= 3 * 6, f"the forcing should make many passes exit early: {hist}"
    assert seqs[1].stats.decode_seconds < seqs[0].stats.decode_seconds  # it finished first


@torch.inference_mode()
def test_recompute_in_a_batch_leaves_every_request_the_full_models_cache(deep_llm):
    """Carried rows of several requests, each in its own cache: each request's cache rows equal a
    full forward over its own tokens, wherever they are filled."""
    drafter = AllTokensDrafter(deep_llm.model.cfg.vocab_size)
    dec = decoder(deep_llm, drafter, kv_policy="recompute", max_pending=4)
    seqs = sequences(deep_llm, [24, 24, 24])
    states = dec.generate(seqs, forced(dec, random_forcing(seed=2, rate=0.35)))
    for s in seqs:
        assert sum(s.stats.early_exit["exit_histogram"][:-1]) >= 6
    for st in states:
        tokens = st.history[:-1]  # the last emitted token was never fed through the model
        n = len(tokens)
        ref = deep_llm.model.new_cache(1, n)
        prefill(deep_llm.model, ref, [tokens])
        filled = st.cache.filled[:, 0, :n]
        owed = torch.zeros_like(filled)
        for p in st.kv.pending:
            owed[p.resume:, p.slot] = True
        assert torch.equal(filled, ~owed)
        for name in ("k", "v"):
            got, want = getattr(st.cache, name)[:, 0, :, :n], getattr(ref, name)[:, 0, :, :n]
            mask = filled[:, None, :, None].expand_as(got)
            torch.testing.assert_close(got[mask], want[mask], atol=1e-4, rtol=1e-4)


class NeverFires(ForcedExits):
    def __init__(self, dec):
        super().__init__(dec.model, dec.bank, dec.thresholds, lambda step, layer: False)


def test_each_request_exits_on_its_own(deep_llm):
    """A request whose predictors never fire runs every token at full depth while its batch mates
    exit at layer 1: nobody waits for anybody (per-request exits, not a batch-level exit point)."""
    drafter = AllTokensDrafter(deep_llm.model.cfg.vocab_size)
    dec = decoder(deep_llm, drafter, kv_policy="skip")
    at_one = forced(dec, lambda step, layer: layer == 1)
    seqs = sequences(deep_llm, [12, 5, 12])
    states = dec.generate(seqs, [at_one, lambda: NeverFires(dec), at_one])
    L = deep_llm.model.cfg.num_layers
    assert states[1].scheduler.exits == [L - 1] * 5
    for st in (states[0], states[2]):
        assert st.scheduler.exits == [1] * 12
    assert [len(s.output_ids) for s in seqs] == [12, 5, 12]
    assert seqs[0].stats.early_exit["exit_histogram"] == [0, 12] + [0] * (L - 2)


def test_requests_of_a_batch_sample_with_their_own_parameters(deep_llm):
    """A greedy request, and seeded sampled ones: each request's tokens do not depend on its batch
    mates (exits forced alike for every request), seeds matter, and greedy equals greedy alone."""
    drafter = AllTokensDrafter(deep_llm.model.cfg.vocab_size)
    dec = decoder(deep_llm, drafter, kv_policy="recompute", max_pending=64)
    force = random_forcing(seed=3, rate=0.3)
    ids = [deep_llm.encode(t) for t in TEXTS]

    def batch(*params):
        seqs = [Sequence(i, list(i), p, deep_llm.tokenizer, deep_llm.eos_ids) for i, p in zip(ids, params)]
        dec.generate(seqs, forced(dec, force))
        return [s.output_ids for s in seqs]

    greedy = SamplingParams(max_tokens=16, ignore_eos=True)
    hot = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.9, top_k=40, seed=1)
    a = batch(greedy, hot, replace(hot, seed=2))
    b = batch(replace(hot, seed=9), hot, replace(hot, top_p=0.8, seed=2))
    assert a[1] == b[1]  # the same request, other mates
    assert a[1] != a[2]  # another seed
    assert a[0] == run(deep_llm, dec, ids[0], greedy, force)[0].output_ids
    assert a[0] != b[0]  # sampled with seed 9 instead of greedy


def test_the_llm_batches_lossy_and_lossless_exits(deep_llm, tmp_path):
    """Through the API, with predictors that never fire: lossy and lossless requests share steps
    (three requests of 16 tokens in about 16 steps, not 48); both give full depth's tokens."""
    from specee.drafters.ngram import NGramDrafter

    L = deep_llm.model.cfg.num_layers
    drafter = NGramDrafter(4, deep_llm.model.cfg.vocab_size)
    never_bank(L, 4, target=deep_llm.fingerprint, drafter=drafter.fingerprint).save(tmp_path / "bank")
    prompts = [deep_llm.encode(t) for t in TEXTS]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    full = deep_llm.generate(prompts, params)
    try:
        for mode in ("lossy", "lossless"):
            deep_llm.enable_early_exit(EarlyExitConfig(draft="ngram", bank=str(tmp_path / "bank"), mode=mode))
            engine, steps = deep_llm.engine, []
            real = engine.step
            engine.step = lambda: steps.append(1) or real()
            outs = deep_llm.generate(prompts, params)
            assert [o.token_ids for o in outs] == [f.token_ids for f in full]
            assert len(steps) <= 18, mode
    finally:
        deep_llm.early_exit = None


def test_a_stream_closed_inside_a_batch_leaves_the_others_running(deep_llm, tmp_path):
    """Aborting one request of an early-exit batch finishes it ("abort"); the others decode on to
    the tokens they get without it."""
    from specee.drafters.ngram import NGramDrafter

    drafter = NGramDrafter(4, deep_llm.model.cfg.vocab_size)
    never_bank(deep_llm.model.cfg.num_layers, 4, target=deep_llm.fingerprint,
               drafter=drafter.fingerprint).save(tmp_path / "bank")
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    full = deep_llm.generate([deep_llm.encode(TEXTS[2])], params)[0]
    deep_llm.enable_early_exit(EarlyExitConfig(draft="ngram", bank=str(tmp_path / "bank")))
    try:
        a, b = (Sequence(ids, list(ids), params, deep_llm.tokenizer, deep_llm.eos_ids)
                for ids in (deep_llm.encode(TEXTS[0]), deep_llm.encode(TEXTS[2])))
        engine = deep_llm.engine
        engine.add_request(a)
        engine.add_request(b)
        engine.step()
        engine.step()
        engine.abort(a)
        while engine.has_unfinished():
            engine.step()
    finally:
        deep_llm.early_exit = None
    assert a.finish_reason == "abort" and len(a.output_ids) == 2
    assert b.output_ids == full.token_ids and b.finish_reason == "length"


def test_lossy_output_depends_only_on_the_request_not_on_earlier_traffic(deep_llm):
    """Real (constant) predictors under the payoff gate, which stops checking layers that do not pay:
    a request decoded after other traffic, and next to other requests, gives the tokens it gives
    first thing on a fresh decoder (each request learns its own schedule)."""
    from specee.exit.controller import ExitController

    L = deep_llm.model.cfg.num_layers
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    ids = [deep_llm.encode(t) for t in TEXTS]
    drafter = AllTokensDrafter(1)  # a few tokens the requests emit: some exits confirm, some do not
    seen = sorted({t for o in deep_llm.generate(ids, params) for t in o.token_ids})
    drafter.k, drafter._ids = 6, torch.tensor(seen[:6])
    bank = constant_bank(L, drafter.k, [0.4, 0.6, 0.4, 0.6, 0.4, float("inf")], offline=[0, 2, 4])

    def fresh():
        return decoder(deep_llm, drafter, bank, kv_policy="recompute", check_cost=0.6)

    def one(dec, prompt):
        seq = Sequence(prompt, list(prompt), params, deep_llm.tokenizer, deep_llm.eos_ids)
        dec.generate(seq)
        return seq

    first = one(fresh(), ids[0])
    assert isinstance(fresh().make_exits(), ExitController)  # the real predictors, not forced exits
    hist = first.stats.early_exit["exit_histogram"]
    assert 0 < sum(hist[:-1]) < 24, f"the request should exit at some tokens only: {hist}"
    dec = fresh()
    for prompt in ids[1:] * 2:  # earlier traffic on the same decoder
        one(dec, prompt)
    assert one(dec, ids[0]).output_ids == first.output_ids
    together = [Sequence(p, list(p), params, deep_llm.tokenizer, deep_llm.eos_ids) for p in ids]
    dec.generate(together)
    assert together[0].output_ids == first.output_ids


def test_the_checks_after_a_layer_share_their_host_reads(monkeypatch):
    """Each request's exit check yields the device values it needs; the runner reads those of every
    request checked after the same layer at once (one read per round, not one per request), and
    hands each check its own values."""
    import torch

    from specee.engine.runner import run_checks

    def check(x: int, confirms: bool):
        first = yield torch.tensor([x, x + 1])
        if not confirms:
            return first == [x, x + 1] and x > 0
        second = yield torch.tensor([10 * x])
        return first == [x, x + 1] and second == [10 * x]

    reads = []
    real = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append(self.numel()) or real(self))
    assert run_checks({0: check(1, True), 2: check(0, False), 5: check(3, True), 7: check(4, False)}) == \
        {0: True, 2: False, 5: True, 7: True}
    assert reads == [8, 2]  # two rounds: four checks' first values, then the two that confirm
