"""Fitting a predictor bank to recorded calibration data: steps (d)-(g) of `exit_bank`'s
procedure (cross-fitted predictors, sequential thresholds, the offline layer set, the summary)."""
from __future__ import annotations

import math
import time
from typing import Any

import torch

from ..exit.bank import PredictorBank
from ..progress import progress_bar
from .predictors import mlp_probs, train_predictors

DEFAULT_TARGET_PRECISION = 0.97


def check_fit_args(target_precision: float, folds: int) -> None:
    """Refuse bad fit settings before minutes of recording are spent."""
    if not 0.0 < target_precision <= 1.0:
        raise ValueError(f"target_precision must be in (0, 1], got {target_precision}")
    if folds < 2:
        raise ValueError(f"folds must be >= 2 (every position is scored by predictors that never saw its "
                         f"prompt), got {folds}")


# ---- (e) thresholds ----------------------------------------------------------------------------
def _choose_threshold(p: torch.Tensor, ok: torch.Tensor, c: torch.Tensor, target: float,
                      min_exits: int) -> float:
    """Lowest threshold whose taken exits (p > thr and ok) have precision >= target, with at
    least `min_exits` of them; inf if none."""
    p, c = p[ok], c[ok].float()
    if p.numel() < min_exits:
        return math.inf
    order = torch.argsort(p, descending=True)
    ps, cs = p[order], c[order]
    n = torch.arange(1, len(cs) + 1)
    precision = cs.cumsum(0) / n
    nxt = torch.cat([ps[1:], ps.new_tensor([-1.0])])
    m_ok = (precision >= target) & (ps > nxt) & (n >= min_exits)  # cut only between distinct scores
    if not m_ok.any():
        return math.inf
    m = int(torch.nonzero(m_ok).max())  # the last taken sample
    return (float(ps[m]) + max(float(nxt[m]), 0.0)) / 2


def _sequential_thresholds(p: torch.Tensor, ok: torch.Tensor, c: torch.Tensor, target: float,
                           min_exits: int) -> list[float]:
    """Thresholds layer by layer, each chosen on the positions no earlier layer took: the
    precision target then holds for the exits a first-firing decode actually takes (the
    later layers see only the harder leftovers), so overall agreement follows from it.
    (Chosen per layer on all positions instead, first-firing decoding errs far more often
    than 1 - precision: the easy tokens that make a layer precise have exited earlier.)"""
    L = p.shape[0]
    remaining = torch.ones(p.shape[1], dtype=torch.bool)
    out = []
    for l in range(L):
        thr = math.inf
        if l < L - 1:
            thr = _choose_threshold(p[l][remaining], ok[l][remaining], c[l][remaining], target, min_exits)
        out.append(thr)
        if math.isfinite(thr):
            remaining &= ~((p[l] > thr) & ok[l])
    return out


def _fires(p: torch.Tensor, ok: torch.Tensor, thresholds: list[float]) -> torch.Tensor:
    return (p > torch.tensor(thresholds, dtype=p.dtype).unsqueeze(1)) & ok


def _enabled(thresholds: list[float]) -> list[int]:
    return [l for l, t in enumerate(thresholds) if math.isfinite(t)]


def _simulate(fire: torch.Tensor, correct: torch.Tensor, layers: list[int]) -> dict[str, Any]:
    """Sequential first-firing exit over `layers`. fire/correct [L, N] (fire includes in_spec)."""
    L, N = fire.shape
    exit_at = torch.full((N,), L - 1, dtype=torch.long)
    exited = torch.zeros(N, dtype=torch.bool)
    ok = torch.ones(N, dtype=torch.bool)
    for l in sorted(layers):
        if l >= L - 1:
            continue
        new = fire[l] & ~exited
        exit_at[new] = l
        ok[new] = correct[l][new]
        exited |= new
    wrong = int((~ok).sum())
    return {"exit_counts": torch.bincount(exit_at, minlength=L).tolist(),
            "wrong_counts": torch.bincount(exit_at[~ok], minlength=L).tolist(),
            "exits": int(exited.sum()), "wrong": wrong, "n": N,
            "exit_rate": float(exited.float().mean()) if N else 0.0,
            "mean_layers": float((exit_at.float() + 1).mean()) if N else float(L),
            "agreement": 1.0 - wrong / N if N else 1.0,
            "saved_correct": float(((L - 1 - exit_at) * ok).sum())}


# ---- (f) offline layers -----------------------------------------------------------------------
def _rank_layers(fire: torch.Tensor, correct: torch.Tensor, candidates: list[int],
                 limit: int | None = None) -> tuple[list[int], int]:
    """Greedy set selection over `candidates`: repeatedly add the layer that most increases
    the layers saved by correct first-firing exits. Returns the order (up to `limit`
    layers; layers that add nothing come last, by what they save on their own) and how
    many layers at the front of it added something."""
    chosen: list[int] = []
    best = _simulate(fire, correct, chosen)["saved_correct"]
    useful = 0
    limit = len(candidates) if limit is None else min(limit, len(candidates))
    while len(chosen) < limit:
        gains = [(_simulate(fire, correct, chosen + [l])["saved_correct"], -l, l)
                 for l in candidates if l not in chosen]
        score, _, layer = max(gains)
        if score <= best:
            break
        chosen.append(layer)
        best = score
        useful += 1
    if len(chosen) < limit:
        rest = [l for l in candidates if l not in chosen]
        alone = {l: _simulate(fire, correct, [l])["saved_correct"] for l in rest}
        chosen += sorted(rest, key=lambda l: (-alone[l], l))[: limit - len(chosen)]
    return chosen, useful


def _choose_offline(fire: torch.Tensor, correct: torch.Tensor, size: int, candidates: list[int]) -> list[int]:
    """The first `size` layers of the greedy ranking (only those that add exits)."""
    ranked, useful = _rank_layers(fire, correct, candidates, limit=size)
    return sorted(ranked[:useful])


# ---- (g) the cross-validated estimate ------------------------------------------------------------
def _cross_validate(p: torch.Tensor, ok: torch.Tensor, c: torch.Tensor, fold: torch.Tensor, folds: int,
                    target: float, min_exits: int, offline_size: int) -> dict[str, Any]:
    """Thresholds and offline layers chosen on the other folds, simulated on each fold."""
    n = exits = wrong = exits_off = wrong_off = 0
    layers = layers_off = 0.0
    for f in range(folds):
        a, b = fold != f, fold == f
        thr = _sequential_thresholds(p[:, a], ok[:, a], c[:, a], target, min_exits)
        off = _choose_offline(_fires(p[:, a], ok[:, a], thr), c[:, a], offline_size, _enabled(thr))
        fire_b = _fires(p[:, b], ok[:, b], thr)
        s_all = _simulate(fire_b, c[:, b], _enabled(thr))
        s_off = _simulate(fire_b, c[:, b], off)
        n += s_all["n"]
        exits += s_all["exits"]
        wrong += s_all["wrong"]
        layers += s_all["mean_layers"] * s_all["n"]
        exits_off += s_off["exits"]
        wrong_off += s_off["wrong"]
        layers_off += s_off["mean_layers"] * s_off["n"]
    n = max(n, 1)
    return {"expected_agreement": 1 - wrong / n, "exit_rate": exits / n, "mean_exit_layer": layers / n,
            "offline_only": {"expected_agreement": 1 - wrong_off / n, "exit_rate": exits_off / n,
                             "mean_exit_layer": layers_off / n}}


# ---- steps (d)-(g) -------------------------------------------------------------------------------
def fit_bank(rec: dict[str, Any], *, k: int, target_fingerprint: str, drafter_fingerprint: str,
             target_name: str = "", drafter_name: str = "", target_precision: float = DEFAULT_TARGET_PRECISION,
             offline_size: int | None = None, hidden: int = 16, seed: int = 0, progress: bool = True,
             folds: int = 4, train_steps: int = 300, lr: float = 1e-2, minibatch: int = 1024,
             min_exits: int = 20) -> PredictorBank:
    """Steps (d)-(g) on recorded calibration data (`record_calibration`'s output): train the
    predictors, choose thresholds and offline layers, and build the bank with its summary.

    Summary keys (all on out-of-fold data): per_layer [{layer, threshold, samples, positives,
    base_rate (= the always-positive classifier's precision), precision_at_0.5, in_spec_rate,
    taken, precision, recall, first_exits, first_exit_precision}], exit_distribution
    (first-firing exits per layer over all enabled layers; the last entry counts full-depth
    tokens), exit_rate, mean_exit_layer (mean number of layers run, 1..L), expected_agreement
    (fraction of tokens equal to full-depth greedy), offline_only {the same with only the
    offline layers checked}, cross_validated {the same with thresholds chosen on the other
    folds}, heldout_precision@0.5 / heldout_base_rate (pooled over layers 0..L-2),
    drafter_hit_rate, oracle_mean_exit_layer, ranked_layers, seconds."""
    t_fit = time.perf_counter()
    check_fit_args(target_precision, folds)
    X, correct, in_spec, owner = rec["feats"], rec["correct"], rec["in_spec"], rec["owner"]
    L, N = correct.shape
    if X.shape[-1] != 3 * k:
        raise ValueError(f"recorded features have {X.shape[-1]} columns, k={k} needs {3 * k}")
    if offline_size is None:
        offline_size = max(1, round(L / 4))
    tf_mismatch = float((rec["next"] != rec["final"]).float().mean())

    # (d) folds by prompt; train every fold's set and the final set at once
    g = torch.Generator().manual_seed(seed)
    used = sorted(set(owner.tolist()))
    if len(used) < 2:
        raise ValueError(f"cross-fitting needs decode positions from at least 2 prompts, got {len(used)}; "
                         "use more prompts")
    perm = [used[j] for j in torch.randperm(len(used), generator=g).tolist()]
    folds = min(folds, len(used))
    fold_of_prompt = {pi: j % folds for j, pi in enumerate(perm)}
    fold = torch.tensor([fold_of_prompt[int(o)] for o in owner])
    masks = torch.stack([fold != f for f in range(folds)] + [torch.ones(N, dtype=torch.bool)])
    with progress_bar(total=train_steps, desc="calibrate: train predictors", unit="step", enabled=progress) as bar:
        t2 = time.perf_counter()
        w1, b1, w2, b2 = train_predictors(X, correct.float(), masks, hidden, train_steps, lr, seed, bar,
                                          minibatch=minibatch)
    t3 = time.perf_counter()

    # out-of-fold probabilities: each position scored by a set that never trained on its prompt
    p_eval = torch.empty(L, N)
    for f in range(folds):
        sel = fold == f
        p_eval[:, sel] = mlp_probs(w1[f], b1[f], w2[f], b2[f], X[:, sel])

    # (e) thresholds and (f) offline layers on the out-of-fold probabilities
    thresholds = _sequential_thresholds(p_eval, in_spec, correct, target_precision, min_exits)
    fire = _fires(p_eval, in_spec, thresholds)
    enabled = _enabled(thresholds)
    ranked, useful = _rank_layers(fire, correct, enabled)
    offline = sorted(ranked[: min(offline_size, useful)])
    sim_all = _simulate(fire, correct, enabled)
    sim_off = _simulate(fire, correct, offline)
    cv = _cross_validate(p_eval, in_spec, correct, fold, folds, target_precision, min_exits, offline_size)

    # the bank keeps the final set, trained on all prompts
    bank = PredictorBank(w1[folds], b1[folds], w2[folds], b2[folds], thresholds, offline, k, target_fingerprint,
                         drafter_fingerprint, target_name=target_name, drafter_name=drafter_name,
                         ranked_layers=ranked)

    # (g) summary
    per_layer = []
    for l in range(L):
        p, c, s = p_eval[l], correct[l], in_spec[l]
        taken = fire[l]
        pos = int(c.sum())
        cls = p > 0.5
        per_layer.append({
            "layer": l, "threshold": thresholds[l], "samples": int(c.numel()), "positives": pos,
            "base_rate": pos / max(c.numel(), 1), "in_spec_rate": float(s.float().mean()),
            "precision_at_0.5": float(c[cls].float().mean()) if cls.any() else None,
            "taken": int(taken.sum()),
            "precision": float(c[taken].float().mean()) if taken.any() else None,
            "recall": int((taken & c).sum()) / max(int((c & s).sum()), 1),
            "first_exits": sim_all["exit_counts"][l] if l < L - 1 else 0,
            "first_exit_precision": (1 - sim_all["wrong_counts"][l] / sim_all["exit_counts"][l])
            if l < L - 1 and sim_all["exit_counts"][l] else None,
        })
    inner = slice(0, L - 1)  # the last layer's label is trivially true
    cls_all = p_eval[inner] > 0.5
    good = (correct & in_spec)[inner]
    oracle = torch.where(good.any(0), good.float().argmax(0), torch.tensor(L - 1))
    t4 = time.perf_counter()
    bank.summary = {
        "target_precision": target_precision, "k": k, "hidden": hidden, "seed": seed,
        "num_layers": L, "prompts": rec.get("num_prompts", len(used)),
        "max_new_tokens": rec.get("max_new_tokens"), "folds": folds,
        "positions": N, "heldout_positions": N,
        "drafter_hit_rate": float(in_spec[-1].float().mean()),
        "teacher_forced_mismatch": tf_mismatch,
        "heldout_precision@0.5": float(correct[inner][cls_all].float().mean()) if cls_all.any() else None,
        "heldout_base_rate": float(correct[inner].float().mean()),
        "per_layer": per_layer,
        "enabled_layers": enabled, "offline_layers": offline, "ranked_layers": ranked,
        "exit_distribution": sim_all["exit_counts"], "exit_rate": sim_all["exit_rate"],
        "mean_exit_layer": sim_all["mean_layers"], "expected_agreement": sim_all["agreement"],
        "offline_only": {"exit_distribution": sim_off["exit_counts"], "exit_rate": sim_off["exit_rate"],
                         "mean_exit_layer": sim_off["mean_layers"], "expected_agreement": sim_off["agreement"]},
        "cross_validated": cv,
        "oracle_mean_exit_layer": float((oracle.float() + 1).mean()),
        "seconds": {**rec.get("seconds", {}), "train": t3 - t2, "select": t4 - t3, "total": t4 - t_fit},
    }
    return bank
