"""SpecEE's exit features: computed from the k speculative tokens only.

After decoder layer l, with h = layer l's output and h_prev = its input (layer l-1's
output, or the embeddings for layer 0):

    logits      = norm(h)      . rows      (k dot products: the spec tokens' LM-head rows)
    logits_prev = norm(h_prev) . rows
    features    = [logits, softmax(logits), softmax(logits) - softmax(logits_prev)]   # 3k

The delta is taken against layer l-1, not the previously *scheduled* layer, so calibration
(all layers) and inference (only scheduled layers) compute identical features whichever
layers a scheduler picks; h_prev is always at hand in the decode loop (it is layer l's
input). Both norms run in one call on a stacked [2, N, H] tensor.

Everything here runs in float32 whatever the model's dtype: the predictors are trained and
thresholded on these numbers, and in bfloat16 their rounding moves a probability past a
threshold (the cost is k dot products).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..model.kernels import loaded_cpu_kernels

FEATURE_LAYOUT = [
    "logits[0:k] = final_norm(h_l) . lm_head[spec]  (spec tokens in drafter order)",
    "probs[k:2k] = softmax(logits)",
    "delta[2k:3k] = softmax(logits) - softmax(final_norm(h_{l-1}) . lm_head[spec])  (h_{-1} = embeddings)",
]
FEATURE_LAYOUT_ID = "specee-v1:logits,softmax,softmax_delta_prev_layer"


def num_features(k: int) -> int:
    return 3 * k


def spec_rows(model, spec_ids: torch.Tensor) -> torch.Tensor:
    """LM-head rows of the speculative tokens in float32: [k, H] for spec_ids [k], [N, k, H] for
    [N, k]. Gather once per token; every checked layer reuses them. A quantized head gives its
    dequantized rows, so these logits are the ones its full product gives."""
    return model.head.rows(spec_ids).float()


def final_norm_f32(model, h: torch.Tensor) -> torch.Tensor:
    """The model's final norm computed in float32."""
    return F.rms_norm(h.float(), (model.cfg.hidden_size,), model.final_norm_f32, model.cfg.rms_norm_eps)


def spec_logits(model, h: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The spec tokens' logits under the final norm: h [N, H], rows [k, H] or [N, k, H] -> [N, k]."""
    x = final_norm_f32(model, h)
    if rows.dim() == 2:
        return x @ rows.T
    return torch.bmm(rows, x.unsqueeze(-1)).squeeze(-1)


def exit_features(model, h_prev: torch.Tensor, h: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """[N, 3k] features for hidden states h_prev, h [N, H]; rows [k, H] (shared) or [N, k, H]. On the
    CPU where the kernels are loaded, one call (model/kernels: `exit_features`) computes what
    `exit_features_torch` does in a dozen."""
    kernels = loaded_cpu_kernels() if h.device.type == "cpu" else None
    if kernels is None:
        return exit_features_torch(model, h_prev, h, rows)
    return kernels.exit_features(h_prev, h, model.final_norm_f32, model.cfg.rms_norm_eps, rows.contiguous())


def exit_features_torch(model, h_prev: torch.Tensor, h: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """exit_features in torch calls, on any device."""
    x = final_norm_f32(model, torch.stack([h_prev, h]))  # [2, N, H]: one norm call for both
    if rows.dim() == 2:
        logits = x @ rows.T  # [2, N, k]
    else:  # N x k dot products: a broadcast multiply-add is 4x faster than a batched matmul this small
        logits = (x.unsqueeze(-2) * rows).sum(dim=-1)  # [2, N, k]
    probs = torch.softmax(logits, dim=-1)
    return torch.cat([logits[1], probs[1], probs[1] - probs[0]], dim=-1)
