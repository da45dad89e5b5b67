"""The layer-granular runtime for Llama-family decoders (Llama 2/3, Mistral, Qwen2, SmolLM).

Every piece a decode loop needs is a separate call so that early exit can stop between
layers: `embed`, `layer(i, ...)`, `norm` and `lm_head`.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from .config import ModelConfig
from .kv_cache import KVCache
from .rope import apply_rope, rope_tables, signed_sin
from .gguf import config_from_gguf, open_gguf, read_gguf_state_dict
from .resolve import is_gguf, local_model
from .weights import check_config_fits, read_state_dict, take


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor
    qkv: torch.Tensor  # q, k and v projections fused: one matmul instead of three
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    mlp_norm: torch.Tensor
    gate_up: torch.Tensor  # gate and up fused
    down: torch.Tensor


@dataclass
class StepInputs:
    """What every layer of one forward step shares, computed once per step (not per layer).

    slots: cache slots the rows write, [S]; cos/sin: RoPE rows, [B, S, 1, D] (sin signed, see rope.py);
    mask: which cache slots each row may read, [B, 1, S, kv_len] (None = all of them);
    kv_len: how many cache slots attention reads.
    """

    slots: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    mask: torch.Tensor | None
    kv_len: int


class Transformer:
    def __init__(self, cfg: ModelConfig, tensors: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype, source: Path):
        self.cfg, self.device, self.dtype = cfg, device, dtype
        H, D, I = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
        q_dim, kv_dim = cfg.num_heads * D, cfg.num_kv_heads * D

        def get(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            return take(tensors, name, shape, source).to(device=device, dtype=dtype)

        self.embedding = get("model.embed_tokens.weight", (cfg.vocab_size, H))
        self.layers: list[LayerWeights] = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            qkv = torch.cat([get(p + "self_attn.q_proj.weight", (q_dim, H)),
                             get(p + "self_attn.k_proj.weight", (kv_dim, H)),
                             get(p + "self_attn.v_proj.weight", (kv_dim, H))])
            qkv_bias = None
            if cfg.qkv_bias:
                qkv_bias = torch.cat([get(p + "self_attn.q_proj.bias", (q_dim,)),
                                      get(p + "self_attn.k_proj.bias", (kv_dim,)),
                                      get(p + "self_attn.v_proj.bias", (kv_dim,))])
            self.layers.append(LayerWeights(
                attn_norm=get(p + "input_layernorm.weight", (H,)),
                qkv=qkv,
                qkv_bias=qkv_bias,
                o=get(p + "self_attn.o_proj.weight", (H, q_dim)),
                o_bias=get(p + "self_attn.o_proj.bias", (H,)) if cfg.o_bias else None,
                mlp_norm=get(p + "post_attention_layernorm.weight", (H,)),
                gate_up=torch.cat([get(p + "mlp.gate_proj.weight", (I, H)), get(p + "mlp.up_proj.weight", (I, H))]),
                down=get(p + "mlp.down_proj.weight", (H, I)),
            ))
        self.final_norm = get("model.norm.weight", (H,))
        if cfg.tie_word_embeddings:
            tensors.pop("lm_head.weight", None)
            self.lm_head_weight = self.embedding
        else:
            self.lm_head_weight = get("lm_head.weight", (cfg.vocab_size, H))
        check_config_fits(cfg, tensors, source)
        cos, sin = rope_tables(cfg, cfg.max_position_embeddings, device, dtype)
        self.cos_table, self.sin_table = cos, signed_sin(sin)
        # slot / position indices 0..context-1, made once: decode steps slice it instead of allocating
        self.slot_ids = torch.arange(cfg.max_position_embeddings, device=device)

    @classmethod
    def load(cls, source: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> "Transformer":
        """source: a checkpoint directory (config.json + safetensors), a .gguf file, or a directory holding one."""
        path = local_model(source)
        if is_gguf(path):
            reader = open_gguf(path)
            cfg = config_from_gguf(reader, path)
            return cls(cfg, read_gguf_state_dict(reader, cfg, path, dtype), torch.device(device), dtype, path)
        cfg = ModelConfig.from_file(path / "config.json")
        return cls(cfg, read_state_dict(path), torch.device(device), dtype, path)

    # ---- pieces of a forward pass -------------------------------------------------------
    def new_cache(self, batch_size: int, max_len: int) -> KVCache:
        return KVCache(self.cfg, batch_size, max_len, self.device, self.dtype)

    def step_inputs(self, positions: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor | None, kv_len: int) -> StepInputs:
        """positions: [B, S] RoPE positions of the rows; slots: [S] cache slots they write."""
        cos = self.cos_table[positions].unsqueeze(2)
        sin = self.sin_table[positions].unsqueeze(2)
        return StepInputs(slots=slots, cos=cos, sin=sin, mask=mask, kv_len=kv_len)

    def range_inputs(self, start: int, count: int) -> StepInputs:
        """Inputs for `count` rows of one unpadded sequence at slots (= positions) start..start+count-1,
        each reading the slots up to its own: RoPE rows are views of the tables, not gathers."""
        end = start + count
        slots = self.slot_ids[start:end]
        D = self.cfg.head_dim
        mask = None if count == 1 else (self.slot_ids[:end][None, :] <= slots[:, None]).view(1, 1, count, end)
        return StepInputs(slots=slots, cos=self.cos_table[start:end].view(1, count, 1, D),
                          sin=self.sin_table[start:end].view(1, count, 1, D), mask=mask, kv_len=end)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids, self.embedding)

    def layer(self, i: int, h: torch.Tensor, step: StepInputs, cache: KVCache) -> torch.Tensor:
        """Decoder layer i on rows h [B, S, H]; writes their K/V into the cache at step.slots."""
        cfg, w = self.cfg, self.layers[i]
        B, S, _ = h.shape
        D = cfg.head_dim
        x = F.rms_norm(h, (cfg.hidden_size,), w.attn_norm, cfg.rms_norm_eps)
        qkv = F.linear(x, w.qkv, w.qkv_bias).view(B, S, cfg.num_heads + 2 * cfg.num_kv_heads, D)
        qk = apply_rope(qkv[:, :, : cfg.num_heads + cfg.num_kv_heads], step.cos, step.sin)
        q = qk[:, :, : cfg.num_heads].transpose(1, 2)
        k = qk[:, :, cfg.num_heads :].transpose(1, 2)
        v = qkv[:, :, cfg.num_heads + cfg.num_kv_heads :].transpose(1, 2)
        k_cache, v_cache = cache.k[i], cache.v[i]
        k_cache.index_copy_(2, step.slots, k)
        v_cache.index_copy_(2, step.slots, v)
        attn = F.scaled_dot_product_attention(
            q, k_cache[:, :, : step.kv_len], v_cache[:, :, : step.kv_len],
            attn_mask=step.mask, enable_gqa=cfg.num_kv_heads != cfg.num_heads)
        h = h + F.linear(attn.transpose(1, 2).reshape(B, S, cfg.num_heads * D), w.o, w.o_bias)
        x = F.rms_norm(h, (cfg.hidden_size,), w.mlp_norm, cfg.rms_norm_eps)
        gate, up = F.linear(x, w.gate_up).chunk(2, dim=-1)
        return h + F.linear(F.silu(gate) * up, w.down)

    def project_kv(self, i: int, h: torch.Tensor, step: StepInputs, cache: KVCache) -> None:
        """Write layer i's K/V for rows h without running the layer (CALM-style propagation)."""
        cfg, w = self.cfg, self.layers[i]
        B, S, _ = h.shape
        D, q_dim = cfg.head_dim, cfg.num_heads * cfg.head_dim
        x = F.rms_norm(h, (cfg.hidden_size,), w.attn_norm, cfg.rms_norm_eps)
        bias = None if w.qkv_bias is None else w.qkv_bias[q_dim:]
        kv = F.linear(x, w.qkv[q_dim:], bias).view(B, S, 2 * cfg.num_kv_heads, D)
        k = apply_rope(kv[:, :, : cfg.num_kv_heads], step.cos, step.sin)
        cache.k[i].index_copy_(2, step.slots, k.transpose(1, 2))
        cache.v[i].index_copy_(2, step.slots, kv[:, :, cfg.num_kv_heads :].transpose(1, 2))

    def norm(self, h: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(h, (self.cfg.hidden_size,), self.final_norm, self.cfg.rms_norm_eps)

    def lm_head(self, h_normed: torch.Tensor) -> torch.Tensor:
        return F.linear(h_normed, self.lm_head_weight)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(h))

    # ---- a whole forward over all layers ---------------------------------------------------
    def forward(self, token_ids: torch.Tensor, step: StepInputs, cache: KVCache, depth: int | None = None) -> torch.Tensor:
        """Forward of rows token_ids [B, S] through layers 0..depth-1 (default: all); returns their
        hidden states [B, S, H] (the final ones at full depth)."""
        h = self.embed(token_ids)
        for i in range(self.cfg.num_layers if depth is None else depth):
            h = self.layer(i, h, step, cache)
        return h

    def hidden_states(self, token_ids: list[int]) -> torch.Tensor:
        """Teacher-forced pass over one sequence keeping every layer's output: [L + 1, S, H]
        (index 0 = embeddings, index i + 1 = output of layer i). For calibration and the logit lens."""
        S = len(token_ids)
        cache = self.new_cache(1, S)
        step = self.range_inputs(0, S)
        h = self.embed(torch.tensor([token_ids], device=self.device))
        out = [h[0]]
        for i in range(self.cfg.num_layers):
            h = self.layer(i, h, step, cache)
            out.append(h[0])
        return torch.stack(out)
