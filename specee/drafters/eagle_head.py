"""An EAGLE-style draft head: one decoder layer that reads the target's hidden state.

The head pairs the target's feature at position t (the outputs of `feature_layers`,
concatenated) with the embedding of the token at t + 1, maps them to the hidden size (fc) and
runs one decoder layer shaped like the target's; its output estimates the target's last-layer
output at t + 1, whose logits (the target's own final norm and LM head, frozen, restricted to
an FR-Spec shortlist) predict the token at t + 2. Fed back with the next draft token, it drafts
several steps on its own. The layer runs through the target runtime's `Transformer.layer`, so
drafting, training and the target share one attention/MLP code path.

EAGLE-1 reads the last layer's output (feature_layers = (L - 1,)); EAGLE-3 fuses a low, a middle
and a high layer (an extra fc from 3H to H before the fc above). Slot 0 of the head's cache is
never written (no pair ends at position 0): rows read it as a zero key/value, in training and
drafting alike, because both build their StepInputs with the target's `range_inputs`/`step_inputs`.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from ..files import replacing
from ..model.config import ModelConfig
from ..model.kv_cache import KVCache
from ..model.llama import LayerWeights, Transformer
from ..model.step_inputs import RaggedInputs, StepInputs
from ..model.quant import FloatLinear, Linear, linear_from_parts

WEIGHTS_FILE = "head.safetensors"
MANIFEST_FILE = "manifest.json"
FORMAT = "specee-eagle-head"
FORMAT_VERSION = 1
_LAYER_FIELDS = ("attn_norm", "qkv", "o", "mlp_norm", "gate_up", "down")


@dataclass(frozen=True)
class EagleHeadConfig:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    feature_layers: tuple[int, ...]  # target layers whose outputs (pre final norm), concatenated, are the feature
    shortlist_size: int  # the FR-Spec vocabulary shortlist the head proposes from

    @classmethod
    def for_target(cls, cfg: ModelConfig, feature_layers: tuple[int, ...] | None = None,
                   shortlist_size: int | None = None) -> "EagleHeadConfig":
        """A head shaped like one of the target's layers; default features: the last layer's (EAGLE-1)."""
        layers = tuple(feature_layers) if feature_layers else (cfg.num_layers - 1,)
        bad = [i for i in layers if not 0 <= i < cfg.num_layers]
        if bad or len(set(layers)) != len(layers):
            raise ValueError(f"feature layers must be distinct layer indices in [0, {cfg.num_layers}), got {list(layers)}")
        return cls(hidden_size=cfg.hidden_size, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                   head_dim=cfg.head_dim, intermediate_size=cfg.intermediate_size, rms_norm_eps=cfg.rms_norm_eps,
                   feature_layers=layers, shortlist_size=shortlist_size or cfg.vocab_size)


def _layer_config(target: ModelConfig, cfg: EagleHeadConfig) -> ModelConfig:
    """The one-layer model config the head's layer runs under (the target's RoPE, no biases)."""
    return replace(target, num_layers=1, hidden_size=cfg.hidden_size, num_heads=cfg.num_heads,
                   num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, intermediate_size=cfg.intermediate_size,
                   rms_norm_eps=cfg.rms_norm_eps, qkv_bias=False, o_bias=False)


def _param_shapes(cfg: EagleHeadConfig) -> dict[str, tuple[int, ...]]:
    H, D, I, n = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size, len(cfg.feature_layers)
    shapes: dict[str, tuple[int, ...]] = {}
    if n > 1:
        shapes["fuse"] = (H, n * H)
    shapes.update({"fc": (H, 2 * H), "attn_norm": (H,), "qkv": ((cfg.num_heads + 2 * cfg.num_kv_heads) * D, H),
                   "o": (H, cfg.num_heads * D), "mlp_norm": (H,), "gate_up": (2 * I, H), "down": (H, I)})
    return shapes


def _layer_weights(params: dict[str, torch.Tensor], q_dim: int, linear) -> LayerWeights:
    """The head's layer in the runtime's LayerWeights form; `linear` makes each matrix's Linear
    (float ones hold the tensors themselves, so gradients reach them). `kv`, used only by the
    target's KV policies, is a gradient-free float view."""
    linears = {f: params[f] if f.endswith("norm") else linear(params[f]) for f in _LAYER_FIELDS}
    return LayerWeights(kv=FloatLinear(params["qkv"].detach()[q_dim:]), **linears)


class EagleHead:
    """The head's own weights are `params` (name -> tensor); the target's embedding, final norm and
    LM head are used in place. `params` may require grad: training runs the same `forward`.
    quantization "int4"/"int8" runs the head's matrices in that format (inference only): on a
    quantized float32 CPU target its layer then takes the target's C++ decode layer."""

    def __init__(self, target: Transformer, config: EagleHeadConfig, shortlist: torch.Tensor,
                 params: dict[str, torch.Tensor], target_fingerprint: str = "", quantization: str | None = None):
        tc = target.cfg
        if (config.hidden_size, config.head_dim) != (tc.hidden_size, tc.head_dim):
            raise ValueError(f"head shape (hidden {config.hidden_size}, head_dim {config.head_dim}) does not fit the "
                             f"target (hidden {tc.hidden_size}, head_dim {tc.head_dim})")
        if any(not 0 <= i < tc.num_layers for i in config.feature_layers):
            raise ValueError(f"feature layers {list(config.feature_layers)} outside the target's {tc.num_layers} layers")
        shortlist = shortlist.to(device=target.device, dtype=torch.long)
        if (shortlist.ndim != 1 or len(shortlist) != config.shortlist_size or len(shortlist) == 0
                or bool((shortlist[1:] <= shortlist[:-1]).any()) or int(shortlist[0]) < 0
                or int(shortlist[-1]) >= tc.vocab_size):
            raise ValueError(f"shortlist must be {config.shortlist_size} ascending distinct token ids "
                             f"in [0, {tc.vocab_size})")
        shapes = _param_shapes(config)
        if set(params) != set(shapes) or any(tuple(params[n].shape) != s for n, s in shapes.items()):
            got = {n: tuple(p.shape) for n, p in params.items()}
            raise ValueError(f"head weights do not fit the config: expected {shapes}, got {got}")
        self.target, self.config, self.shortlist = target, config, shortlist
        self.target_fingerprint = target_fingerprint
        self.feature_width = len(config.feature_layers) * tc.hidden_size
        self.params = params

        def linear(weight: torch.Tensor) -> Linear:
            if quantization is None:
                return FloatLinear(weight)
            return linear_from_parts([weight.detach()], None, quantization, target.device, target.dtype)

        # a one-layer runtime holding the head's layer: `Transformer.layer` is the code that runs it
        self.runtime = Transformer.layers_only(_layer_config(tc, config),
                                               [_layer_weights(params, config.num_heads * config.head_dim, linear)],
                                               target.device, target.dtype)
        self.lm_head_rows = target.head.take_rows(shortlist)  # the shortlist's LM-head rows, gathered once
        self._fc = linear(params["fc"])
        self._fuse = linear(params["fuse"]) if "fuse" in params else None

    # ---- construction ------------------------------------------------------------------------
    @classmethod
    def init_random(cls, target: Transformer, config: EagleHeadConfig, shortlist: torch.Tensor, seed: int = 0,
                    target_fingerprint: str = "") -> "EagleHead":
        """Fresh weights that start the head at "the target's feature passes through": fc is the identity
        on the feature half (normal(0, 1/sqrt(fan_in)) on the embedding half), fuse the identity on the
        highest feature layer's block, the layer's output projections small; so the output starts in the
        target's last-layer space (the regression target's scale) and training learns the step ahead."""
        gen = torch.Generator().manual_seed(seed)
        H = config.hidden_size
        params = {}
        for name, shape in _param_shapes(config).items():
            if len(shape) == 1:
                p = torch.ones(shape)
            else:
                p = torch.randn(shape, generator=gen) / shape[1] ** 0.5
                if name in ("o", "down"):
                    p *= 0.1
                if name == "fc":
                    p[:, :H] = torch.eye(H)
                if name == "fuse":
                    high = config.feature_layers.index(max(config.feature_layers))
                    p.zero_()
                    p[:, high * H : (high + 1) * H] = torch.eye(H)
            params[name] = p.to(device=target.device, dtype=target.dtype)
        return cls(target, config, shortlist, params, target_fingerprint)

    # ---- running -----------------------------------------------------------------------------
    def new_cache(self, batch_size: int, max_len: int) -> KVCache:
        return KVCache(self.runtime.cfg, batch_size, max_len, self.target.device, self.runtime.kv_dtype)

    def forward(self, features: torch.Tensor, tokens: torch.Tensor, step: StepInputs, cache: KVCache) -> torch.Tensor:
        """features [B, S, W]: the target's features at positions p_j (W = feature_width) or the head's
        own previous outputs (W = hidden_size); tokens [B, S]: the tokens at p_j + 1. Writes the rows'
        K/V at step.slots (position p_j + 1's slots) and returns h [B, S, H], the head's estimate of the
        target's last-layer output at p_j + 1."""
        return self.runtime.layer(0, self._inputs(features, tokens), step, cache)

    def ragged(self, features: torch.Tensor, tokens: torch.Tensor, batch: RaggedInputs) -> torch.Tensor:
        """`forward` over the rows [1, N] of several sequences, each segment of `batch` in its own cache
        (the target's ragged layer, engine/runner.py's inputs): the fc and the layer's products run once
        over all rows. Features of one width for all rows."""
        return self.runtime.ragged_layer(0, self._inputs(features, tokens), batch)

    def _inputs(self, features: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The layer's input rows: fc over (the feature, fused when it is the target's, and the token's embedding)."""
        if features.shape[-1] != self.config.hidden_size:
            if features.shape[-1] != self.feature_width or self._fuse is None:
                raise ValueError(f"features of width {features.shape[-1]}; the head reads {self.feature_width} "
                                 f"(target features) or {self.config.hidden_size} (its own output)")
            features = self._fuse(features)
        return self._fc(torch.cat([features, self.target.embed(tokens)], dim=-1))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """[..., shortlist_size]: the target's final norm and LM head rows of the shortlist; column c
        is token shortlist[c]."""
        return self.lm_head_rows(self.target.norm(h))

    # ---- files -------------------------------------------------------------------------------
    def manifest(self, extra: dict | None = None) -> dict:
        cfg = asdict(self.config)
        cfg["feature_layers"] = list(self.config.feature_layers)
        return {"format": FORMAT, "format_version": FORMAT_VERSION, "target_fingerprint": self.target_fingerprint,
                "feature_layers": list(self.config.feature_layers), "config": cfg,
                "shortlist": self.shortlist.tolist(), **(extra or {})}

    def save(self, head_dir: str | Path, manifest_extra: dict | None = None) -> None:
        """Write head.safetensors, then manifest.json (which names the weights' sha256), each via a
        temporary file renamed into place; other files in head_dir are left alone."""
        from safetensors.torch import save_file

        head_dir = Path(head_dir)
        if head_dir.exists() and not head_dir.is_dir():
            raise FileExistsError(f"{head_dir} exists and is not a directory")
        head_dir.mkdir(parents=True, exist_ok=True)
        weights, manifest = head_dir / WEIGHTS_FILE, head_dir / MANIFEST_FILE
        tensors = {n: p.detach().to("cpu", torch.float32).contiguous() for n, p in self.params.items()}
        with replacing(weights) as tmp:
            save_file(tensors, str(tmp), metadata={"format": FORMAT, "format_version": str(FORMAT_VERSION)})
            tmp.chmod(0o644)  # safetensors writes it private; a head is not secret
        m = self.manifest(manifest_extra)
        m["weights_sha256"] = _sha256(weights)
        with replacing(manifest) as tmp:
            tmp.write_text(json.dumps(m, indent=1, allow_nan=False) + "\n")

    @classmethod
    def load(cls, head_dir: str | Path, target: Transformer, target_fingerprint: str,
             quantization: str | None = None) -> "EagleHead":
        """Read a head directory (quantization: see the class). ValueError (one line) for a head made
        for another target, or a missing, corrupt or truncated one."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        head_dir = Path(head_dir)
        check_head_dir(head_dir)
        weights, manifest = head_dir / WEIGHTS_FILE, head_dir / MANIFEST_FILE
        try:
            m = json.loads(manifest.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{manifest}: corrupt manifest ({e})") from None
        if not isinstance(m, dict) or m.get("format") != FORMAT or m.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"{manifest}: not a version-{FORMAT_VERSION} specee EAGLE head manifest")
        if m.get("target_fingerprint") != target_fingerprint:
            raise ValueError(f"{head_dir}: this head was trained for the target with fingerprint "
                             f"{m.get('target_fingerprint')!r}, not for this target ({target_fingerprint!r}); "
                             "train one for this model with `specee train-draft`")
        if _sha256(weights) != m.get("weights_sha256"):
            raise ValueError(f"{weights}: corrupt or truncated (its sha256 differs from the manifest's)")
        try:
            tensors = load_file(str(weights))
            raw = dict(m["config"])
            raw["feature_layers"] = tuple(raw["feature_layers"])
            config = EagleHeadConfig(**raw)
            shortlist = torch.tensor(m["shortlist"], dtype=torch.long)
        except (SafetensorError, KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{head_dir}: corrupt EAGLE head ({' '.join(str(e).split())})") from None
        params = {n: t.to(device=target.device, dtype=target.dtype) for n, t in tensors.items()}
        return cls(target, config, shortlist, params, target_fingerprint, quantization)


def check_head_dir(head_dir: Path) -> None:
    """Refuse a directory without a head's files (`EagleHead.load` checks this first; speculative_config
    before the target loads)."""
    if not (head_dir / WEIGHTS_FILE).is_file() or not (head_dir / MANIFEST_FILE).is_file():
        raise ValueError(f"{head_dir}: not an EAGLE head directory ({WEIGHTS_FILE} and {MANIFEST_FILE} needed; "
                         "make one with `specee train-draft`)")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
