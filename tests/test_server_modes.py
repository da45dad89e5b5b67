"""The decoding modes `specee serve` can be started in beyond test_server.py's: an EAGLE head (chain and
tree) and SpecEE early exit (lossy, lossless, exits inside draft-model verification). For each, with
the official openai client against a live server on a loopback port, the greedy non-streamed and
streamed texts equal `LLM.generate`'s for the same request, on the reference pair."""
from __future__ import annotations

import pytest
import torch
from conftest import real_model_dir

pytest.importorskip("fastapi", reason="the server extra (pip install 'specee[server]') is not installed")
pytest.importorskip("openai", reason="the openai client (requirements-ci.txt) is not installed")

from server_helpers import LiveServer, served_chat  # noqa: E402

from specee import LLM, EarlyExitConfig, SamplingParams  # noqa: E402
from specee.server import create_app  # noqa: E402

QUESTION, MAX_TOKENS = "Explain why the sky is blue.", 24


def served_equals_generate(llm: LLM):
    """The served answers (non-streamed, streamed) equal generate's; returns the response's stats and the server's
    /metrics text."""
    server = LiveServer(create_app(llm, model_name="ref"))
    try:
        want = llm.generate(QUESTION, SamplingParams(max_tokens=MAX_TOKENS), chat=True)[0]
        full, streamed = served_chat(server, "ref", QUESTION, MAX_TOKENS)
        assert full.choices[0].message.content == streamed == want.text
        assert full.usage.completion_tokens == len(want.token_ids)
        return full.model_extra["specee"]["choices"][0], server.request("GET", "/metrics")[2].decode()
    finally:
        server.stop()


@pytest.fixture(scope="module")
def full_depth_text():
    llm = LLM(real_model_dir("ref-target-24L"), dtype="float32")
    return llm.generate(QUESTION, SamplingParams(max_tokens=MAX_TOKENS), chat=True)[0].text


@pytest.mark.parametrize("tree", [None, {"topk": 2, "size": 6}], ids=["chain", "tree"])
def test_eagle_head_served_equals_generate(tree, tmp_path, full_depth_text):
    """A random EAGLE head (features of layers 0 and 12; built in a second, drafts junk): speculation is
    lossless, so the texts also equal full depth's."""
    from specee.drafters.eagle_head import EagleHead, EagleHeadConfig

    target = real_model_dir("ref-target-24L")
    base = LLM(target, dtype="float32")
    cfg = EagleHeadConfig.for_target(base.model.cfg, (0, 12), 256)
    shortlist = torch.randperm(base.model.cfg.vocab_size, generator=torch.Generator().manual_seed(0))[:256]
    head = EagleHead.init_random(base.model, cfg, shortlist.sort().values, seed=0, target_fingerprint=base.fingerprint)
    head.save(tmp_path / "head")
    config = {"method": "eagle", "model": str(tmp_path / "head"), "num_speculative_tokens": 3}
    llm = LLM(target, dtype="float32", speculative_config={**config, **({"tree": tree} if tree else {})})
    llm.speculative.gate = None  # every step drafts (the gate, timing a busy machine, might draft none)
    stats, metrics = served_equals_generate(llm)
    assert stats["speculative"]["method"] == "eagle" and stats["speculative"]["drafts"] > 0
    assert "specee:spec_decode_num_drafts_total" in metrics
    assert llm.generate(QUESTION, SamplingParams(max_tokens=MAX_TOKENS), chat=True)[0].text == full_depth_text


def random_bank(llm: LLM, draft: str, path) -> str:
    """Random predictors with threshold 0.5 on layers 1-19 (about half of their checks fire; a firing
    check exits where the layer's argmax is among the draft's top 4) for this target + drafter."""
    from specee.exit.bank import PredictorBank

    L, k, hidden = llm.model.cfg.num_layers, 4, 8
    g = torch.Generator().manual_seed(3)
    thresholds = [0.5 if 1 <= i < 20 else float("inf") for i in range(L)]
    w1, w2 = torch.randn(L, 3 * k, hidden, generator=g), torch.randn(L, hidden, generator=g)
    PredictorBank(w1, torch.zeros(L, hidden), w2, torch.zeros(L), thresholds, list(range(1, 20)), k, llm.fingerprint,
                  llm.make_drafter(draft, k).fingerprint).save(path)
    return str(path)


@pytest.mark.parametrize("mode, verify", [("lossy", False), ("lossless", False), ("lossy", True)],
                         ids=["lossy", "lossless", "exits_in_verification"])
def test_early_exit_served_equals_generate(mode, verify, tmp_path, full_depth_text):
    """check_cost=0 checks every scheduled layer, so no request's exits depend on earlier traffic (the
    payoff gate learns from it) and the three answers are the same request's."""
    target, draft = real_model_dir("ref-target-24L"), str(real_model_dir("ref-draft-4L"))
    llm = LLM(target, dtype="float32")
    config = EarlyExitConfig(draft=draft, bank=random_bank(llm, draft, tmp_path / "bank"), mode=mode, check_cost=0)
    speculative = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3} if verify else None
    llm.enable_early_exit(config, speculative)
    stats, metrics = served_equals_generate(llm)
    assert stats["early_exit"]["exits_accepted"] > 0 and stats["early_exit"]["mode"] == mode  # exits were taken
    assert ("speculative" in stats) == verify
    if mode == "lossless":
        assert llm.generate(QUESTION, SamplingParams(max_tokens=MAX_TOKENS), chat=True)[0].text == full_depth_text
    assert "specee:early_exit_layer_count" in metrics
