"""Exit features equal a plain logit-lens computation restricted to the speculative tokens."""
from pathlib import Path

import pytest
import torch

from specee.exit.features import FEATURE_LAYOUT, exit_features, exit_features_torch, num_features, spec_logits, spec_rows
from specee.model.kernels import cpu_kernels
from specee.model.llama import Transformer

SHARED = Path(__file__).resolve().parents[2] / "shared"
MODELS = SHARED / "models"
pytestmark = [
    pytest.mark.usefixtures("single_thread"),  # tiny models: see conftest.single_thread
    pytest.mark.skipif(not MODELS.exists(), reason=f"shared models not found under {MODELS} (../shared is absent)"),
]


@pytest.fixture(scope="module", params=["stories260K", "ref-draft-4L"])  # untied head / tied embeddings
def model(request):
    return Transformer.load(MODELS / request.param, "cpu", torch.float32)


def all_hidden_states(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """[embeddings, layer 0 output, ..., layer L-1 output], each [S, H], one causal forward."""
    S = ids.shape[1]
    cache = model.new_cache(1, S)
    slots = torch.arange(S)
    mask = (slots[None, :] <= slots[:, None]).view(1, 1, S, S)
    step = model.step_inputs(slots[None, :], slots, mask, S)
    h = model.embed(ids)
    out = [h[0]]
    for i in range(model.cfg.num_layers):
        h = model.layer(i, h, step, cache)
        out.append(h[0])
    return out


def reference_features(model, h_prev, h, spec):
    """Full logit lens at both layers (final norm + the whole LM head), then the spec columns."""
    full = model.logits(h)  # [N, V]
    full_prev = model.logits(h_prev)
    logits = full.gather(1, spec)
    p = torch.softmax(logits, -1)
    p_prev = torch.softmax(full_prev.gather(1, spec), -1)
    return torch.cat([logits, p, p - p_prev], -1)


@pytest.fixture(params=["one kernel call", "torch calls"])
def features(request):
    """exit_features as the decode loop runs it on the CPU (the kernels' one call), and its torch form."""
    if request.param == "torch calls":
        return exit_features_torch
    if cpu_kernels() is None:
        pytest.skip("the CPU kernels are not built here (no C++ compiler or ninja)")
    return exit_features


@torch.inference_mode()
def test_features_equal_logit_lens_at_every_layer(model, features):
    torch.manual_seed(0)
    V, k = model.cfg.vocab_size, 4
    ids = torch.randint(3, V, (1, 12))
    hs = all_hidden_states(model, ids)
    N = ids.shape[1]
    spec_per_row = torch.stack([torch.randperm(V)[:k] for _ in range(N)])  # [N, k]
    shared_spec = torch.randperm(V)[:k]  # [k]: one token's spec tokens, as in decode
    rows_n = spec_rows(model, spec_per_row)
    rows_1 = spec_rows(model, shared_spec)
    assert rows_n.shape == (N, k, model.cfg.hidden_size) and rows_1.shape == (k, model.cfg.hidden_size)
    for l in range(model.cfg.num_layers):
        got = features(model, hs[l], hs[l + 1], rows_n)
        assert got.shape == (N, num_features(k))
        torch.testing.assert_close(got, reference_features(model, hs[l], hs[l + 1], spec_per_row), atol=1e-5, rtol=1e-5)
        got1 = features(model, hs[l], hs[l + 1], rows_1)
        torch.testing.assert_close(got1, reference_features(model, hs[l], hs[l + 1], shared_spec.expand(N, k)),
                                   atol=1e-5, rtol=1e-5)
        # single-row decode shape
        one = features(model, hs[l][-1:], hs[l + 1][-1:], rows_1)
        torch.testing.assert_close(one, got1[-1:], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(spec_logits(model, hs[l + 1], rows_n), got[:, :k], atol=1e-5, rtol=1e-5)


def test_feature_layout_is_described():
    assert len(FEATURE_LAYOUT) == 3 and "softmax" in " ".join(FEATURE_LAYOUT)
    assert num_features(4) == 12
