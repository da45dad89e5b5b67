"""Calibration (specee/calibration/) on a tiny real model (stories260K as the target, the n-gram
drafter), checked against an independent recomputation; the drafter left as it was found (the
reference pair); the calibration-prompt loader."""
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from specee.calibration import ChatPrompt, calibrate, format_summary, load_calibration_prompts
from specee.calibration.exit_data import record_calibration
from specee.calibration.prompts import encode_prompt
from specee.drafters import DraftModelDrafter, NGramDrafter
from specee.exit import BankMismatchError, PredictorBank
from specee.model.llama import Transformer
from specee.model.weights import fingerprint_weights
from specee.tokenizer import Tokenizer

SHARED = Path(__file__).resolve().parents[2] / "shared"
STORIES = SHARED / "models" / "stories260K"
TARGET, DRAFT = SHARED / "models" / "ref-target-24L", SHARED / "models" / "ref-draft-4L"
CALIB = SHARED / "data" / "calibration"
needs_shared = pytest.mark.skipif(not (STORIES.exists() and CALIB.exists()),
                                  reason=f"shared models/data not found under {SHARED} (../shared is absent)")
needs_pair = pytest.mark.skipif(not (TARGET.exists() and DRAFT.exists() and CALIB.exists()),
                                reason=f"the reference pair or calibration data not found under {SHARED}")

NAMES = ["Lily", "Tom", "Ben", "Sue", "Max", "Anna", "Tim", "Mia", "Sam", "Lucy", "Jack", "Zoe"]
PROMPTS = [f"{n} had {t}." for n in NAMES for t in ("a ball", "a cat")]
MAX_NEW = 40

# tiny models: one torch thread (see conftest.single_thread; two stall each other on a busy 2-core box)
pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def stories():
    return Transformer.load(STORIES, "cpu", torch.float32), Tokenizer(STORIES)


@pytest.fixture(scope="module")
def bank(stories):
    model, tok = stories
    return calibrate(model, tok, NGramDrafter(4, model.cfg.vocab_size), PROMPTS, max_new_tokens=MAX_NEW,
                     batch_size=12, min_exits=5, train_steps=200, target_dir=STORIES, progress=False)


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
def test_recorded_data_matches_an_independent_recomputation(stories):
    """Steps (a)-(c): batched generation + layer-by-layer teacher forcing give the features,
    labels and in-spec flags of plain re-forwards with the full logit lens."""
    model, tok = stories
    prompts = PROMPTS[:6]
    rec = record_calibration(model, tok, NGramDrafter(4, model.cfg.vocab_size), prompts, max_new_tokens=MAX_NEW,
                             batch_size=4, progress=False)
    X, correct, in_spec = reference_records(model, tok, prompts)
    order = torch.argsort(rec["owner"], stable=True)  # batches run by length; the reference by prompt
    assert rec["feats"].shape == X.shape and rec["draft_vocab"] is None
    torch.testing.assert_close(rec["feats"][:, order], X, atol=1e-4, rtol=0)
    assert torch.equal(rec["correct"][:, order], correct) and torch.equal(rec["in_spec"][:, order], in_spec)
    assert torch.equal(rec["next"], rec["final"])  # teacher forcing reproduces the generated tokens


@needs_shared
def test_cross_fitted_predictors_and_thresholds(stories, bank):
    model, tok = stories
    s, L = bank.summary, model.cfg.num_layers
    assert s["folds"] == 4 and s["heldout_positions"] == s["positions"]  # every position scored out of fold
    assert s["heldout_precision@0.5"] > s["heldout_base_rate"] + 0.2
    assert s["cross_validated"] is not None and 0 <= s["cross_validated"]["expected_agreement"] <= 1
    # sequential thresholds: the exits a first-firing decode takes at each layer meet the target precision,
    # so the disagreement is at most exit_rate x (1 - target precision)
    assert bank.enabled_layers and s["exit_rate"] > 0
    for row in s["per_layer"]:
        if row["first_exits"]:
            assert row["layer"] in bank.enabled_layers and row["first_exit_precision"] >= s["target_precision"]
    assert 1 - s["expected_agreement"] <= s["exit_rate"] * (1 - s["target_precision"]) + 1e-9
    # the bank's own predictors (the final set, standardisation folded in) on independently computed features
    X, correct, _ = reference_records(model, tok, PROMPTS[:6])
    probs = torch.stack([bank.prob(l, X[l]) for l in range(L)])
    inner = slice(0, L - 1)  # the last layer's label is trivially true
    predicted = probs[inner] > 0.5
    assert correct[inner][predicted].float().mean() > correct[inner].float().mean() + 0.2


@needs_shared
def test_bank_contract_and_round_trip(stories, bank, tmp_path):
    model, _ = stories
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
    with pytest.raises(ValueError, match="folds must be >= 2"):
        calibrate(model, tok, drafter, PROMPTS, target_dir=STORIES, progress=False, folds=1)
    with pytest.raises(TypeError, match="Transformer"):  # an LLM passes its .model (and fingerprint, eos ids)
        calibrate(SimpleNamespace(model=model, model_dir=STORIES), tok, drafter, PROMPTS, progress=False)
    with pytest.raises(ValueError, match="at least 2 prompts"):
        calibrate(model, tok, drafter, PROMPTS[:1], max_new_tokens=8, target_dir=STORIES, progress=False)


@needs_shared
def test_bank_without_a_named_target_is_refused_on_load(stories, tmp_path):
    model, tok = stories
    bank = calibrate(model, tok, NGramDrafter(4, model.cfg.vocab_size), PROMPTS, max_new_tokens=16,
                     max_prompts=8, min_exits=5, train_steps=20, progress=False)
    assert bank.target_fingerprint == "unknown" and bank.summary["prompts"] == 8  # max_prompts
    bank.save(tmp_path / "bank")
    with pytest.raises(BankMismatchError, match="target_dir"):
        PredictorBank.load(tmp_path / "bank", expect_target=fingerprint_weights(STORIES))


@needs_pair
def test_calibration_leaves_the_drafter_as_it_found_it(monkeypatch):
    """The features are recorded under the FR-Spec shortlist, which the bank carries; the drafter's
    own shortlist (none, or another one) and so its proposals are restored afterwards, also on error."""
    tok = Tokenizer(TARGET)
    model = Transformer.load(TARGET, "cpu", torch.float32)
    drafter = DraftModelDrafter(DRAFT, tok, k=4, device="cpu", dtype=torch.float32)
    prompts = load_calibration_prompts(CALIB / "alpaca_en_demo.json", limit=6)
    probe = tok.encode("Once upon a time, the little cat")

    def proposals() -> list[list[int]]:
        drafter.reset(probe)
        out = []
        for _ in range(4):
            top = drafter.propose()
            out.append(top.tolist())
            drafter.advance(int(top[0]))
        return out

    for previous in (None, torch.arange(0, 8192, 3)):
        drafter.restrict_vocab(previous)
        before = proposals()
        bank = calibrate(model, tok, drafter, prompts, max_new_tokens=12, min_exits=1, train_steps=5,
                         target_dir=TARGET, progress=False)
        assert bank.draft_vocab is not None and bank.draft_vocab.numel() == 2048
        assert drafter.shortlist is None if previous is None else torch.equal(drafter.shortlist, previous)
        assert proposals() == before

    def broken(ids, start):
        assert drafter.shortlist is not None and drafter.shortlist.numel() == 2048  # recording under the shortlist
        raise RuntimeError("drafter failed")

    monkeypatch.setattr(drafter, "teacher_forced_top_k", broken)
    with pytest.raises(RuntimeError, match="drafter failed"):
        calibrate(model, tok, drafter, prompts, max_new_tokens=12, target_dir=TARGET, progress=False)
    assert torch.equal(drafter.shortlist, torch.arange(0, 8192, 3))


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
    ids = encode_prompt(tok, ChatPrompt("Say hi"), chat=False, max_prompt_tokens=256)
    assert ids == tok.encode_chat([{"role": "user", "content": "Say hi"}])
    assert tok.decode(ids, skip_special_tokens=False).endswith("<|im_start|>assistant\n")
    assert encode_prompt(tok, "Say hi", chat=False, max_prompt_tokens=256) == tok.encode("Say hi")
    long_chat = encode_prompt(tok, ChatPrompt("word " * 500), chat=False, max_prompt_tokens=32)
    assert len(long_chat) == 32 and long_chat[-3:] == ids[-3:]  # the generation prompt survives
