"""PredictorBank: probabilities, save/load round trip, refusals, atomic saves."""
import json
import math

import pytest
import torch

from specee.exit import bank as bank_mod
from specee.exit.bank import BankFormatError, BankMismatchError, PredictorBank

L, K, HID = 6, 4, 8

# tiny models: one torch thread (see conftest.single_thread; two stall each other on a busy 2-core box)
pytestmark = pytest.mark.usefixtures("single_thread")


def make_bank(seed: int = 0) -> PredictorBank:
    g = torch.Generator().manual_seed(seed)
    return PredictorBank(
        torch.randn(L, 3 * K, HID, generator=g), torch.randn(L, HID, generator=g),
        torch.randn(L, HID, generator=g), torch.randn(L, generator=g),
        thresholds=[0.9, math.inf, 0.75, 0.8, 0.95, math.inf], offline_layers=[0, 3], k=K,
        target_fingerprint="tgt123", drafter_fingerprint="drf456",
        summary={"mean_exit_layer": 4.2, "per_layer": [{"layer": 0, "precision": float("nan")}]},
        target_name="tiny", drafter_name="ngram-n3")


def test_prob_is_the_two_layer_mlp():
    b = make_bank()
    x = torch.randn(5, 3 * K)
    for l in range(L):
        ref = torch.sigmoid(torch.relu(x @ b.w1[l] + b.b1[l]) @ b.w2[l] + b.b2[l])
        torch.testing.assert_close(b.prob(l, x), ref)
        assert b.prob(l, x).shape == (5,)
    assert b.enabled_layers == [0, 2, 3, 4]
    assert not b.fires(1, x).any()  # a disabled layer never fires


def test_save_load_round_trip(tmp_path):
    b = make_bank()
    out = b.save(tmp_path / "bank")
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "predictors.safetensors"]
    assert out.stat().st_mode & 0o777 == 0o755 and (out / "predictors.safetensors").stat().st_mode & 0o777 == 0o644
    m = json.loads((out / "manifest.json").read_text())
    assert m["thresholds"][1] is None and m["k"] == K and m["num_layers"] == L and m["hidden"] == HID
    assert m["summary"]["per_layer"][0]["precision"] is None  # NaN stored as strict JSON
    c = PredictorBank.load(out, expect_target="tgt123", expect_drafter="drf456", num_layers=L, k=K)
    x = torch.randn(7, 3 * K)
    for l in range(L):
        assert torch.equal(b.prob(l, x), c.prob(l, x))
    assert c.thresholds == b.thresholds and c.offline_layers == [0, 3]
    assert c.ranked_layers == b.ranked_layers == [0, 3, 2, 4]  # default: offline first, then enabled
    assert (c.k, c.hidden, c.num_layers) == (K, HID, L)
    assert (c.target_fingerprint, c.drafter_fingerprint) == ("tgt123", "drf456")
    assert c.summary["mean_exit_layer"] == 4.2
    # saving over an existing bank replaces it
    make_bank(seed=1).save(out)
    d = PredictorBank.load(out)
    assert not torch.equal(d.w1, c.w1)
    assert [p.name for p in tmp_path.iterdir()] == ["bank"]  # no temp or backup dirs left


def test_to_dtype_keeps_probabilities():
    b = make_bank()
    x = torch.randn(3, 3 * K)
    ref = b.prob(2, x)
    b.to(dtype=torch.float64)
    torch.testing.assert_close(b.prob(2, x.double()).float(), ref)


@pytest.mark.parametrize("kwargs, words", [
    ({"expect_target": "other"}, ["target", "tgt123", "other"]),
    ({"expect_drafter": "other"}, ["drafter", "drf456", "other"]),
    ({"num_layers": 24}, ["6-layer", "24 layers"]),
    ({"k": 8}, ["k=4", "k=8"]),
])
def test_mismatches_refused(tmp_path, kwargs, words):
    make_bank().save(tmp_path / "bank")
    with pytest.raises(BankMismatchError) as e:
        PredictorBank.load(tmp_path / "bank", **kwargs)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_missing_and_corrupt_banks(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        PredictorBank.load(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(BankFormatError, match="missing"):
        PredictorBank.load(tmp_path / "empty")
    path = make_bank().save(tmp_path / "bank")
    (path / "manifest.json").write_text("{not json")
    with pytest.raises(BankFormatError, match="corrupt manifest"):
        PredictorBank.load(path)
    path = make_bank().save(tmp_path / "bank2")
    (path / "predictors.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(BankFormatError, match="corrupt weights"):
        PredictorBank.load(path)
    path = make_bank().save(tmp_path / "bank3")
    m = json.loads((path / "manifest.json").read_text())
    m["hidden"] = 99
    (path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(BankFormatError, match="do not match"):
        PredictorBank.load(path)


def test_failed_save_leaves_nothing_half_written(tmp_path, monkeypatch):
    import safetensors.torch

    def broken_save(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", broken_save)
    with pytest.raises(OSError, match="disk full"):
        make_bank().save(tmp_path / "new")
    assert list(tmp_path.iterdir()) == []  # no bank, no temp dir
    monkeypatch.undo()

    # a failure while replacing an existing bank keeps the old one intact
    old = make_bank(seed=3).save(tmp_path / "bank")
    before = {p.name: p.read_bytes() for p in old.iterdir()}

    def broken_manifest(self):
        raise RuntimeError("boom")

    monkeypatch.setattr(bank_mod.PredictorBank, "manifest", broken_manifest)
    with pytest.raises(RuntimeError, match="boom"):
        make_bank().save(old)
    assert {p.name: p.read_bytes() for p in old.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["bank"]


def test_save_refuses_a_foreign_directory(tmp_path):
    (tmp_path / "stuff").mkdir()
    (tmp_path / "stuff" / "model.safetensors").write_bytes(b"x")
    with pytest.raises(FileExistsError, match="not a predictor bank"):
        make_bank().save(tmp_path / "stuff")
    assert (tmp_path / "stuff" / "model.safetensors").exists()


def test_inconsistent_shapes_rejected():
    with pytest.raises(ValueError, match="features"):
        PredictorBank(torch.zeros(2, 5, 3), torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2),
                      [0.5, 0.5], [], 4, "t", "d")


def test_draft_vocab_shortlist_round_trips_and_is_checked(tmp_path):
    b = make_bank()
    assert b.manifest()["draft_vocab_size"] is None and PredictorBank.load(b.save(tmp_path / "plain")).draft_vocab is None
    b.draft_vocab = torch.tensor([3, 7, 8, 20, 31])
    path = b.save(tmp_path / "short")
    assert json.loads((path / "manifest.json").read_text())["draft_vocab_size"] == 5
    c = PredictorBank.load(path)
    assert torch.equal(c.draft_vocab, b.draft_vocab) and "draft_vocab=5" in repr(c)
    m = json.loads((path / "manifest.json").read_text())
    m["draft_vocab_size"] = 4  # the manifest and the weights file must agree
    (path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(BankFormatError, match="draft_vocab_size"):
        PredictorBank.load(path)
    for bad in (torch.tensor([1, 2, 3]), torch.tensor([4, 3, 5, 6]), torch.tensor([-1, 2, 3, 5])):
        with pytest.raises(ValueError, match="draft_vocab"):
            PredictorBank(b.w1, b.b1, b.w2, b.b2, b.thresholds, [0], K, "t", "d", draft_vocab=bad)
