"""Calibration on a tiny real model (stories260K as the target, the n-gram drafter), checked
against an independent recomputation, plus the calibration-prompt loader."""
import json
import math
from pathlib import Path

import pytest
import torch

from specee.drafters import NGramDrafter
from specee.exit import BankMismatchError, PredictorBank, calibrate, format_summary, load_calibration_prompts
from specee.exit.calibrate import ChatPrompt, _encode
from specee.model.llama import Transformer
from specee.model.weights import fingerprint_weights
from specee.tokenizer import Tokenizer

SHARED = Path(__file__).resolve().parents[2] / "shared"
STORIES = SHARED / "models" / "stories260K"
CALIB = SHARED / "data" / "calibration"
needs_shared = pytest.mark.skipif(not (STORIES.exists() and CALIB.exists()),
                                  reason=f"shared models/data not found under {SHARED} (../shared is absent)")

NAMES = ["Lily", "Tom", "Ben", "Sue", "Max", "Anna", "Tim", "Mia", "Sam", "Lucy", "Jack", "Zoe"]
PROMPTS = [f"{n} had {t}." for n in NAMES for t in ("a ball", "a cat")]
MAX_NEW = 40

# tiny models: one torch thread (see conftest.single_thread; two stall each other on a busy 2-core box)
pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def stories():
    return Transformer.load(STORIES, "cpu", torch.float32), Tokenizer(STORIES)


@pytest.fixture(scope="module")
def split_bank(stories):
    model, tok = stories
    return calibrate(model, tok, NGramDrafter(4, model.cfg.vocab_size), PROMPTS, max_new_tokens=MAX_NEW,
                     batch_size=12, folds=1, heldout_fraction=0.3, min_exits=5, train_steps=200,
                     target_dir=STORIES, progress=False)


# ---- an independent reference: plain forwards, full logit lens, the drafter stepped by hand ----
def causal_hidden_states(model, ids: list[int]) -> list[torch.Tensor]:
    S = len(ids)
    cache = model.new_cache(1, S)
    slots = torch.arange(S)
    step = model.step_inputs(slots[None, :], slots, (slots[None, :] <= slots[:, None]).view(1, 1, S, S), S)
    h = model.embed(torch.tensor([ids]))
    out = [h[0]]
    for i in range(model.cfg.num_layers):
        h = model.layer(i, h, step, cache)
        out.append(h[0])
    return out


@torch.inference_mode()
def reference_records(model, tok, prompts: list[str]):
    """Per held-out prompt: greedy continuation by full re-forwards (no KV reuse), then per layer
    the features (full lens restricted to the spec tokens), labels and in-spec flags."""
    L = model.cfg.num_layers
    feats, correct, in_spec = [[] for _ in range(L)], [[] for _ in range(L)], [[] for _ in range(L)]
    for text in prompts:
        ids = tok.encode(text)
        start = len(ids)
        for _ in range(MAX_NEW):
            nxt = int(model.logits(causal_hidden_states(model, ids)[-1][-1:]).argmax())
            ids.append(nxt)
            if nxt in model.cfg.eos_token_ids or nxt == tok.eos_token_id:
                break
        drafter = NGramDrafter(4, model.cfg.vocab_size)
        drafter.reset(ids[: start + 1])
        hs = causal_hidden_states(model, ids[:-1])
        for p in range(start + 1, len(ids)):  # predicts ids[p] from input position p - 1
            spec = drafter.propose()
            drafter.advance(ids[p])
            lens = [model.logits(hs[l + 1][p - 1]) for l in range(L)]
            lens_prev = [model.logits(hs[0][p - 1])] + lens[:-1]
            final = int(lens[-1].argmax())
            for l in range(L):
                lg = lens[l][spec]
                pr = torch.softmax(lg, -1)
                feats[l].append(torch.cat([lg, pr, pr - torch.softmax(lens_prev[l][spec], -1)]))
                top = int(lens[l].argmax())
                correct[l].append(top == final)
                in_spec[l].append(top in spec.tolist())
    return (torch.stack([torch.stack(f) for f in feats]), torch.tensor(correct), torch.tensor(in_spec))


@needs_shared
def test_calibrated_predictors_beat_always_positive(stories, split_bank):
    model, tok = stories
    bank, s = split_bank, split_bank.summary
    L = model.cfg.num_layers
    # from the summary
    assert s["heldout_kind"] == "held-out" and s["heldout_prompts"]
    assert s["heldout_precision@0.5"] > s["heldout_base_rate"] + 0.2
    # independently: regenerate the held-out prompts' continuations and recompute everything
    held = [PROMPTS[i] for i in s["heldout_prompts"]]
    X, correct, in_spec = reference_records(model, tok, held)
    assert X.shape[1] == s["heldout_positions"]
    probs = torch.stack([bank.prob(l, X[l]) for l in range(L)])
    inner = slice(0, L - 1)  # the last layer's label is trivially true
    predicted = probs[inner] > 0.5
    precision = correct[inner][predicted].float().mean().item()
    base = correct[inner].float().mean().item()
    assert precision > base + 0.2, (precision, base)
    assert precision == pytest.approx(s["heldout_precision@0.5"], abs=0.02)
    assert base == pytest.approx(s["heldout_base_rate"], abs=1e-6)
    # per layer too, wherever the predictor says yes at all
    for l in range(L - 1):
        if predicted[l].any() and 0 < correct[l].float().mean() < 1:
            assert correct[l][predicted[l]].float().mean() >= correct[l].float().mean()
    # the thresholds mean what the summary says: simulate the first-firing exit
    exit_wrong, exits = 0, 0
    done = torch.zeros(X.shape[1], dtype=torch.bool)
    for l in bank.enabled_layers:
        fire = (probs[l] > bank.thresholds[l]) & in_spec[l] & ~done
        exits += int(fire.sum())
        exit_wrong += int((fire & ~correct[l]).sum())
        done |= fire
    assert exits > 0
    assert 1 - exit_wrong / X.shape[1] == pytest.approx(s["expected_agreement"], abs=0.01)


@needs_shared
def test_bank_contract_and_round_trip(stories, split_bank, tmp_path):
    model, _ = stories
    bank = split_bank
    L = model.cfg.num_layers
    assert bank.num_layers == L and bank.k == 4 and len(bank.thresholds) == L
    assert math.isinf(bank.thresholds[-1])  # the last layer never "exits"
    assert set(bank.offline_layers) <= set(bank.enabled_layers)
    assert sorted(bank.ranked_layers) == bank.enabled_layers  # every enabled layer, most useful first
    assert bank.offline_layers == sorted(bank.ranked_layers[: len(bank.offline_layers)])
    assert bank.target_fingerprint == fingerprint_weights(STORIES) and bank.drafter_fingerprint == "ngram-n3"
    s = bank.summary
    assert len(s["per_layer"]) == L and sum(s["exit_distribution"]) == s["heldout_positions"]
    assert 1 <= s["mean_exit_layer"] <= L and 0 <= s["expected_agreement"] <= 1
    table = format_summary(bank)
    assert "layer" in table and "agreement" in table
    path = bank.save(tmp_path / "bank")
    again = PredictorBank.load(path, expect_target=fingerprint_weights(STORIES), expect_drafter="ngram-n3",
                               num_layers=L, k=4)
    x = torch.randn(3, 12)
    assert torch.equal(again.prob(1, x), bank.prob(1, x)) and again.thresholds == bank.thresholds
    assert again.ranked_layers == bank.ranked_layers


@needs_shared
def test_cross_fitted_calibration_and_agreement_mode(stories):
    model, tok = stories
    drafter = NGramDrafter(4, model.cfg.vocab_size)
    bank = calibrate(model, tok, drafter, PROMPTS, max_new_tokens=MAX_NEW, batch_size=24, min_exits=5,
                     train_steps=150, target_dir=STORIES, progress=False)  # folds=4 (default)
    s = bank.summary
    assert s["heldout_kind"] == "out-of-fold" and s["heldout_positions"] == s["positions"]
    assert s["cross_validated"] is not None and 0 <= s["cross_validated"]["expected_agreement"] <= 1
    assert s["heldout_precision@0.5"] > s["heldout_base_rate"]
    bank2 = calibrate(model, tok, drafter, PROMPTS, max_new_tokens=24, batch_size=12, min_exits=5,
                      train_steps=100, target_dir=STORIES, progress=False, target_agreement=0.99, max_prompts=12)
    assert bank2.summary["target_agreement"] == 0.99 and bank2.summary["prompts"] == 12
    assert bank2.summary["expected_agreement"] >= 0.99


@needs_shared
def test_calibrate_argument_errors(stories):
    model, tok = stories
    drafter = NGramDrafter(4, model.cfg.vocab_size)
    with pytest.raises(ValueError, match="k=8"):
        calibrate(model, tok, drafter, PROMPTS, k=8, target_dir=STORIES, progress=False)
    with pytest.raises(ValueError, match="no calibration prompts"):
        calibrate(model, tok, drafter, [], target_dir=STORIES, progress=False)
    with pytest.raises(ValueError, match="does not score a vocabulary"):
        calibrate(model, tok, drafter, PROMPTS, target_dir=STORIES, progress=False, draft_vocab=100)
    with pytest.raises(ValueError, match="draft_vocab must be >= 0"):
        calibrate(model, tok, drafter, PROMPTS, target_dir=STORIES, progress=False, draft_vocab=-1)


@needs_shared
def test_bank_without_a_named_target_is_refused_on_load(stories, tmp_path):
    model, tok = stories
    bank = calibrate(model, tok, NGramDrafter(4, model.cfg.vocab_size), PROMPTS, max_new_tokens=16,
                     max_prompts=8, min_exits=5, train_steps=20, progress=False)
    assert bank.target_fingerprint == "unknown"
    bank.save(tmp_path / "bank")
    with pytest.raises(BankMismatchError, match="target_dir"):
        PredictorBank.load(tmp_path / "bank", expect_target=fingerprint_weights(STORIES))


# ---- calibration prompts ----------------------------------------------------------------------
@needs_shared
def test_default_calibration_prompts_mix_both_files():
    prompts = load_calibration_prompts(limit=40)
    assert len(prompts) == 40
    chat = [p for p in prompts if isinstance(p, ChatPrompt)]
    raw = [p for p in prompts if not isinstance(p, ChatPrompt)]
    assert 25 <= len(chat) <= 35 and len(raw) >= 5  # 999 alpaca : 300 c4, interleaved
    alpaca = json.loads((CALIB / "alpaca_en_demo.json").read_text())
    assert chat[0] == alpaca[0]["instruction"].strip()
    assert all(len(p) <= 1500 for p in raw)
    assert len(load_calibration_prompts()) == 999 + 300


def test_prompt_files_and_errors(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps([{"instruction": "Translate", "input": "bonjour", "output": "x"},
                                                 {"instruction": "Count to 3", "input": "", "output": "1 2 3"}]))
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "word " * 1000}) + "\n\n" + json.dumps({"text": "hi"}) + "\n")
    prompts = load_calibration_prompts(tmp_path)
    assert prompts[0] == "Translate\n\nbonjour" and isinstance(prompts[0], ChatPrompt)
    raw = [p for p in prompts if not isinstance(p, ChatPrompt)]
    assert sorted(len(p) for p in raw)[0] == 2 and max(len(p) for p in raw) <= 1500
    assert load_calibration_prompts(tmp_path / "a.json", limit=1) == ["Translate\n\nbonjour"]
    with pytest.raises(FileNotFoundError, match="not found"):
        load_calibration_prompts(tmp_path / "missing")
    (tmp_path / "bad.jsonl").write_text("{oops\n")
    with pytest.raises(ValueError, match="bad.jsonl"):
        load_calibration_prompts(tmp_path / "bad.jsonl")


@needs_shared
def test_chat_prompts_use_the_template():
    tok = Tokenizer(SHARED / "models" / "ref-target-24L")
    ids = _encode(tok, ChatPrompt("Say hi"), chat=False, max_prompt_tokens=256)
    assert ids == tok.encode_chat([{"role": "user", "content": "Say hi"}])
    assert tok.decode(ids, skip_special_tokens=False).endswith("<|im_start|>assistant\n")
    assert _encode(tok, "Say hi", chat=False, max_prompt_tokens=256) == tok.encode("Say hi")
    long_chat = _encode(tok, ChatPrompt("word " * 500), chat=False, max_prompt_tokens=32)
    assert len(long_chat) == 32 and long_chat[-3:] == ids[-3:]  # the generation prompt survives
