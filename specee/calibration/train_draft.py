"""Training an EAGLE-style draft head on the target's recorded features (`specee train-draft`).

Loss, per unrolled draft step m (weight decay**(m-1)): cross-entropy against the target's top-k
distribution on the shortlist, plus EAGLE's smooth-L1 regression of the head's output onto the
target's last-layer output. Step 1 reads the target's features (with Gaussian noise relative to
their RMS); step m > 1 reads the head's own step m-1 output, as drafting does ("training-time
test"), and attends to the real-feature rows of step 1 before its chain plus the chain's own
rows, exactly what the head's cache holds while drafting. The time budget covers recording and
training; a checkpoint directory (safetensors + JSON, no pickle) makes runs resumable.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..drafters.base import frequency_shortlist
from ..drafters.eagle_head import EagleHead, EagleHeadConfig
from ..files import replacing
from ..model.llama import Transformer
from ..progress import progress_bar
from .record import Record, record, training_sequences

CHECKPOINT_DIR = "checkpoint"
RECIPE_NAME = "eagle-ttt-v2"  # v2: loss on the answers only
MAX_DEFAULT_SHORTLIST = 4096  # FR-Spec: a quarter of the vocabulary by frequency, at most 4k tokens
# Half a fresh run's budget records the target: a 30 s budget trained ref-target-24L's head 16 steps (2-core CPU),
# short of the 20 warmup steps, and a 6 s one stories260K's a single step; heads no better than untrained.
MIN_MINUTES = 1.0


def default_shortlist_size(vocab_size: int) -> int:
    return max(1, min(MAX_DEFAULT_SHORTLIST, vocab_size // 4))


@dataclass(frozen=True)
class Recipe:
    lr: float = 2e-3
    weight_decay: float = 0.01
    batch_tokens: int = 1024  # rows per optimizer step (sequences of similar length, padded)
    max_len: int = 512  # longer documents are cut into pieces of this many tokens
    unroll: int = 2  # draft steps trained per position (training-time test)
    step_decay: float = 0.8  # loss weight of step m: step_decay ** (m - 1)
    cls_weight: float = 1.0
    reg_weight: float = 0.1
    feature_noise: float = 0.05  # std of the noise on input features, relative to their RMS
    top_k: int = 8  # the target's distribution is kept as its top-k shortlisted tokens
    held_out_every: int = 10  # every n-th sequence is held out
    record_fraction: float = 0.5  # most of the time budget the recording may take
    warmup_steps: int = 20
    max_steps: int | None = None  # stop earlier than the time budget (tests)
    max_sequences: int | None = None  # use only the first n sequences of the text (tests)
    checkpoint_seconds: float = 120.0
    seed: int = 0


# ---- one batch through the unrolled head ---------------------------------------------------------
def make_batch(rec: Record, seqs: list[int], last: torch.Tensor, device: torch.device) -> dict[str, torch.Tensor]:
    """Right-padded tensors [B, T, ...] of the record's sequences `seqs` (positions into rec.starts)."""
    spans = [(int(rec.starts[i]), int(rec.starts[i + 1])) for i in seqs]
    T = max(b - a for a, b in spans)

    def pad(t: torch.Tensor, fill=0) -> torch.Tensor:
        out = torch.full((len(spans), T, *t.shape[1:]), fill, dtype=t.dtype)
        for r, (a, b) in enumerate(spans):
            out[r, : b - a] = t[a:b]
        return out.to(device)

    valid = pad(rec.trained, False)  # padding and untrained positions take no loss
    return {"tokens": pad(rec.tokens), "features": pad(rec.features).float(), "last": pad(last).float(),
            "argmax": pad(rec.argmax, -1), "top_cols": pad(rec.top_cols), "top_probs": pad(rec.top_probs).float(),
            "valid": valid}


def unroll_mask(T: int, m: int, device: torch.device) -> torch.Tensor:
    """[T - m, m * T] bool: which slots step m's row for position p reads. Slots 0..T-1 hold step 1
    (slot = position), slots (k-1)*T + q step k's row for position q. Row p reads step-1 slots
    <= p - m + 1 (the real features before its chain) and step k's row at p - m + k, k = 2..m."""
    p = torch.arange(m, T, device=device)[:, None]
    slot = torch.arange(m * T, device=device)[None, :]
    k, q = slot // T + 1, slot % T
    return torch.where(k == 1, q <= p - m + 1, q == p - m + k)


def unrolled_outputs(head: EagleHead, batch: dict[str, torch.Tensor], unroll: int, noise: float = 0.0,
                     generator: torch.Generator | None = None) -> list[torch.Tensor]:
    """The head's outputs h_m [B, T - m, H] for draft steps m = 1..unroll; row r of h_m is at
    position r + m and predicts the target's next token there."""
    target: Transformer = head.target
    x, tokens = batch["features"], batch["tokens"]
    B, T = tokens.shape
    if noise:
        rms = x.pow(2).mean(-1, keepdim=True).sqrt()
        x = x + noise * rms * torch.randn(x.shape, generator=generator, device=x.device)
    outs: list[torch.Tensor] = []
    prev = None
    for m in range(1, min(unroll, T - 1) + 1):
        S = T - m
        positions = torch.arange(m, T, device=x.device)
        mask = unroll_mask(T, m, x.device).view(1, 1, S, m * T)
        step = target.step_inputs(positions[None, :], (m - 1) * T + positions, mask, m * T)
        cache = head.new_cache(B, m * T)
        if prev is not None:  # the earlier steps' K/V (a fresh cache: autograd saved the old one's views)
            cache.k[:, :, :, : (m - 1) * T] = prev.k
            cache.v[:, :, :, : (m - 1) * T] = prev.v
        inputs = x[:, :S] if m == 1 else outs[-1][:, :S]
        outs.append(head.forward(inputs, tokens[:, m:], step, cache))
        prev = cache
    return outs


def step_terms(head: EagleHead, h: torch.Tensor, batch: dict[str, torch.Tensor], m: int,
               recipe: Recipe) -> dict[str, torch.Tensor]:
    """Sums over the valid rows of step m: loss, cross-entropy, regression, top-1 and top-4 hits, rows."""
    valid = batch["valid"][:, m:]
    logp = torch.log_softmax(head.logits(h).float(), dim=-1)
    ce = -(batch["top_probs"][:, m:] * logp.gather(-1, batch["top_cols"][:, m:])).sum(-1)
    reg = F.smooth_l1_loss(h.float(), batch["last"][:, m:], reduction="none").mean(-1)
    loss = recipe.cls_weight * ce + recipe.reg_weight * reg
    with torch.no_grad():
        top4 = head.shortlist[logp.topk(min(4, logp.shape[-1]), dim=-1).indices]
        truth = batch["argmax"][:, m:, None]
        hit1, hit4 = top4[..., 0] == truth[..., 0], (top4 == truth).any(-1)
    v = valid.float()
    return {"loss": (loss * v).sum(), "ce": (ce * v).sum(), "reg": (reg * v).sum(), "top1": (hit1 & valid).sum(),
            "top4": (hit4 & valid).sum(), "rows": v.sum()}


def batches_of(rec: Record, seqs: list[int], batch_tokens: int) -> list[list[int]]:
    """Sequences grouped by similar length into batches of about batch_tokens rows."""
    lengths = rec.starts[1:] - rec.starts[:-1]
    order = sorted(seqs, key=lambda i: -int(lengths[i]))
    out, i = [], 0
    while i < len(order):
        n = max(1, batch_tokens // int(lengths[order[i]]))
        out.append(order[i : i + n])
        i += n
    return out


@torch.no_grad()
def evaluate(head: EagleHead, rec: Record, seqs: list[int], recipe: Recipe, num_layers: int) -> dict:
    """Held-out metrics per draft step: mean loss, cross-entropy, regression; top-1 / top-4 accuracy
    against the target's own next token (whole vocabulary: a token outside the shortlist is a miss)."""
    last = rec.last_hidden(head.config.feature_layers, num_layers)
    sums: list[dict[str, float]] = [dict.fromkeys(("loss", "ce", "reg", "top1", "top4", "rows"), 0.0)
                                    for _ in range(recipe.unroll)]
    for group in batches_of(rec, seqs, recipe.batch_tokens):
        batch = make_batch(rec, group, last, head.target.device)
        for m, h in enumerate(unrolled_outputs(head, batch, recipe.unroll), start=1):
            for k, v in step_terms(head, h, batch, m, recipe).items():
                sums[m - 1][k] += float(v)
    return {f"step{m}": {k: round(s[k] / max(s["rows"], 1), 5) for k in ("loss", "ce", "reg", "top1", "top4")}
            | {"rows": int(s["rows"])} for m, s in enumerate(sums, start=1)}


# ---- the training run ------------------------------------------------------------------------------
def train_draft(model, output: str | Path, minutes: float = 5.0, feature_layers: tuple[int, ...] | None = None,
                shortlist_size: int | None = None, resume: bool = False, data: str | Path | None = None,
                device: str = "cpu", recipe: Recipe | None = None, progress: bool = True) -> dict:
    """Train an EAGLE head for `model` (an LLM or a checkpoint path) and save it to `output`
    (head.safetensors + manifest.json; the resumable state in output/checkpoint). Returns the manifest."""
    from ..engine.llm import LLM

    output = Path(output)
    check_run(output, minutes, resume)
    t_start = time.monotonic()
    deadline = t_start + minutes * 60
    llm = model if isinstance(model, LLM) else LLM(model, device=device, dtype="float32", progress=progress,
                                                   quantization=None)  # as the CLI: the float target
    target, cfg = llm.model, llm.model.cfg
    if target.dtype != torch.float32:
        raise ValueError(f"the head trains in float32; load the target with dtype='float32' (it is {target.dtype})")
    ckpt = output / CHECKPOINT_DIR
    state = _read_state(ckpt, llm.fingerprint) if resume else None
    if state is not None:
        recipe = Recipe(**state["recipe"])
        head_cfg = EagleHeadConfig.for_target(cfg, tuple(state["feature_layers"]), state["shortlist_size"])
        if feature_layers is not None and tuple(feature_layers) != head_cfg.feature_layers:
            raise ValueError(f"{ckpt}: the checkpoint trains feature layers {list(head_cfg.feature_layers)}, "
                             f"not {list(feature_layers)}; resume without --feature-layers")
        if shortlist_size is not None and min(shortlist_size, cfg.vocab_size) != head_cfg.shortlist_size:
            raise ValueError(f"{ckpt}: the checkpoint trains a shortlist of {head_cfg.shortlist_size}, "
                             f"not {shortlist_size}; resume without --shortlist")
    else:
        recipe = recipe or Recipe()
        size = min(shortlist_size or default_shortlist_size(cfg.vocab_size), cfg.vocab_size)
        head_cfg = EagleHeadConfig.for_target(cfg, feature_layers, size)

    if state is not None:
        rec = Record.load(ckpt / "record.safetensors")
        shortlist = torch.tensor(state["shortlist"], dtype=torch.long)
    else:
        sequences, loss_from = training_sequences(llm.tokenizer, data, recipe.max_len)
        sequences, loss_from = sequences[: recipe.max_sequences], loss_from[: recipe.max_sequences]
        train_seqs = [s for i, s in enumerate(sequences) if i % recipe.held_out_every]
        shortlist = frequency_shortlist(train_seqs, cfg.vocab_size, head_cfg.shortlist_size)
        rec = record(target, sequences, head_cfg.feature_layers, shortlist, recipe.top_k,
                     deadline=t_start + recipe.record_fraction * minutes * 60, seed=recipe.seed, progress=progress,
                     loss_from=loss_from)
    held = [i for i, src in enumerate(rec.sources.tolist()) if src % recipe.held_out_every == 0]
    train = [i for i, src in enumerate(rec.sources.tolist()) if src % recipe.held_out_every]
    if not train or not held:
        raise ValueError(f"too little training text recorded ({len(rec.sources)} sequences); give more minutes or data")

    if state is not None:
        head, optimizer, done = _load_checkpoint(ckpt, target, head_cfg, shortlist, llm.fingerprint, recipe, state)
    else:
        head = EagleHead.init_random(target, head_cfg, shortlist, recipe.seed, llm.fingerprint)
        for p in head.params.values():
            p.requires_grad_(True)
        optimizer = _optimizer(head, recipe)
        done = {"steps": 0, "train_seconds": 0.0, "tokens": 0}
        ckpt.mkdir(parents=True, exist_ok=True)  # only now: a run refused above leaves no checkpoint to block the next
        rec.save(ckpt / "record.safetensors")
        _save_checkpoint(ckpt, head, optimizer, recipe, done, 0.0)  # resumable from here on, even if interrupted
    steps_before = done["steps"]
    last = rec.last_hidden(head_cfg.feature_layers, cfg.num_layers)
    _train_steps(head, optimizer, rec, last, train, recipe, done, deadline, ckpt, progress)
    if not done["steps"]:  # an untrained head is not written; the checkpoint holds the recording
        raise ValueError(f"minutes (--minutes) {minutes:g} left no time to train after recording the target, and "
                         f"no head was written; --resume (resume=True) trains on the recording kept in {ckpt}")
    metrics = evaluate(head, rec, held, recipe, cfg.num_layers)
    manifest_extra = {
        "recipe": RECIPE_NAME, "training": asdict(recipe), "target": str(llm.model_dir),
        "data": {"source": str(data or "../shared/data/calibration"), "sequences_recorded": len(rec.sources),
                 "train_sequences": len(train), "held_out_sequences": len(held),
                 "train_positions": _trained_positions(rec, train),
                 "held_out_positions": _trained_positions(rec, held),
                 "held_out_shortlist_coverage": _coverage(rec, held, shortlist)},
        "steps": done["steps"], "steps_this_run": done["steps"] - steps_before, "train_tokens": done["tokens"],
        "seconds_this_run": round(time.monotonic() - t_start, 1),
        "held_out": metrics,
        "held_out_top1": [metrics[f"step{m}"]["top1"] for m in range(1, recipe.unroll + 1)],
        "held_out_top4": [metrics[f"step{m}"]["top4"] for m in range(1, recipe.unroll + 1)],
    }
    head.save(output, manifest_extra)
    return head.manifest(manifest_extra)


def _train_steps(head: EagleHead, optimizer: torch.optim.AdamW, rec: Record, last: torch.Tensor, train: list[int],
                 recipe: Recipe, done: dict, deadline: float, ckpt: Path, progress: bool) -> None:
    """Optimizer steps over shuffled epochs of `train` until the deadline (or recipe.max_steps); warmup,
    then cosine decay to a tenth over the whole training time, earlier runs included, so a resumed run
    continues the schedule instead of restarting it; checkpoints every recipe.checkpoint_seconds and
    at the end. Updates `done` (steps, tokens)."""
    device = head.target.device
    gen = torch.Generator(device=device).manual_seed(recipe.seed + done["steps"])
    train_start = last_ckpt = time.monotonic()
    before = done["train_seconds"]
    budget = max(before + deadline - train_start, 1e-6)

    def more() -> bool:
        return time.monotonic() < deadline and (recipe.max_steps is None or done["steps"] < recipe.max_steps)

    bar = progress_bar(desc="training draft head", unit="step", enabled=progress,
                       total=recipe.max_steps - done["steps"] if recipe.max_steps else None)
    while more():
        order = torch.randperm(len(train), generator=torch.Generator().manual_seed(recipe.seed + done["steps"]))
        for group in batches_of(rec, [train[i] for i in order.tolist()], recipe.batch_tokens):
            if not more():
                break
            frac = min((before + time.monotonic() - train_start) / budget, 1.0)
            warm = min(1.0, (done["steps"] + 1) / recipe.warmup_steps)
            for g in optimizer.param_groups:
                g["lr"] = recipe.lr * warm * (0.1 + 0.45 * (1 + math.cos(math.pi * frac)))
            batch = make_batch(rec, group, last, device)
            loss = torch.zeros((), device=device)
            for m, h in enumerate(unrolled_outputs(head, batch, recipe.unroll, recipe.feature_noise, gen), start=1):
                t = step_terms(head, h, batch, m, recipe)
                loss = loss + recipe.step_decay ** (m - 1) * t["loss"] / t["rows"].clamp_min(1)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(list(head.params.values()), 1.0)
            optimizer.step()
            done["steps"] += 1
            done["tokens"] += int(batch["valid"].sum())
            bar.update(1)
            if done["steps"] % 10 == 0:  # a device read: not every step
                bar.set_postfix(loss=f"{float(loss.detach()):.3f}")
            if time.monotonic() - last_ckpt > recipe.checkpoint_seconds:
                _save_checkpoint(ckpt, head, optimizer, recipe, done, time.monotonic() - train_start)
                last_ckpt = time.monotonic()
    bar.close()
    _save_checkpoint(ckpt, head, optimizer, recipe, done, time.monotonic() - train_start)


def _trained_positions(rec: Record, seqs: list[int]) -> int:
    return sum(int(rec.trained[int(rec.starts[i]):int(rec.starts[i + 1])].sum()) for i in seqs)


def _coverage(rec: Record, seqs: list[int], shortlist: torch.Tensor) -> float:
    """Share of the held-out positions whose target token is in the shortlist (top-1 ceiling)."""
    idx = torch.cat([torch.arange(int(rec.starts[i]), int(rec.starts[i + 1])) for i in seqs])
    idx = idx[rec.trained[idx]]
    return round(float(torch.isin(rec.argmax[idx], shortlist).float().mean()), 4)


# ---- checkpoints: safetensors for tensors, JSON for the rest ------------------------------------------
def _optimizer(head: EagleHead, recipe: Recipe) -> torch.optim.AdamW:
    return torch.optim.AdamW(list(head.params.values()), lr=recipe.lr, betas=(0.9, 0.95),
                             weight_decay=recipe.weight_decay)


def check_run(output: Path, minutes: float, resume: bool) -> None:
    """Refuse, before the target loads (the CLI calls it first too), a run that could only fail or write an
    untrained head: resuming without a whole checkpoint, starting afresh over one, or too short a budget."""
    ckpt = output / CHECKPOINT_DIR
    if resume:
        if not all((ckpt / name).is_file() for name in ("state.json", "state.safetensors", "record.safetensors")):
            raise FileNotFoundError(f"nothing to resume: {ckpt} holds no complete training checkpoint")
    elif ckpt.exists():
        raise FileExistsError(f"{output} already holds a training checkpoint; pass --resume (resume=True) to "
                              "continue it, or choose a new directory")
    elif minutes < MIN_MINUTES:
        raise ValueError(f"minutes (--minutes) {minutes:g} is too short to record the target and train a head: "
                         f"give at least {MIN_MINUTES:g}")


def _read_state(ckpt: Path, fingerprint: str) -> dict:
    path = ckpt / "state.json"
    try:
        state = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: corrupt checkpoint state ({e})") from None
    if state.get("target_fingerprint") != fingerprint:
        raise ValueError(f"{ckpt}: checkpoint of a head for target {state.get('target_fingerprint')!r}, "
                         f"not this target ({fingerprint!r})")
    return state


def _save_checkpoint(ckpt: Path, head: EagleHead, optimizer: torch.optim.AdamW, recipe: Recipe, done: dict,
                     seconds: float) -> None:
    from safetensors.torch import save_file

    names = list(head.params)
    tensors = {f"param.{n}": p.detach().cpu().contiguous() for n, p in head.params.items()}
    opt = optimizer.state_dict()
    for i, n in enumerate(names):
        for key in ("exp_avg", "exp_avg_sq"):
            if key in opt["state"].get(i, {}):
                tensors[f"{key}.{n}"] = opt["state"][i][key].cpu().contiguous()
    adam_step = float(opt["state"][0]["step"]) if 0 in opt["state"] else 0.0
    ckpt.mkdir(parents=True, exist_ok=True)
    with replacing(ckpt / "state.safetensors") as tmp:
        save_file(tensors, str(tmp))
    state = {"target_fingerprint": head.target_fingerprint, "feature_layers": list(head.config.feature_layers),
             "shortlist_size": head.config.shortlist_size, "shortlist": head.shortlist.tolist(),
             "recipe": asdict(recipe), "param_names": names, "adam_step": adam_step,
             "train_seconds": done["train_seconds"] + seconds, **{k: done[k] for k in ("steps", "tokens")}}
    with replacing(ckpt / "state.json") as tmp:
        tmp.write_text(json.dumps(state) + "\n")


def _load_checkpoint(ckpt: Path, target: Transformer, cfg: EagleHeadConfig, shortlist: torch.Tensor,
                     fingerprint: str, recipe: Recipe, state: dict):
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        t = load_file(str(ckpt / "state.safetensors"))
        params = {n: t[f"param.{n}"].to(target.device).requires_grad_(True) for n in state["param_names"]}
    except (SafetensorError, KeyError) as e:
        raise ValueError(f"{ckpt}: corrupt checkpoint ({' '.join(str(e).split())})") from None
    head = EagleHead(target, cfg, shortlist, params, fingerprint)
    optimizer = _optimizer(head, recipe)
    if f"exp_avg.{state['param_names'][0]}" in t:
        sd = optimizer.state_dict()
        sd["state"] = {i: {"step": torch.tensor(state["adam_step"]), "exp_avg": t[f"exp_avg.{n}"].to(target.device),
                           "exp_avg_sq": t[f"exp_avg_sq.{n}"].to(target.device)}
                       for i, n in enumerate(state["param_names"])}
        optimizer.load_state_dict(sd)
    done = {"steps": state["steps"], "tokens": state["tokens"], "train_seconds": state["train_seconds"]}
    return head, optimizer, done
