"""The EAGLE draft head and its training (specee/drafters/eagle_head.py, specee/calibration/).

Everything runs on the real stories260K checkpoint (5 layers, hidden 64): recording, a few
dozen training steps, save/load. The head's batched forward is checked against one-row steps
(how it drafts), and the training-time-test unroll against the head drafting step by step."""
from __future__ import annotations

import json

import pytest
import torch

from specee.calibration import Recipe, train_draft
from specee.calibration.record import Record, record, training_sequences
from specee.calibration.train_draft import evaluate, make_batch, unrolled_outputs
from specee.drafters.eagle_head import WEIGHTS_FILE, EagleHead, EagleHeadConfig

pytestmark = pytest.mark.usefixtures("single_thread")
MODEL = "stories260K"
FAST = Recipe(max_steps=30, max_sequences=48, batch_tokens=1024, held_out_every=4, warmup_steps=5, lr=3e-3)


@pytest.fixture(scope="module")
def llm(real_llm):
    return real_llm(MODEL)


@pytest.fixture(scope="module")
def texts(llm):
    return training_sequences(llm.tokenizer, max_len=40)[0][:20]


@pytest.fixture(scope="module")
def trained(llm, tmp_path_factory):
    """A head trained for a few seconds on stories260K (shortlist 128 of 512 tokens)."""
    out = tmp_path_factory.mktemp("eagle") / "head"
    manifest = train_draft(llm, out, minutes=10, shortlist_size=128, recipe=FAST, progress=False)
    return out, manifest


def random_head(llm, layers=(4,), shortlist_size=128, seed=0) -> EagleHead:
    cfg = EagleHeadConfig.for_target(llm.model.cfg, layers, shortlist_size)
    shortlist = torch.randperm(llm.model.cfg.vocab_size, generator=torch.Generator().manual_seed(seed))
    return EagleHead.init_random(llm.model, cfg, shortlist[:shortlist_size].sort().values, seed, llm.fingerprint)


def test_recorder_reads_the_targets_hidden_states(llm, texts):
    model = llm.model
    lengths = (30, 17, 25, 9, 30)  # batched with padding
    seqs = [s[:n] for s, n in zip(texts, lengths)]
    layers = (0, 2, 3)
    shortlist = torch.arange(0, 512, 3)
    loss_from = [0, 5, 24, 3, 29]
    rec = record(model, seqs, layers, shortlist, top_k=4, batch_tokens=200, store_dtype=torch.float32, progress=False,
                 loss_from=loss_from)
    assert sorted(rec.sources.tolist()) == list(range(len(seqs)))
    for r, src in enumerate(rec.sources.tolist()):
        a, b = int(rec.starts[r]), int(rec.starts[r + 1])
        assert rec.trained[a:b].tolist() == [n >= loss_from[src] for n in range(lengths[src])]
        hs = model.hidden_states(seqs[src])  # [L + 1, S, H], index i + 1 = output of layer i
        torch.testing.assert_close(rec.features[a:b], torch.cat([hs[i + 1] for i in layers], -1), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(rec.last[a:b], hs[-1], atol=1e-5, rtol=1e-5)
        logits = model.logits(hs[-1])
        assert torch.equal(rec.argmax[a:b], logits.argmax(-1))
        assert rec.tokens[a:b].tolist() == seqs[src]
        expect = torch.softmax(logits, -1)[:, shortlist].topk(4).indices
        assert torch.equal(rec.top_cols[a:b], expect)


@pytest.mark.parametrize("layers", [(4,), (0, 2, 4)])
def test_forward_over_rows_equals_one_row_steps(llm, layers):
    model = llm.model
    head = random_head(llm, layers)
    ids = torch.randint(0, 512, (1, 13), generator=torch.Generator().manual_seed(1))
    hs = model.hidden_states(ids[0].tolist())
    feats = torch.cat([hs[i + 1] for i in layers], -1)[None, :-1]
    S = feats.shape[1]
    cache = head.new_cache(1, S + 4)
    batched = head.forward(feats, ids[:, 1:], model.range_inputs(1, S), cache)
    cache1 = head.new_cache(1, S + 4)
    steps = [head.forward(feats[:, j : j + 1], ids[:, j + 1 : j + 2], model.range_inputs(j + 1, 1), cache1)
             for j in range(S)]
    torch.testing.assert_close(batched, torch.cat(steps, 1), atol=1e-5, rtol=1e-5)
    # a fed-back step (width H) reads the same cache either way
    nxt = torch.tensor([[7]])
    a = head.forward(batched[:, -1:], nxt, model.range_inputs(S + 1, 1), cache)
    b = head.forward(steps[-1], nxt, model.range_inputs(S + 1, 1), cache1)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert head.logits(a).shape == (1, 1, 128)
    with pytest.raises(ValueError, match="width"):
        head.forward(feats[..., :-1], ids[:, 1:], model.range_inputs(1, S), head.new_cache(1, S + 1))


def test_training_unroll_equals_drafting_step_by_step(llm, texts):
    """Step 2 of the training-time test sees exactly what the head sees drafting its second token."""
    model = llm.model
    head = random_head(llm, (1, 3, 4), seed=3)
    seqs = [texts[0][:24], texts[1][:19]]
    rec = record(model, seqs, head.config.feature_layers, head.shortlist, store_dtype=torch.float32, progress=False)
    batch = make_batch(rec, [0, 1], rec.last_hidden(head.config.feature_layers, 5), model.device)
    h1, h2 = unrolled_outputs(head, batch, unroll=2)
    T = batch["tokens"].shape[1]
    for row in range(2):
        n = int(batch["valid"][row].sum())
        feats, toks = batch["features"][row : row + 1], batch["tokens"][row : row + 1]
        for p in (2, n // 2, n - 1):  # the second draft step lands at position p
            cache = head.new_cache(1, T + 1)
            first = head.forward(feats[:, : p - 1], toks[:, 1:p], model.range_inputs(1, p - 1), cache)
            second = head.forward(first[:, -1:], toks[:, p : p + 1], model.range_inputs(p, 1), cache)
            torch.testing.assert_close(first[0, -1], h1[row, p - 2], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(second[0, 0], h2[row, p - 2], atol=1e-5, rtol=1e-5)


def test_training_reduces_held_out_loss(llm, trained):
    out, manifest = trained
    rec = Record.load(out / "checkpoint" / "record.safetensors")
    held = [i for i, s in enumerate(rec.sources.tolist()) if s % FAST.held_out_every == 0]
    cfg = EagleHeadConfig.for_target(llm.model.cfg, None, 128)
    shortlist = torch.tensor(manifest["shortlist"])
    untrained = EagleHead.init_random(llm.model, cfg, shortlist, FAST.seed, llm.fingerprint)
    before = evaluate(untrained, rec, held, FAST, llm.model.cfg.num_layers)
    after = manifest["held_out"]
    assert manifest["steps"] == FAST.max_steps
    for step in ("step1", "step2"):
        assert after[step]["loss"] < before[step]["loss"] - 0.3, (before, after)
        assert after[step]["top4"] > before[step]["top4"]
    assert manifest["held_out_top1"] == [after["step1"]["top1"], after["step2"]["top1"]]
    on_disk = json.loads((out / "manifest.json").read_text())
    assert on_disk["target_fingerprint"] == llm.fingerprint and on_disk["feature_layers"] == [4]


def test_save_load_round_trip_and_refusals(llm, trained, tmp_path):
    out, manifest = trained
    head = EagleHead.load(out, llm.model, llm.fingerprint)
    assert head.shortlist.tolist() == manifest["shortlist"]
    copy = tmp_path / "copy"
    head.save(copy, {"note": "copy"})
    again = EagleHead.load(copy, llm.model, llm.fingerprint)
    model = llm.model
    ids = torch.randint(0, 512, (1, 9), generator=torch.Generator().manual_seed(2))
    feats = model.hidden_states(ids[0].tolist())[-1][None, :-1]
    outs = [h.forward(feats, ids[:, 1:], model.range_inputs(1, 8), h.new_cache(1, 9)) for h in (head, again)]
    assert torch.equal(outs[0], outs[1]) and torch.equal(head.logits(outs[0]), again.logits(outs[1]))

    with pytest.raises(ValueError, match=rf"{manifest['target_fingerprint']}.*not for this target \('0123abcd'\)"):
        EagleHead.load(copy, model, "0123abcd")
    weights = copy / WEIGHTS_FILE
    weights.write_bytes(weights.read_bytes()[:-100])  # truncated
    with pytest.raises(ValueError, match="corrupt or truncated"):
        EagleHead.load(copy, model, llm.fingerprint)
    (copy / "manifest.json").write_text("{not json")
    with pytest.raises(ValueError, match="corrupt manifest"):
        EagleHead.load(copy, model, llm.fingerprint)
    with pytest.raises(ValueError, match="not an EAGLE head directory"):
        EagleHead.load(tmp_path / "nothing", model, llm.fingerprint)


def test_resume_continues_the_checkpoint(llm, trained, tmp_path):
    out, manifest = trained
    with pytest.raises(FileExistsError, match="--resume"):
        train_draft(llm, out, minutes=1, recipe=FAST, progress=False)
    with pytest.raises(FileNotFoundError, match="nothing to resume"):
        train_draft(llm, tmp_path / "fresh", minutes=1, resume=True, progress=False)
    # resuming takes the recipe from the checkpoint; max_steps there is reached already, so it only re-evaluates
    again = train_draft(llm, out, minutes=1, resume=True, progress=False)
    assert again["steps"] == manifest["steps"] and again["steps_this_run"] == 0
    assert again["held_out"] == manifest["held_out"]


def test_cli_train_draft_rejects_bad_arguments(tmp_path, capsys):
    from specee.cli import main

    for minutes in ("0", "nan", "inf"):
        assert main(["train-draft", "--model", str(tmp_path), "-o", str(tmp_path / "h"), "--minutes", minutes]) == 2
        assert "--minutes: expected a finite number > 0" in capsys.readouterr().err
    assert main(["train-draft", "-o", str(tmp_path / "h"), "--feature-layers", "a,b"]) == 2
    assert "layer indices" in capsys.readouterr().err


def test_resumed_training_continues_the_learning_rate_schedule(llm, texts, tmp_path):
    """After 1000 s of earlier training, a resumed minute sits at the end of the cosine decay, not
    back at the peak learning rate."""
    import time

    from specee.calibration.train_draft import _optimizer, _train_steps

    head = random_head(llm, (4,), seed=1)
    for p in head.params.values():
        p.requires_grad_(True)
    seqs = [t[:30] for t in texts[:4]]
    rec = record(llm.model, seqs, head.config.feature_layers, head.shortlist, store_dtype=torch.float32,
                 progress=False)
    recipe = Recipe(max_steps=101, batch_tokens=256, warmup_steps=1, lr=1e-3)
    lrs = {}
    for before in (0.0, 1000.0):
        optimizer = _optimizer(head, recipe)
        done = {"steps": 100, "train_seconds": before, "tokens": 0}
        _train_steps(head, optimizer, rec, rec.last_hidden((4,), 5), [0, 1, 2, 3], recipe, done,
                     time.monotonic() + 60, tmp_path / f"ckpt{before}", progress=False)
        lrs[before] = optimizer.param_groups[0]["lr"]
    assert lrs[0.0] > 0.9 * recipe.lr and lrs[1000.0] < 0.12 * recipe.lr


@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_a_quantized_head_matches_its_dequantized_float_twin(mode):
    """On a quantized target the head runs its matrices quantized, through the target's C++ decode
    layer: its outputs over prompt rows and fed-back draft steps match a float head holding the
    dequantized weights, within the kernels' bfloat16 activation rounding."""
    from conftest import real_model_dir

    from specee import LLM

    model = LLM(real_model_dir("ref-target-24L"), dtype="float32", quantization=mode).model
    cfg = EagleHeadConfig.for_target(model.cfg, (3, 12, 23), 256)
    shortlist = torch.arange(0, model.cfg.vocab_size, model.cfg.vocab_size // 256)[:256]
    quantized = EagleHead(model, cfg, shortlist, EagleHead.init_random(model, cfg, shortlist, seed=2).params,
                          quantization=mode)
    assert quantized.runtime.fast_layers is not None or model.fast_layers is None  # the C++ layer where it builds
    w = quantized.runtime.layers[0]
    dequantized = {"fc": quantized._fc.dequantize(), "fuse": quantized._fuse.dequantize(),
                   "attn_norm": w.attn_norm, "mlp_norm": w.mlp_norm,
                   **{f: getattr(w, f).dequantize() for f in ("qkv", "o", "gate_up", "down")}}
    twin = EagleHead(model, cfg, shortlist, dequantized)
    assert twin.runtime.fast_layers is None
    ids = torch.randint(0, model.cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(4))
    hs = model.hidden_states(ids[0].tolist())
    feats = torch.cat([hs[i + 1] for i in cfg.feature_layers], -1)[None, :-1]
    S = feats.shape[1]
    outs = []
    for head in (quantized, twin):
        cache = head.new_cache(1, S + 3)
        rows = head.forward(feats, ids[:, 1:], model.range_inputs(1, S), cache)
        step = head.forward(rows[:, -1:], torch.tensor([[5]]), model.range_inputs(S + 1, 1), cache)
        outs.append((rows, step, head.logits(step)))
    for got, want in zip(outs[0], outs[1]):
        torch.testing.assert_close(got, want, rtol=0, atol=0.03 * float(want.abs().max()))
    # the quantized head really is quantized: its output is not the float head's bit for bit
    assert not torch.equal(outs[0][0], outs[1][0])
