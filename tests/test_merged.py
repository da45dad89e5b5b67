"""SpecEE's exits inside speculative verification passes (issue 12): checked against plain
speculative decoding, full-depth decoding and a logit-lens reference."""
from __future__ import annotations

import pytest
import torch
from checkpoints import Variant, make_checkpoint
from conftest import real_model_dir
from ee_helpers import (LookupAllTokens, constant_bank, count_host_reads, decoder, forced, never_bank,
                        random_forcing)

from specee import LLM, SamplingParams
from specee.drafters.base import Draft
from specee.drafters.ngram import NGramDrafter
from specee.exit.config import EarlyExitConfig
from specee.engine.sequence import Sequence
from specee.exit.controller import ForcedExits

DEEP = Variant("deep6m", "llama", dict(num_hidden_layers=6, num_key_value_heads=2))
SPEC = {"method": "ngram", "num_speculative_tokens": 3}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return LLM(make_checkpoint(tmp_path_factory.mktemp("merged") / "m", DEEP, seed=11), dtype="float32")


@pytest.fixture(scope="module")
def ref():
    return LLM(real_model_dir("ref-target-24L"), dtype="float32")


def ref_prompts(llm) -> list[list[int]]:
    texts = ["Explain why the sky is blue.", "Write a haiku about autumn leaves.",
             "List three uses of a paperclip.", "What is 17 times 23? Show your steps."]
    return [llm.encode(t, chat=True) for t in texts] + [llm.encode("def fibonacci(n):\n    ")]


def generate(llm, dec, prompt_ids, max_tokens, exits=None):
    seq = Sequence(prompt_ids, list(prompt_ids), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   llm.tokenizer, llm.eos_ids)
    return seq, dec.generate(seq, exits)


def configured(llm, early_exit: EarlyExitConfig | None = None, speculative: dict | None = None):
    """`llm` with these decoders (the module's fixture is shared: callers reset it)."""
    llm.early_exit = llm.speculative = None
    if early_exit is not None:
        llm.enable_early_exit(early_exit, speculative)
    elif speculative is not None:
        llm.enable_speculative(speculative)
    return llm


def test_never_firing_exits_equal_plain_speculation(ref, tmp_path):
    """Through the public API: with predictors that never fire, the merged mode's output equals
    plain speculative decoding's and full depth's. (Their passes start one token apart: plain
    speculation takes the first token from the prefill, the merged mode's first pass drafts.)"""
    L = ref.model.cfg.num_layers
    never_bank(L, 4, target=ref.fingerprint, drafter="ngram-n3").save(tmp_path / "never")
    prompts, params = ref_prompts(ref), SamplingParams(max_tokens=40, ignore_eos=True)
    try:
        full = configured(ref).generate(prompts, params)
        spec = configured(ref, speculative=SPEC).generate(prompts, params)
        for policy in ("recompute", "propagate", "skip"):
            config = EarlyExitConfig(draft="ngram", bank=str(tmp_path / "never"), kv_policy=policy)
            out = configured(ref, config, SPEC).generate(prompts, params)
            for f, s, m in zip(full, spec, out):
                assert m.token_ids == s.token_ids == f.token_ids
                assert m.stats.early_exit["mean_exit_layer"] == L
                assert m.stats.speculative["target_passes"] <= s.stats.speculative["target_passes"] + 1
    finally:
        configured(ref)
    assert sum(m.stats.speculative["accepted_tokens"] for m in out) > 10, "the prompts should accept drafts"


@torch.inference_mode()
def test_forced_exits_give_the_exit_layers_tokens(tiny):
    """recompute keeps the cache exact, so every token a pass emits after layer e (accepted drafts
    and its own choice) must be the logit lens at layer e of a fresh full forward over the final
    history (a reference without the engine's cache, loop or acceptance code)."""
    model = tiny.model
    drafter = LookupAllTokens(model.cfg.vocab_size)
    dec = decoder(tiny, drafter, kv_policy="recompute", max_pending=64, num_draft_tokens=3)
    for seed, text in enumerate(["Once upon a time there was", "The quick brown fox jumps"]):
        ids = tiny.encode(text)
        seq, r = generate(tiny, dec, ids, 40, forced(dec, random_forcing(seed=seed, rate=0.3)))
        lens = model.logits(model.hidden_states(r.history)[1:])  # [L, S, V]
        for p, e in zip(range(len(ids), len(r.history)), r.scheduler.exits):
            assert r.history[p] == int(lens[e, p - 1].argmax()), (p, e)
        hist = seq.stats.early_exit["exit_histogram"]
        assert sum(hist[:-1]) >= 10 and hist[-1] > 0, hist


class OracleAllTokens(LookupAllTokens):
    """Drafts a known continuation, every fourth token wrong."""

    def __init__(self, vocab_size: int, prompt_len: int, continuation: list[int]):
        super().__init__(vocab_size)
        self.prompt_len, self.continuation = prompt_len, continuation

    def draft(self, n, params, generator, width):
        at = len(self.history) - self.prompt_len
        tokens = [t if (at + j) % 4 != 3 else (t + 1) % self.vocab_size
                  for j, t in enumerate(self.continuation[at:at + n])]
        return Draft(torch.tensor(tokens, dtype=torch.long), ids=tokens)


def layer_two_tokens(llm, ids: list[int], n: int, policy: str = "recompute", layer: int = 2) -> list[int]:
    """One-token greedy early exit with every token forced out after `layer`."""
    one = decoder(llm, LookupAllTokens(llm.model.cfg.vocab_size), kv_policy=policy, max_pending=64)
    return generate(llm, one, ids, n, forced(one, lambda step, at: at == layer))[0].output_ids


@pytest.mark.parametrize("policy", ["recompute", "propagate", "skip"])
def test_exits_accept_drafts_as_that_layers_head_would(tiny, policy):
    """Every pass forced out after layer 2: the output does not depend on how tokens are grouped
    into passes, so one-token early exit and verification passes with (mostly right) drafts
    must emit the same tokens, the latter accepting drafts at the exit layer."""
    model = tiny.model
    ids = tiny.encode("Once upon a time there was")
    expected = layer_two_tokens(tiny, ids, 32, policy)
    drafter = OracleAllTokens(model.cfg.vocab_size, len(ids), expected)
    dec = decoder(tiny, drafter, kv_policy=policy, max_pending=64, num_draft_tokens=4)
    seq2, _ = generate(tiny, dec, ids, 32, forced(dec, lambda step, layer: layer == 2))
    assert seq2.output_ids == expected
    assert seq2.stats.speculative["accepted_tokens"] >= 12
    assert seq2.stats.early_exit["exit_histogram"][2] == 32


def test_lossless_is_identical_to_full_depth_with_absurd_thresholds(ref, tmp_path):
    """Thresholds of 0 (every scheduled layer settles) and 1 (none): the lossless merged mode
    still gives full depth's tokens."""
    L = ref.model.cfg.num_layers
    prompts, params = ref_prompts(ref), SamplingParams(max_tokens=32, ignore_eos=True)
    rollbacks = 0
    try:
        full = [o.token_ids for o in configured(ref).generate(prompts, params)]
        for name, value in (("always", 0.0), ("never", 1.0)):
            constant_bank(L, 4, [value] * L, target=ref.fingerprint, drafter="ngram-n3").save(tmp_path / name)
            config = EarlyExitConfig(draft="ngram", bank=str(tmp_path / name), mode="lossless", max_pending=6)
            for out, want in zip(configured(ref, config, SPEC).generate(prompts, params), full):
                assert out.token_ids == want
                rollbacks += out.stats.early_exit["lossless"]["rollbacks"]
    finally:
        configured(ref)
    assert rollbacks > 0, "threshold 0 should make exits that the full model rejects"


def test_lossless_with_forced_exits_on_a_tiny_model(tiny):
    """Exits forced at random layers, every argmax a speculative token: still full depth's tokens."""
    model = tiny.model
    drafter = LookupAllTokens(model.cfg.vocab_size)
    dec = decoder(tiny, drafter, kv_policy="recompute", mode="lossless", max_pending=5, num_draft_tokens=4)
    full = [o.token_ids for o in tiny.generate([tiny.encode(t) for t in ("Once upon a", "Tom and his friend")],
                                               SamplingParams(max_tokens=30, ignore_eos=True))]
    for seed, (text, want) in enumerate(zip(("Once upon a", "Tom and his friend"), full)):
        seq, r = generate(tiny, dec, tiny.encode(text), 30, forced(dec, random_forcing(seed=seed + 3, rate=0.4)))
        assert seq.output_ids == want
        assert seq.stats.early_exit["lossless"]["verified_positions"] > 0


class RecordingExits(ForcedExits):
    """Never exits; records every row's features at every layer, keyed by the row's position among
    the generated tokens and the drafts before it in the pass."""

    def __init__(self, dec):
        super().__init__(dec.model, dec.bank, dec.thresholds, lambda step, layer: False)
        self.records = {}

    def begin_pass(self, candidates, draft, token_index):
        super().begin_pass(candidates, draft, token_index)
        self.drafts = tuple(draft.tolist())

    def fires(self, layer, feats):
        for row, f in enumerate(feats):
            self.records[self.token_index + row, self.drafts[:row], layer] = f.clone()
        return super().fires(layer, feats)


@torch.inference_mode()
def test_features_of_a_verification_row_equal_the_position_decoded_alone(ref):
    """Each row of a verification pass whose history the one-token decode also reached (its
    drafts were right) gets the same features at every layer, float32 rounding aside."""
    ids = ref.encode("List three uses of a paperclip.", chat=True)
    recorded, outputs = {}, {}
    for drafts in (0, 3):
        dec = decoder(ref, NGramDrafter(4, ref.model.cfg.vocab_size), kv_policy="recompute", num_draft_tokens=drafts)
        seq = Sequence(ids, list(ids), SamplingParams(max_tokens=40, ignore_eos=True), ref.tokenizer, ref.eos_ids)
        exits = RecordingExits(dec)
        dec.generate(seq, lambda: exits)
        recorded[drafts], outputs[drafts] = exits.records, seq.output_ids
    assert outputs[0] == outputs[3]  # never exits: both are full depth
    out, alone = outputs[0], {(t, layer): f for (t, _, layer), f in recorded[0].items()}
    # a row whose drafts are the output's own tokens has the history the one-token decode had there
    drafted_rows = [(t, layer, f) for (t, drafts, layer), f in recorded[3].items()
                    if drafts and tuple(out[t - len(drafts) : t]) == drafts and (t, layer) in alone]
    assert len(drafted_rows) >= 5 * (ref.model.cfg.num_layers - 1), "the prompt should accept several drafts"
    for t, layer, f in drafted_rows:
        torch.testing.assert_close(f, alone[t, layer], atol=2e-4, rtol=1e-4)


def test_one_host_read_per_checked_layer_in_a_verification_pass(tiny):
    """Per pass: one read per predictor call, one more when the pass settles, one for a pass that
    runs every layer; drafts and candidates are never read back."""
    L, V = tiny.model.cfg.num_layers, tiny.model.cfg.vocab_size
    ids = tiny.encode("Once upon a time there was a little girl")
    drafter = OracleAllTokens(V, len(ids), layer_two_tokens(tiny, ids, 24))  # the exits' own tokens, mostly
    bank = constant_bank(L, V, [0.6, 0.6, 0.4, 0.6, 0.4, float("inf")], offline=[0, 1, 2, 3, 4])
    dec = decoder(tiny, drafter, bank, kv_policy="recompute", num_draft_tokens=3)
    with count_host_reads() as reads:
        seq, r = generate(tiny, dec, ids, 24)
    ee, spec = seq.stats.early_exit, seq.stats.speculative
    assert ee["exits_accepted"] > 0 and spec["accepted_tokens"] > 0
    settled = ee["exits_accepted"] + ee["exits_rejected"]
    full_depth_passes = spec["target_passes"] - ee["exits_accepted"]
    assert sum(reads.values()) == ee["predictor_calls"] + settled + full_depth_passes


@pytest.mark.parametrize("spec, message", [
    ({"method": "eagle", "model": "."}, "the EAGLE head reads target layers"),
    ({"method": "ngram", "prompt_lookup_max": 2}, "prompt_lookup_max 3"),
    ({"method": "draft_model", "model": "some/draft"}, "its model must be 'ngram'"),
])
def test_speculation_the_exit_drafter_cannot_serve_is_refused(tiny, spec, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # ".": a directory with a head's files, which method eagle's model must hold
    for name in ("head.safetensors", "manifest.json"):
        (tmp_path / name).touch()
    with pytest.raises(ValueError, match=message):
        tiny.enable_early_exit(EarlyExitConfig(draft="ngram"), spec)


def test_cli_generate_with_exits_inside_speculation(tiny, tmp_path, capsys):
    import json

    from specee.cli import main

    L = tiny.model.cfg.num_layers
    never_bank(L, 4, target=tiny.fingerprint, drafter="ngram-n3").save(tmp_path / "bank")
    base = ["generate", "--model", str(tiny.model_dir), "--prompt", "Once upon a time", "--no-chat", "--json",
            "--max-new-tokens", "12", "--draft", "ngram", "--bank", str(tmp_path / "bank")]
    assert main(base + ["--speculative-config", json.dumps(SPEC)]) == 0
    report = json.loads(capsys.readouterr().out)
    expected = tiny.generate("Once upon a time", SamplingParams(max_tokens=12))[0].token_ids
    assert report["token_ids"] == expected
    assert report["stats"]["speculative"]["num_speculative_tokens"] == 3 and "early_exit" in report["stats"]
    assert main(base + ["--speculative-config", '{"method": "ngram", "tree": {"topk": 2}}']) == 2
    assert "specee: error: --speculative-config: 'tree' needs a drafter" in capsys.readouterr().err


class LayerZeroGreedy(LookupAllTokens):
    """Drafts layer 0's greedy continuation of the history so far (the first token now comes from the
    full model's prefill, so a continuation fixed in advance would miss)."""

    def __init__(self, model):
        super().__init__(model.cfg.vocab_size)
        self.model = model

    @torch.inference_mode()
    def draft(self, n, params, generator, width):
        history, tokens = list(self.history), []
        for _ in range(n):
            tokens.append(int(self.model.logits(self.model.hidden_states(history)[1, -1:]).argmax()))
            history.append(tokens[-1])
        return Draft(torch.tensor(tokens, dtype=torch.long), ids=tokens)


def test_lossless_sampling_in_passes_keeps_the_models_joint_distribution(tiny):
    """Sampled passes of drafts (layer 0's greedy continuation, so some are accepted) exit at layer 0
    and their tokens stay unverified until the full model checks them: the three tokens'
    empirical distribution must match the full model's p(t1) p(t2 | t1) p(t3 | t1 t2)."""
    from collections import Counter

    from specee.sampling import probabilities

    model, L = tiny.model, tiny.model.cfg.num_layers
    ids = tiny.encode("Once upon a time")
    sp = SamplingParams(temperature=1.0, top_k=2)
    with torch.inference_mode():
        def dist(history):
            return probabilities(model.logits(model.hidden_states(history)[L, -1:]), sp)[0]

        joint = {}
        p1 = dist(ids)
        for t1 in p1.nonzero().flatten().tolist():
            p2 = dist(ids + [t1])
            for t2 in p2.nonzero().flatten().tolist():
                p3 = dist(ids + [t1, t2])
                joint.update({(t1, t2, t3): float(p1[t1] * p2[t2] * p3[t3]) for t3 in p3.nonzero().flatten().tolist()})
    drafter = LayerZeroGreedy(model)
    dec = decoder(tiny, drafter, kv_policy="recompute", mode="lossless", max_pending=8, num_draft_tokens=2)
    n, counts, accepted, rollbacks = 1500, Counter(), 0, 0
    for seed in range(n):
        seq = Sequence(ids, list(ids), SamplingParams(max_tokens=3, seed=seed, ignore_eos=True, temperature=1.0, top_k=2),
                       tiny.tokenizer, tiny.eos_ids)
        dec.generate(seq, forced(dec, lambda step, layer: layer == 0))
        counts[tuple(seq.output_ids)] += 1
        accepted += seq.stats.speculative["accepted_tokens"]
        rollbacks += seq.stats.early_exit["lossless"]["rollbacks"]
    assert accepted > n // 4 and rollbacks > n // 4, "drafts and exits must be accepted and rejected often"
    assert set(counts) <= set(joint)
    tv = 0.5 * sum(abs(counts[k] / n - v) for k, v in joint.items())
    assert tv < 0.07, f"TV(empirical, joint) = {tv:.3f}"  # sampling noise over <= 8 triples ~0.035


DEEP_INT4 = Variant("deep6q", "llama", dict(num_hidden_layers=6, num_key_value_heads=2), vocab_padding=8)


@pytest.mark.parametrize("policy", ["skip", "propagate", "recompute"])
def test_exits_in_passes_on_the_quantized_cpp_layer_equal_the_python_layer(tmp_path_factory, policy):
    """Exits inside chain passes on the default CPU path (int4, the C++ layer) give the Python layer's
    tokens with every KV policy: skip's holes must reach the C++ layer as a mask (it used to take
    the chain's shortcut and read the holes: 8 of 48 tokens agreed). The two layers' attention sums
    in different orders and int8 activations turn an ulp into a step, so a near tie may part the
    texts late (recompute on an AVX2 CPU, session 41: at token 33 of 48); they must agree on at
    least the first half."""
    llm = LLM(make_checkpoint(tmp_path_factory.mktemp("q") / "m", DEEP_INT4, seed=11), dtype="float32",
              quantization="int4")
    fast = llm.model.fast_layers
    assert fast is not None
    ids = llm.encode("Once upon a time there was a little girl who")
    outs = []
    for layers in (fast, None):
        llm.model.fast_layers = layers
        dec = decoder(llm, LookupAllTokens(llm.model.cfg.vocab_size), kv_policy=policy, max_pending=64,
                      num_draft_tokens=3)
        seq, _ = generate(llm, dec, ids, 48, forced(dec, random_forcing(seed=1, rate=0.3)))
        assert seq.stats.speculative["drafts"] >= 5 and sum(seq.stats.early_exit["exit_histogram"][:-1]) >= 10
        outs.append(seq.output_ids)
    same = next((i for i, (a, b) in enumerate(zip(*outs)) if a != b), len(outs[0]))
    assert same >= 24, f"the C++ and Python layers part at token {same} of 48"
