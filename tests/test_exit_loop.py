"""The early-exit decode loop as the engine review asked: host reads per token, rollback
bookkeeping, float32 predictors, skip checked against a masked-attention reference,
multi-position lossless sampling, and the attention fast paths."""
from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch
from checkpoints import Variant, make_checkpoint
from ee_helpers import AllTokensDrafter, constant_bank, count_host_reads, decoder, random_forcing, run

from specee import LLM, SamplingParams
from specee.exit.features import exit_features, spec_rows
from specee.sampling import probabilities

DEEP = Variant("deep5", "llama", dict(num_hidden_layers=5, num_key_value_heads=2))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return LLM(make_checkpoint(tmp_path_factory.mktemp("loop") / "m", DEEP, seed=5), dtype="float32")


class FixedDrafter(AllTokensDrafter):
    """Proposes the same k tokens, already on the device: a drafter that reads nothing back."""

    def __init__(self, tokens: list[int]):
        super().__init__(1)
        self.k, self._ids = len(tokens), torch.tensor(tokens)


def test_exit_decision_is_one_host_read_per_checked_layer(tiny):
    """Per token: one read per predictor call, one more when it fires (membership and token
    together), one for a full-depth token; nothing else in the loop reads the device."""
    L = tiny.model.cfg.num_layers
    ids = tiny.encode("Once upon a time")
    hist_tokens = tiny.generate([ids], SamplingParams(max_tokens=12, ignore_eos=True))[0].token_ids
    drafter = FixedDrafter(sorted(set(hist_tokens))[:4])  # some argmaxes among them, some not
    bank = constant_bank(L, drafter.k, [0.4, 0.6, 0.4, 0.4, float("inf")], offline=[0, 1, 2, 3])
    dec = decoder(tiny, drafter, bank, kv_policy="recompute")
    with count_host_reads() as reads:
        seq, r = run(tiny, dec, ids, SamplingParams(max_tokens=12, ignore_eos=True))
    s = seq.stats.early_exit
    fired = s["exits_accepted"] + s["exits_rejected"]
    assert s["exits_accepted"] > 0 and s["exits_rejected"] > 0, "the test needs both outcomes"
    assert sum(reads.values()) == s["predictor_calls"] + fired + s["exit_histogram"][-1]


def test_a_batch_reads_the_device_once_per_checked_layer_and_once_per_step(tiny, monkeypatch):
    """Three requests (one finishing early) in one engine: the predictor checks of all requests
    after the same layer share one read (and the confirmations of the passes they settle one
    more), and all the requests that ran every layer in a step share that step's one read."""
    from specee.engine.engine import Engine
    from specee.engine.sequence import Sequence
    from specee.exit.controller import ExitController

    L = tiny.model.cfg.num_layers
    texts = ("Once upon a time", "The cat", "In a small village by the sea")
    hist_tokens = tiny.generate(list(texts), SamplingParams(max_tokens=12, ignore_eos=True))
    drafter = FixedDrafter(sorted({t for o in hist_tokens for t in o.token_ids})[:24])
    bank = constant_bank(L, drafter.k, [0.4, 0.6, 0.4, 0.4, float("inf")], offline=[0, 1, 2, 3])
    dec = decoder(tiny, drafter, bank, kv_policy="recompute")
    seqs = [Sequence(t, tiny.encode(t), SamplingParams(max_tokens=n, ignore_eos=True), tiny.tokenizer, tiny.eos_ids)
            for t, n in zip(texts, (12, 5, 12))]
    engine = Engine(tiny.model, dec)
    for s in seqs:
        engine.add_request(s)
    deep = []  # per step: whether some request ran every layer
    real = dec.choose
    dec.choose = lambda r, logits: deep.__setitem__(-1, deep[-1] or r.state.step.hit is None) or real(r, logits)
    rounds = []  # (step, layer, round) of every value a check asked for
    check = ExitController.check

    def recorded(self, layer, h_in, h):
        inner, values, k = check(self, layer, h_in, h), None, 0
        try:
            while True:
                wanted = inner.send(values)
                rounds.append((len(deep), layer, k))
                k += 1
                values = yield wanted
        except StopIteration as done:
            return done.value
    monkeypatch.setattr(ExitController, "check", recorded)
    with count_host_reads() as reads:
        while engine.has_unfinished():
            deep.append(False)
            engine.step()
    stats = [s.stats.early_exit for s in seqs]
    assert sum(e["exits_accepted"] for e in stats) > 0 and sum(e["exits_rejected"] for e in stats) > 0
    assert len(rounds) == sum(e["predictor_calls"] + e["exits_accepted"] + e["exits_rejected"] for e in stats)
    assert sum(deep) < sum(e["exit_histogram"][-1] for e in stats)  # full-depth requests shared reads
    assert len(set(rounds)) < len(rounds)  # checks after the same layer met
    assert sum(reads.values()) == len(set(rounds)) + sum(deep)


def test_rollback_forgets_the_discarded_tokens_exit_layers(tiny):
    drafter = AllTokensDrafter(tiny.model.cfg.vocab_size)
    ids = tiny.encode("The cat sat on")
    dec = decoder(tiny, drafter, kv_policy="recompute", mode="lossless", max_pending=3)
    seq, r = run(tiny, dec, ids, SamplingParams(max_tokens=30, ignore_eos=True), random_forcing(seed=4, rate=0.5))
    s = seq.stats.early_exit
    assert s["lossless"]["rollbacks"] > 0 and s["lossless"]["discarded_tokens"] > 0
    emitted = len(r.history) - len(ids)
    assert sum(s["exit_histogram"]) == emitted == len(r.scheduler.exits)
    assert Counter(r.scheduler.exits) == {i: c for i, c in enumerate(s["exit_histogram"]) if c}


def test_predictors_run_in_float32_on_bfloat16_models(tmp_path):
    llm = LLM(make_checkpoint(tmp_path / "m", DEEP, seed=5), dtype="bfloat16")
    model, L = llm.model, llm.model.cfg.num_layers
    dec = decoder(llm, FixedDrafter([1, 2, 3, 4]), constant_bank(L, 4, [0.4] * L))
    assert dec.bank.w1.dtype == torch.float32
    with torch.inference_mode():
        hs = model.hidden_states(llm.encode("Once upon a time"))  # bfloat16
        rows = spec_rows(model, torch.tensor([5, 9, 2, 7]))
        got = exit_features(model, hs[1], hs[2], rows)
        x = torch.nn.functional.rms_norm(torch.stack([hs[1], hs[2]]).double(), (model.cfg.hidden_size,),
                                         model.final_norm.double(), model.cfg.rms_norm_eps)
        logits = x @ rows.double().T
        probs = torch.softmax(logits, dim=-1)
        want = torch.cat([logits[1], probs[1], probs[1] - probs[0]], dim=-1)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)  # bfloat16 math is ~1e-2 off


@torch.inference_mode()
def test_skip_equals_a_masked_attention_reference(tiny):
    """skip: a token that exited after layer e has no K/V at layers past e. Reference: one
    teacher-forced pass over the whole history where, at layer i, position p reads the
    positions q <= p that reached layer i; each emitted token must be the logit lens of the
    previous position at its exit layer."""
    model, L = tiny.model, tiny.model.cfg.num_layers
    drafter = AllTokensDrafter(model.cfg.vocab_size)
    ids = tiny.encode("Once upon a time")
    seq, r = run(tiny, decoder(tiny, drafter, kv_policy="skip"), ids,
                 SamplingParams(max_tokens=16, ignore_eos=True), random_forcing(seed=7, rate=0.3))
    exits = r.scheduler.exits
    assert any(e < L - 1 for e in exits) and any(e == L - 1 for e in exits)
    tokens = r.history[:-1]
    depth = torch.tensor([L - 1] * (len(ids) - 1) + exits)  # layer each fed position left at
    S = len(tokens)
    cache = model.new_cache(1, S)
    base = model.range_inputs(0, S)
    pos = torch.arange(S)
    h = model.embed(torch.tensor([tokens]))
    outs = []
    for i in range(L):
        reads = (pos[None, :] <= pos[:, None]) & ((depth[None, :] >= i) | (pos[None, :] == pos[:, None]))
        h = model.layer(i, h, dataclasses.replace(base, reads="mask", mask=reads.view(1, 1, S, S)), cache)
        outs.append(h[0])
    for p in range(len(ids) - 1, S):
        want = int(model.logits(outs[int(depth[p])][p]).argmax())
        assert r.history[p + 1] == want, f"position {p + 1}"


def test_lossless_sampling_preserves_the_joint_distribution_of_two_positions(tiny):
    """Both tokens exit at layer 0 and stay unverified until the flush: the pair's empirical
    distribution must match the full model's p(t1) p(t2 | t1)."""
    drafter = AllTokensDrafter(tiny.model.cfg.vocab_size)
    ids = tiny.encode("Once upon a time")
    params = dict(temperature=1.0, top_k=3)
    sp = SamplingParams(**params)
    def pair_distribution(layer: int) -> dict[tuple[int, int], float]:
        """p(t1) p(t2 | t1) from the logit lens at `layer` (the last: the full model)."""
        dist = lambda history: probabilities(tiny.model.logits(tiny.model.hidden_states(history)[layer + 1, -1:]), sp)[0]
        p1, joint = dist(ids), {}
        for t1 in p1.nonzero().flatten().tolist():
            p2 = dist(ids + [t1])
            joint.update({(t1, t2): float(p1[t1] * p2[t2]) for t2 in p2.nonzero().flatten().tolist()})
        return joint

    with torch.inference_mode():
        joint, draft = pair_distribution(tiny.model.cfg.num_layers - 1), pair_distribution(0)
    tv_draft = 0.5 * sum(abs(joint.get(k, 0.0) - draft.get(k, 0.0)) for k in set(joint) | set(draft))
    assert tv_draft > 0.3, "the test needs a draft far from the target to have power"
    dec = decoder(tiny, drafter, kv_policy="recompute", mode="lossless", max_pending=4)
    n, counts = 2000, Counter()
    for seed in range(n):
        seq, _ = run(tiny, dec, ids, SamplingParams(max_tokens=2, seed=seed, ignore_eos=True, **params),
                     lambda step, layer: layer == 0)
        counts[tuple(seq.output_ids)] += 1
    assert set(counts) <= set(joint)
    tv = 0.5 * sum(abs(counts[k] / n - v) for k, v in joint.items())
    assert tv < 0.06, f"TV(empirical, joint) = {tv:.3f}"  # sampling noise over <= 9 pairs ~0.03


def test_requests_with_different_sampling_parameters_share_a_batch(tiny, monkeypatch):
    from specee.engine.runner import ModelRunner

    batches = []
    real = ModelRunner.forward

    def spy(self, segments, *a):
        if not batches or len(segments) != batches[-1]:
            batches.append(len(segments))
        return real(self, segments, *a)

    monkeypatch.setattr(ModelRunner, "forward", spy)
    prompts = ["Once upon a time", "The cat sat on", "A little bird said"]
    params = [SamplingParams(max_tokens=10, temperature=1.0, seed=s) for s in (1, 2, 3)]
    together = [o.token_ids for o in tiny.generate(prompts, params)]
    assert batches == [3]  # every step ran the three requests together
    alone = [tiny.generate(p, sp)[0].token_ids for p, sp in zip(prompts, params)]
    assert together == alone
    batches.clear()
    mixed = [params[0], dataclasses.replace(params[1], temperature=0.5, top_k=4), SamplingParams(max_tokens=6)]
    together = [o.token_ids for o in tiny.generate(prompts, mixed)]
    assert batches == [3, 2]  # the one with max_tokens 6 left first
    assert together == [tiny.generate(p, sp)[0].token_ids for p, sp in zip(prompts, mixed)]


@torch.inference_mode()
def test_attention_paths_agree(tiny):
    """Causal without a mask (prefill), a mask with grouped KV heads, and the same mask with the
    KV heads expanded (what CUDA runs) give the same rows."""
    model = tiny.model
    ids = tiny.encode("Once upon a time there was a cat")
    S = len(ids)
    causal = model.hidden_states(ids)[-1]
    start = 3  # rows 3..S-1 after a causal prefill of 0..2: a mask over kv_len > rows
    outs = []
    for expand in (False, True):
        model.expand_kv_for_mask = expand
        cache = model.new_cache(1, S)
        model.forward(torch.tensor([ids[:start]]), model.range_inputs(0, start), cache)
        step = model.range_inputs(start, S - start)
        assert step.mask is not None and not step.causal
        outs.append(model.forward(torch.tensor([ids[start:]]), step, cache)[0])
    model.expand_kv_for_mask = False
    torch.testing.assert_close(outs[0], causal[start:], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)


def test_decode_feeds_the_predictors_the_features_calibration_recorded(tiny):
    """The features the decode loop gives each predictor equal those calibration trained it on,
    position by position and layer by layer (a wrong hidden state or drafter state would differ)."""
    from specee.calibration.exit_data import record_calibration
    from specee.drafters.ngram import NGramDrafter

    model, L = tiny.model, tiny.model.cfg.num_layers
    ids = tiny.encode("Once upon a time there was a cat. Once upon a time")
    m = 12
    drafter = NGramDrafter(4, model.cfg.vocab_size, model.device)
    rec = record_calibration(model, tiny.tokenizer, drafter, [ids], max_new_tokens=m, eos_ids=frozenset(),
                             progress=False)
    bank = constant_bank(L, 4, [0.6] * (L - 1) + [float("inf")])  # never fires
    dec = decoder(tiny, drafter, bank, check_cost=0)  # checked at every layer even though it never pays
    seen = []
    prob = dec.bank.prob
    dec.bank.prob = lambda layer, feats: seen.append((layer, feats.clone())) or prob(layer, feats)
    seq, _ = run(tiny, dec, ids, SamplingParams(max_tokens=m, ignore_eos=True))
    assert rec["next"].tolist()[: m - 1] == seq.output_ids[1:]  # the same greedy continuation
    assert [layer for layer, _ in seen] == list(range(L - 1)) * m
    # decode step s >= 1 feeds c_{s-1}: calibration's position s - 1 (step 0 feeds the last prompt token)
    for s in range(1, m):
        for layer in range(L - 1):
            torch.testing.assert_close(seen[s * (L - 1) + layer][1][0], rec["feats"][layer, s - 1],
                                       atol=1e-4, rtol=1e-4)
