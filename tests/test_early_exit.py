"""Early-exit decoding (issue 3): checked against full-depth decoding and plain references."""
from __future__ import annotations

import math

import pytest
import torch
from checkpoints import Variant, make_checkpoint
from conftest import real_model_dir
from ee_helpers import (AllTokensDrafter, constant_bank, decoder, never_bank, random_forcing,
                        reference_forced_tokens, run)

from specee import LLM, SamplingParams
from specee.exit.config import EarlyExitConfig
from specee.engine.full_depth import prefill
from specee.exit.scheduler import RETRY_AFTER, ExitPayoff, TwoLevelScheduler
from specee.model.rope import inverse_frequencies

POLICIES = ("skip", "propagate", "recompute")
DEEP = Variant("deep6", "llama", dict(num_hidden_layers=6, num_key_value_heads=2))


@pytest.fixture(scope="module")
def deep_llm(tmp_path_factory):
    return LLM(make_checkpoint(tmp_path_factory.mktemp("deep") / "m", DEEP, seed=3), dtype="float32")


@pytest.fixture(scope="module")
def ref_pair():
    from specee.drafters.draft_model import DraftModelDrafter

    llm = LLM(real_model_dir("ref-target-24L"), dtype="float32")
    drafter = DraftModelDrafter(real_model_dir("ref-draft-4L"), llm.tokenizer, 4, "cpu", torch.float32)
    return llm, drafter


def prompt_ids(llm, text="Once upon a time there was"):
    return llm.encode(text)


@pytest.mark.parametrize("policy", POLICIES)
def test_never_firing_predictors_give_full_depth_tokens(ref_pair, policy, tmp_path):
    """Through the public API: a bank whose predictors never fire must change nothing."""
    llm, drafter = ref_pair
    bank = never_bank(llm.model.cfg.num_layers, 4, target=llm.fingerprint, drafter=drafter.fingerprint)
    bank.save(tmp_path / "bank")
    prompts = [llm.encode("Explain why the sky is blue.", chat=True), llm.encode("def fibonacci(n):")]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    llm.early_exit = None
    full = llm.generate(prompts, params)
    llm.enable_early_exit(EarlyExitConfig(draft=str(real_model_dir("ref-draft-4L")), bank=str(tmp_path / "bank"),
                                          kv_policy=policy))
    try:
        early = llm.generate(prompts, params)
    finally:
        llm.early_exit = None
    for f, e in zip(full, early):
        assert e.token_ids == f.token_ids
        assert e.stats.early_exit["mean_exit_layer"] == llm.model.cfg.num_layers
        assert e.stats.early_exit["exits_accepted"] == 0


def test_forced_exits_give_the_exit_layers_tokens(deep_llm):
    """recompute keeps the cache exact, so each token must be what a fresh full forward's
    logit lens gives at the first forced layer (a reference without the engine's cache)."""
    drafter = AllTokensDrafter(deep_llm.model.cfg.vocab_size)
    ids = prompt_ids(deep_llm)
    force = random_forcing(seed=1, rate=0.3)
    # max_pending above the token count: no forced full-depth step overrides the forcing
    seq, r = run(deep_llm, decoder(deep_llm, drafter, kv_policy="recompute", max_pending=64), ids,
                 SamplingParams(max_tokens=24, ignore_eos=True), force)
    expected = reference_forced_tokens(deep_llm.model, drafter, ids, 24, force)
    assert seq.output_ids == expected
    hist = seq.stats.early_exit["exit_histogram"]
    assert sum(hist[:-1]) >= 8, f"the forcing should make many tokens exit early: {hist}"


def test_forced_exits_with_a_real_drafter_on_the_reference_pair(ref_pair):
    """Same reference on the real pair: exits are taken only when the layer's argmax is among
    the draft model's top-4."""
    llm, drafter = ref_pair
    ids = llm.encode("Give three tips for staying healthy.", chat=True)
    force = random_forcing(seed=7, rate=0.25)
    seq, r = run(llm, decoder(llm, drafter, kv_policy="recompute", max_pending=64), ids,
                 SamplingParams(max_tokens=16, ignore_eos=True), force)
    assert seq.output_ids == reference_forced_tokens(llm.model, drafter, ids, 16, force)
    ee = seq.stats.early_exit
    assert ee["exits_accepted"] > 0 and ee["exits_rejected"] > 0  # both outcomes of the top-k check happen


@torch.inference_mode()
def full_cache(model, tokens: list[int]):
    cache = model.new_cache(1, len(tokens))
    prefill(model, cache, [tokens])
    return cache


def test_recompute_cache_equals_full_depth_cache(deep_llm):
    drafter = AllTokensDrafter(deep_llm.model.cfg.vocab_size)
    ids = prompt_ids(deep_llm)
    seq, r = run(deep_llm, decoder(deep_llm, drafter, kv_policy="recompute", max_pending=4), ids,
                 SamplingParams(max_tokens=30, ignore_eos=True), random_forcing(seed=2, rate=0.35))
    tokens = r.history[:-1]  # the last emitted token was never fed through the model
    n = len(tokens)
    ref = full_cache(deep_llm.model, tokens)
    filled = r.cache.filled[:, 0, :n]
    # Everything is filled except the layers still owed by rows carried past the end.
    owed = torch.zeros_like(filled)
    for p in r.kv.pending:
        owed[p.resume:, p.slot] = True
    assert torch.equal(filled, ~owed)
    assert sum(seq.stats.early_exit["exit_histogram"][:-1]) >= 8
    for name in ("k", "v"):
        got, want = getattr(r.cache, name)[:, 0, :, :n], getattr(ref, name)[:, 0, :, :n]
        mask = filled[:, None, :, None].expand_as(got)
        torch.testing.assert_close(got[mask], want[mask], atol=1e-4, rtol=1e-4)


def test_skip_leaves_holes_and_propagate_fills_them(deep_llm):
    """skip: layers past the exit hold no entry for that slot; propagate: they hold the K/V
    projected from the exit hidden state (checked against a plain recomputation)."""
    model = deep_llm.model
    L = model.cfg.num_layers
    drafter = AllTokensDrafter(model.cfg.vocab_size)
    ids = prompt_ids(deep_llm)
    force = lambda step, layer: step % 2 == 1 and layer == 1  # odd steps exit after layer 1
    seq, r = run(deep_llm, decoder(deep_llm, drafter, kv_policy="skip"), ids,
                 SamplingParams(max_tokens=8, ignore_eos=True), force)
    P = len(ids) - 1  # slot of the first early-exit step (the last prompt token)
    for step in range(7):
        col = r.cache.filled[:, 0, P + step]
        assert col[:2].all()
        assert bool(col[2:].any()) == (step % 2 == 0), f"step {step}: filled {col.tolist()}"

    seq, r = run(deep_llm, decoder(deep_llm, drafter, kv_policy="propagate"), ids,
                 SamplingParams(max_tokens=8, ignore_eos=True), force)
    assert r.cache.filled[:, 0, : len(r.history) - 1].all()
    # slot P + 1 exited after layer 1: its layer-j K must be RoPE(k_proj(norm_j(h_1)))
    tokens = r.history[: P + 2]
    with torch.inference_mode():
        h1 = model.hidden_states(tokens)[2, -1]  # output of layer 1 at slot P + 1 (cache exact up to it)
        for j in range(2, L):
            w = model.layers[j]
            x = torch.nn.functional.rms_norm(h1, (model.cfg.hidden_size,), w.attn_norm, model.cfg.rms_norm_eps)
            q_dim = model.cfg.num_heads * model.cfg.head_dim
            kv_dim = model.cfg.num_kv_heads * model.cfg.head_dim
            k = (w.qkv.weight[q_dim:q_dim + kv_dim] @ x).view(model.cfg.num_kv_heads, model.cfg.head_dim)
            angle = (P + 1) * inverse_frequencies(model.cfg)
            cos, sin = torch.cat([angle.cos(), angle.cos()]), torch.cat([angle.sin(), angle.sin()])
            k_rot = k * cos + torch.cat([-k[:, k.shape[1] // 2:], k[:, : k.shape[1] // 2]], dim=-1) * sin
            torch.testing.assert_close(r.cache.k[j, 0, :, P + 1], k_rot, atol=1e-5, rtol=1e-5)


def test_sampling_early_exit_is_reproducible_and_respects_limits(deep_llm):
    drafter = AllTokensDrafter(deep_llm.model.cfg.vocab_size)
    dec = decoder(deep_llm, drafter, kv_policy="recompute")
    params = SamplingParams(max_tokens=20, temperature=0.8, top_k=20, seed=5, ignore_eos=True)
    force = random_forcing(seed=3, rate=0.4)
    a, _ = run(deep_llm, dec, prompt_ids(deep_llm), params, force)
    b, _ = run(deep_llm, dec, prompt_ids(deep_llm), params, force)
    c, _ = run(deep_llm, dec, prompt_ids(deep_llm), SamplingParams(max_tokens=20, temperature=0.8, top_k=20,
                                                                  seed=6, ignore_eos=True), force)
    assert a.output_ids == b.output_ids and len(a.output_ids) == 20
    assert a.output_ids != c.output_ids


def test_stats_account_for_every_step(deep_llm):
    drafter = AllTokensDrafter(deep_llm.model.cfg.vocab_size)
    seq, _ = run(deep_llm, decoder(deep_llm, drafter), prompt_ids(deep_llm),
                 SamplingParams(max_tokens=12, ignore_eos=True), random_forcing(seed=4, rate=0.3))
    ee = seq.stats.early_exit
    assert ee["decode_steps"] == 12 == sum(ee["exit_histogram"])
    assert ee["exits_accepted"] == sum(ee["exit_histogram"][:-1])
    expected_mean = sum((i + 1) * c for i, c in enumerate(ee["exit_histogram"])) / 12
    assert ee["mean_exit_layer"] == pytest.approx(expected_mean, abs=1e-3)
    assert 0 <= sum(ee["time_share"].values()) <= 1


def test_threshold_decides_firing(deep_llm):
    """With constant predictors (p = 0.5), thresholds below 0.5 always fire and above never do."""
    L = deep_llm.model.cfg.num_layers
    drafter = AllTokensDrafter(deep_llm.model.cfg.vocab_size)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    fire_at_2 = constant_bank(L, drafter.k, [math.inf, 0.9, 0.4, 0.4, math.inf, math.inf], offline=[1, 2, 3])
    seq, _ = run(deep_llm, decoder(deep_llm, drafter, fire_at_2, online_window=0, max_pending=64),
                 prompt_ids(deep_llm), params)
    assert seq.stats.early_exit["exit_histogram"][2] == 10  # layer 1 never fires (0.9), layer 2 always
    # the bound on carried rows forces full-depth steps
    seq, _ = run(deep_llm, decoder(deep_llm, drafter, fire_at_2, online_window=0, max_pending=4),
                 prompt_ids(deep_llm), params)
    assert seq.stats.early_exit["forced_full_depth"] == 2
    assert seq.stats.early_exit["exit_histogram"][2] == 8 and seq.stats.early_exit["exit_histogram"][-1] == 2


def test_scheduler_two_levels():
    inf = math.inf
    s = TwoLevelScheduler(8, offline_layers=[2, 5], thresholds=[0.5] * 6 + [inf, 0.5], online_window=2,
                          online_radius=1)
    assert s.offline_layers == [2, 5]
    assert [i for i, on in enumerate(s.layers()) if on] == [2, 5]
    s.record(3)
    assert [i for i, on in enumerate(s.layers()) if on] == [2, 3, 4, 5]
    s.record(6)  # layer 6 is disabled (inf) and 7 is the last layer: neither is scheduled
    assert [i for i, on in enumerate(s.layers()) if on] == [2, 3, 4, 5]
    s.record(0)  # window 2: the exit at 3 has left the window
    assert [i for i, on in enumerate(s.layers()) if on] == [0, 1, 2, 5]


def test_a_layer_that_stops_paying_is_not_checked_until_a_retry():
    """Checks cost 0.25 layers: a layer whose predictor never exits drops out of the schedule
    within about 16 checks and comes back for one check after RETRY_AFTER passes; one that exits
    (saving 5 layers) keeps being checked; the calibration prior decides where it starts."""
    L = 8
    prior = ExitPayoff.prior_from({"exit_distribution": [0, 0, 50, 0, 10, 0, 0, 940]}, L)
    assert prior[2] == pytest.approx(0.05 * 5) and prior[4] == pytest.approx(0.01 * 3)
    payoff = ExitPayoff(L, 0.25, [1.0] * L)
    s = TwoLevelScheduler(L, offline_layers=[2, 4], thresholds=[0.5] * L, online_window=0, payoff=payoff)
    checks = {2: 0, 4: 0}
    for _ in range(40):
        for layer in (i for i, on in enumerate(s.layers()) if on):
            checks[layer] += 1
            s.observe(layer, exited=layer == 2)
    assert checks[2] == 40 and 10 <= checks[4] <= 30
    for _ in range(RETRY_AFTER):
        s.layers()
    assert s.layers()[4], "retried"
    s.observe(4, exited=False)
    assert not s.layers()[4]
    free = TwoLevelScheduler(L, [2, 4], [0.5] * L, online_window=0, payoff=ExitPayoff(L, 0.0))
    for _ in range(100):
        free.observe(4, exited=False)
    assert free.layers()[4], "cost 0: always checked"


def test_bad_early_exit_configs():
    with pytest.raises(ValueError, match="kv_policy must be one of"):
        EarlyExitConfig(kv_policy="fill")
    with pytest.raises(ValueError, match="lossless mode needs kv_policy='recompute'"):
        EarlyExitConfig(kv_policy="skip", mode="lossless")
    with pytest.raises(ValueError, match="max_pending must be an integer >= 1, got 0"):
        EarlyExitConfig(max_pending=0)
    with pytest.raises(ValueError, match="threshold_scale must be > 0"):
        EarlyExitConfig(threshold_scale=0)
    # each once passed: offline_size -1 took all ranked layers but the last, the others failed later or never
    for field, bad, least in (("offline_size", -1, 0), ("offline_size", 1.5, 0), ("online_radius", -3, 0),
                              ("max_pending", 2.5, 1), ("k", True, 1), ("num_draft_tokens", "2", 0)):
        with pytest.raises(ValueError, match=rf"^{field} must be an integer >= {least}, got {bad!r}$"):
            EarlyExitConfig(draft="ngram", **{field: bad})
    assert EarlyExitConfig(draft="ngram", offline_size=None, online_radius=0).offline_size is None
    assert EarlyExitConfig(draft="ngram", offline_size=0).offline_size == 0  # the sweep's "online checks only"


def test_bank_for_another_drafter_is_refused(ref_pair, tmp_path):
    llm, drafter = ref_pair
    bank = never_bank(llm.model.cfg.num_layers, 4, target=llm.fingerprint, drafter="some-other-drafter")
    bank.save(tmp_path / "bank")
    with pytest.raises(ValueError, match="calibrated with drafter"):
        llm.enable_early_exit(EarlyExitConfig(draft=str(real_model_dir("ref-draft-4L")), bank=str(tmp_path / "bank")))
    assert llm.early_exit is None


def test_calibration_is_an_explicit_step_not_a_constructor_side_effect(tmp_path, monkeypatch):
    """LLM(early_exit=...) without a cached bank loads and serves at full depth; `calibrate()` (what the
    CLI calls, with its progress bars) or the first request makes the bank once; the next LLM finds it."""
    import specee.calibration as calibration

    monkeypatch.setenv("SPECEE_CACHE", str(tmp_path / "cache"))
    calls = []

    def fake_calibrate(model, tokenizer, drafter, prompts, *, k, target_fingerprint, **kw):
        calls.append(drafter.fingerprint)
        L = model.cfg.num_layers
        return constant_bank(L, k, [math.inf] * L, target=target_fingerprint, drafter=drafter.fingerprint)

    monkeypatch.setattr(calibration, "calibrate", fake_calibrate)
    path = make_checkpoint(tmp_path / "m", "llama2", seed=4)
    config = EarlyExitConfig(draft="ngram")
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    llm = LLM(path, dtype="float32", early_exit=config, progress=False)
    assert not calls and llm.early_exit is None  # nothing calibrated while constructing
    assert llm.calibrate() is not None and calls == ["ngram-n3"] and llm.early_exit is not None
    assert llm.calibrate() is None and len(calls) == 1  # nothing more waits
    again = LLM(path, dtype="float32", early_exit=config, progress=False)
    assert again.early_exit is not None and len(calls) == 1  # the cached bank
    monkeypatch.setenv("SPECEE_CACHE", str(tmp_path / "other"))
    first_use = LLM(path, dtype="float32", early_exit=config, progress=False)
    out = first_use.generate("Once upon a time", params)[0]
    assert len(calls) == 2 and first_use.early_exit is not None and out.stats.early_exit is not None
