"""The per-layer exit predictors: one tiny MLP per decoder layer, stored stacked.

    prob_l(x) = sigmoid(w2[l] . relu(x @ w1[l] + b1[l]) + b2[l]),   x = exit features [N, 3k]

Feature standardisation learnt in calibration is folded into w1/b1, so inference is two
small matmuls. A bank may also carry the draft model's vocabulary shortlist (`draft_vocab`,
chosen at calibration): the predictors learnt the drafter's proposals under it, so the
drafter must use the same one. A layer with threshold inf is disabled (never exits). A bank is saved as a
directory: `predictors.safetensors` (the weights) + `manifest.json` (everything else),
written to a temporary directory first and renamed into place, so a failed save leaves
nothing half-written. Loading reads safetensors only (no pickle) and checks that the bank
was made for this target, this drafter, this layer count and this k.
"""
from __future__ import annotations

import json
import math
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any

import torch

from ..jsonable import jsonable
from .features import FEATURE_LAYOUT, FEATURE_LAYOUT_ID, num_features

FORMAT = "specee-predictor-bank"
FORMAT_VERSION = 1
WEIGHTS_FILE = "predictors.safetensors"
MANIFEST_FILE = "manifest.json"
_TENSORS = ("w1", "b1", "w2", "b2")


class BankMismatchError(ValueError):
    """The bank was calibrated for another target, drafter, layer count or k."""


class BankFormatError(ValueError):
    """The bank directory is incomplete or corrupt."""


class PredictorBank:
    def __init__(self, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor,
                 thresholds: list[float], offline_layers: list[int], k: int,
                 target_fingerprint: str, drafter_fingerprint: str, summary: dict[str, Any] | None = None,
                 *, feature_layout: str = FEATURE_LAYOUT_ID, target_name: str = "", drafter_name: str = "",
                 ranked_layers: list[int] | None = None, draft_vocab: torch.Tensor | None = None):
        L, F, hidden = w1.shape
        if F != num_features(k):
            raise ValueError(f"w1 has {F} inputs but k={k} gives {num_features(k)} features")
        for name, t, shape in (("b1", b1, (L, hidden)), ("w2", w2, (L, hidden)), ("b2", b2, (L,))):
            if tuple(t.shape) != shape:
                raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {shape}")
        if len(thresholds) != L:
            raise ValueError(f"{len(thresholds)} thresholds for {L} layers")
        bad = [l for l in list(offline_layers) + list(ranked_layers or []) if not 0 <= l < L]
        if bad:
            raise ValueError(f"layers {bad} out of range [0, {L})")
        # own, contiguous, freshly allocated copies: views into a larger tensor (or a file) have
        # other alignments, and matmul kernels may then round differently
        self.w1, self.b1, self.w2, self.b2 = (t.detach().clone(memory_format=torch.contiguous_format)
                                              for t in (w1, b1, w2, b2))
        self.thresholds = [float(t) for t in thresholds]
        self.offline_layers = sorted(int(l) for l in offline_layers)
        if ranked_layers is None:  # offline layers first, then the other enabled layers in order
            ranked_layers = self.offline_layers + [l for l in range(L) if math.isfinite(self.thresholds[l])
                                                   and l not in self.offline_layers]
        # enabled layers, most useful first (calibration's greedy order): `ranked_layers[:n]` is
        # the best offline set of size n
        self.ranked_layers = [int(l) for l in ranked_layers]
        if draft_vocab is not None:
            draft_vocab = torch.as_tensor(draft_vocab, dtype=torch.long).flatten().cpu()
            if draft_vocab.numel() < k or bool((draft_vocab[1:] <= draft_vocab[:-1]).any()) or int(draft_vocab[0]) < 0:
                raise ValueError(f"draft_vocab must hold >= k={k} distinct non-negative token ids, ascending")
        self.draft_vocab = draft_vocab
        self.k, self.hidden, self.num_layers = int(k), int(hidden), int(L)
        self.target_fingerprint, self.drafter_fingerprint = target_fingerprint, drafter_fingerprint
        self.target_name, self.drafter_name = target_name, drafter_name
        self.feature_layout = feature_layout
        self.summary: dict[str, Any] = summary or {}
        self._views()

    def _views(self) -> None:
        # per-layer views, made once: the decode loop indexes a Python list, not a tensor
        self._w1 = list(self.w1.unbind(0))
        self._b1 = list(self.b1.unbind(0))
        self._w2 = list(self.w2.unbind(0))
        self._b2 = list(self.b2.unbind(0))

    # ---- inference --------------------------------------------------------------------------
    @property
    def enabled_layers(self) -> list[int]:
        return [l for l, t in enumerate(self.thresholds) if math.isfinite(t)]

    @property
    def device(self) -> torch.device:
        return self.w1.device

    @property
    def dtype(self) -> torch.dtype:
        return self.w1.dtype

    def logit(self, layer: int, feats: torch.Tensor) -> torch.Tensor:
        """The predictor's pre-sigmoid score, [N], for features [N, 3k]."""
        z = torch.addmm(self._b1[layer], feats, self._w1[layer]).relu_()
        return z @ self._w2[layer] + self._b2[layer]

    def prob(self, layer: int, feats: torch.Tensor) -> torch.Tensor:
        """P(layer `layer`'s token is already the final one), [N], for features [N, 3k]."""
        return torch.sigmoid(self.logit(layer, feats))

    def fires(self, layer: int, feats: torch.Tensor) -> torch.Tensor:
        """prob > threshold, [N] bool (always False for a disabled layer)."""
        return self.prob(layer, feats) > self.thresholds[layer]

    def to(self, device: str | torch.device | None = None, dtype: torch.dtype | None = None) -> "PredictorBank":
        """Move/cast the weights in place (features must then come in the same dtype); returns self."""
        for name in _TENSORS:
            setattr(self, name, getattr(self, name).to(device=device, dtype=dtype))
        self._views()
        return self

    # ---- persistence ------------------------------------------------------------------------
    def manifest(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "k": self.k,
            "num_features": num_features(self.k),
            "feature_layout": self.feature_layout,
            "feature_layout_detail": FEATURE_LAYOUT,
            "hidden": self.hidden,
            "num_layers": self.num_layers,
            "thresholds": [t if math.isfinite(t) else None for t in self.thresholds],  # null = disabled
            "offline_layers": self.offline_layers,
            "ranked_layers": self.ranked_layers,
            "target_fingerprint": self.target_fingerprint,
            "drafter_fingerprint": self.drafter_fingerprint,
            "target_name": self.target_name,
            "drafter_name": self.drafter_name,
            "draft_vocab_size": None if self.draft_vocab is None else int(self.draft_vocab.numel()),
            "summary": jsonable(self.summary),
        }

    @staticmethod
    def check_destination(path: Path) -> None:
        """Refuse a path `save` would not write (also called before calibrating: no work thrown away)."""
        if path.exists():
            if not path.is_dir():
                raise FileExistsError(f"{path} exists and is not a directory")
            foreign = [p.name for p in path.iterdir() if p.name not in (WEIGHTS_FILE, MANIFEST_FILE)]
            if foreign:
                raise FileExistsError(f"{path} exists and holds files that are not a predictor bank "
                                      f"({', '.join(sorted(foreign)[:5])}); choose an empty or new directory")

    @staticmethod
    def check_files(path: Path) -> None:
        """Refuse a path that holds no bank's files (`load` checks this first; the CLI before any model loads)."""
        if not path.is_dir():
            raise FileNotFoundError(f"predictor bank not found: {path} is not a directory "
                                    "(make one with `specee calibrate -o DIR`, or omit the bank to calibrate and cache one)")
        for name in (MANIFEST_FILE, WEIGHTS_FILE):
            if not (path / name).is_file():
                raise BankFormatError(f"{path}: not a predictor bank ({name} is missing)")

    def save(self, path: str | Path) -> Path:
        """Write the bank directory atomically: a temp dir next to it, renamed into place. An
        existing bank at `path` is replaced; any other existing directory is refused."""
        from safetensors.torch import save_file

        path = Path(path)
        self.check_destination(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
        try:
            tensors = {n: getattr(self, n).detach().to("cpu", torch.float32).contiguous() for n in _TENSORS}
            if self.draft_vocab is not None:
                tensors["draft_vocab"] = self.draft_vocab.contiguous()
            save_file(tensors, str(tmp / WEIGHTS_FILE),
                      metadata={"format": FORMAT, "format_version": str(FORMAT_VERSION)})
            (tmp / MANIFEST_FILE).write_text(json.dumps(self.manifest(), indent=2, allow_nan=False) + "\n")
            for f in (WEIGHTS_FILE, MANIFEST_FILE):  # mkdtemp makes the dir private; a bank is not secret
                (tmp / f).chmod(0o644)
            tmp.chmod(0o755)
            if path.exists():
                old = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:8]}"
                path.rename(old)
                try:
                    tmp.rename(path)
                except BaseException:
                    old.rename(path)
                    raise
                shutil.rmtree(old, ignore_errors=True)
            else:
                tmp.rename(path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return path

    @classmethod
    def load(cls, path: str | Path, expect_target: str | None = None, expect_drafter: str | None = None,
             num_layers: int | None = None, k: int | None = None,
             device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> "PredictorBank":
        """Read a bank directory (safetensors + manifest). Raises FileNotFoundError for a missing
        directory, BankFormatError for an incomplete/corrupt one, and BankMismatchError when it
        was calibrated for another target/drafter (fingerprints), layer count or k."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        path = Path(path)
        cls.check_files(path)
        manifest_path, weights_path = path / MANIFEST_FILE, path / WEIGHTS_FILE
        try:
            m = json.loads(manifest_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BankFormatError(f"{manifest_path}: corrupt manifest ({e})") from None
        if not isinstance(m, dict) or m.get("format") != FORMAT:
            raise BankFormatError(f"{manifest_path}: not a specee predictor bank manifest")
        if m.get("format_version") != FORMAT_VERSION:
            raise BankFormatError(f"{manifest_path}: format version {m.get('format_version')!r}; this specee "
                                  f"reads version {FORMAT_VERSION} (recalibrate)")
        if m.get("feature_layout") != FEATURE_LAYOUT_ID:
            raise BankMismatchError(f"{path}: features {m.get('feature_layout')!r}, this specee computes "
                                    f"{FEATURE_LAYOUT_ID!r} (recalibrate)")
        target_fp, drafter_fp = m.get("target_fingerprint"), m.get("drafter_fingerprint")
        tname, dname = m.get("target_name") or "?", m.get("drafter_name") or "?"
        if expect_target is not None and target_fp != expect_target:
            hint = ("it was calibrated without naming its target (pass target_dir= or target_fingerprint= to "
                    "calibrate)" if target_fp == "unknown" else "recalibrate for this model")
            raise BankMismatchError(f"{path}: calibrated for target {tname} (fingerprint {target_fp}), but this "
                                    f"target's fingerprint is {expect_target}; {hint}")
        if expect_drafter is not None and drafter_fp != expect_drafter:
            raise BankMismatchError(f"{path}: calibrated with drafter {dname} (fingerprint {drafter_fp}), but "
                                    f"this drafter's fingerprint is {expect_drafter}; recalibrate with this drafter")
        if num_layers is not None and m.get("num_layers") != num_layers:
            raise BankMismatchError(f"{path}: made for a {m.get('num_layers')}-layer model, this one has "
                                    f"{num_layers} layers")
        if k is not None and m.get("k") != k:
            raise BankMismatchError(f"{path}: calibrated for k={m.get('k')} speculative tokens, the drafter "
                                    f"proposes k={k}")
        try:
            tensors = load_file(str(weights_path), device="cpu")
        except (SafetensorError, OSError, ValueError) as e:
            raise BankFormatError(f"{weights_path}: corrupt weights file ({e})") from None
        missing = [n for n in _TENSORS if n not in tensors]
        if missing:
            raise BankFormatError(f"{weights_path}: tensors {missing} missing")
        vocab_size = m.get("draft_vocab_size")
        draft_vocab = tensors.get("draft_vocab")
        if (draft_vocab is None) != (vocab_size is None) or (
                draft_vocab is not None and draft_vocab.numel() != vocab_size):
            raise BankFormatError(f"{path}: the manifest's draft_vocab_size ({vocab_size}) does not match the "
                                  f"weights file ({'no' if draft_vocab is None else draft_vocab.numel()} shortlist ids)")
        thresholds = [math.inf if t is None else float(t) for t in m.get("thresholds", [])]
        try:
            bank = cls(tensors["w1"], tensors["b1"], tensors["w2"], tensors["b2"], thresholds,
                       m.get("offline_layers", []), m["k"], target_fp, drafter_fp, m.get("summary") or {},
                       feature_layout=m["feature_layout"], target_name=m.get("target_name", ""),
                       drafter_name=m.get("drafter_name", ""), ranked_layers=m.get("ranked_layers"),
                       draft_vocab=draft_vocab)
        except (KeyError, ValueError, TypeError) as e:
            raise BankFormatError(f"{path}: inconsistent bank ({e})") from None
        if bank.hidden != m.get("hidden") or bank.num_layers != m.get("num_layers"):
            raise BankFormatError(f"{path}: weights ({bank.num_layers} layers, hidden {bank.hidden}) do not match "
                                  f"the manifest ({m.get('num_layers')} layers, hidden {m.get('hidden')})")
        return bank.to(device, dtype)

    def __repr__(self) -> str:
        return (f"PredictorBank(layers={self.num_layers}, k={self.k}, hidden={self.hidden}, "
                f"enabled={len(self.enabled_layers)}, offline={self.offline_layers}, "
                f"draft_vocab={None if self.draft_vocab is None else self.draft_vocab.numel()})")
