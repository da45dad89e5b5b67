"""The layer-granular runtime for Llama-family decoders (Llama 2/3, Mistral, Qwen2, SmolLM).

Every piece a decode loop needs is a separate call so that early exit can stop between
layers: `embed`, `layer(i, ...)`, `norm` and `lm_head`. The rows of one sequence (batch 1: a
token, a verification pass, a prefill) through a layer of a quantized model on the CPU run in C++
(model/kernels: the same kernels, none of the ~40 calls from Python); batches of several
sequences, and float models (the reference), run the Python layer.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from .config import ModelConfig
from .kv_cache import KVCache, check_kv_cache_dtype
from .gguf_blocks import GGUFWeight
from .huge_pages import move_to_huge_pages
from .quant import FloatLinear, Linear, RefinedHead, kernel_spec, linear_from_parts
from .rope import apply_rope, rope_tables, signed_sin
from .step_inputs import NO_MASK, RaggedInputs, StepInputs
from .gguf import config_from_gguf, open_gguf, read_gguf_state_dict
from .resolve import is_gguf, local_model
from .weights import check_config_fits, read_state_dict, take


def model_config(source: str | Path) -> ModelConfig:
    """A checkpoint directory's or GGUF file's config, without reading its weights (the CLI checks a
    prompt against the context with it before loading anything)."""
    path = local_model(source)
    if is_gguf(path):
        return config_from_gguf(open_gguf(path), path)
    return ModelConfig.from_file(path / "config.json")


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor
    qkv: Linear  # q, k and v projections fused: one matmul instead of three
    kv: Linear  # qkv's k and v rows (a view when float), for project_kv
    o: Linear
    mlp_norm: torch.Tensor
    gate_up: Linear  # gate and up fused
    down: Linear


# slots whose decode-row inputs the model keeps once made (range_inputs): ~2 KB each, 16 MB at most
KEPT_ROW_INPUTS = 8192


class Transformer:
    _fast_layers: list | None = None  # the C++ layers (see fast_layers_for), or None
    fast_stack = None  # the same layers as one C++ object (a range of them in one call), or None
    fast_kernels = None  # the C++ module the layers come from (its RMS norm serves the final norm)

    def __init__(self, cfg: ModelConfig, tensors: dict[str, torch.Tensor | GGUFWeight], device: torch.device,
                 dtype: torch.dtype, source: Path, quantization: str | None = None, kv_cache_dtype: str = "auto"):
        """tensors: HF-named weights, float tensors or GGUF raw blocks (GGUFWeight). quantization:
        None (float linears in `dtype`), "int4", "int8" or "auto" (see quant.linear_from_parts).
        Fused q/k/v and gate/up are quantized fused; the embedding stays float (a GGUF's on the CPU:
        its blocks, rows dequantized on lookup), and a tied LM head gets its own quantized copy whose
        rows early exit can still gather. kv_cache_dtype: see `kv_dtype_for`."""
        check_kv_cache_dtype(kv_cache_dtype)
        self.cfg, self.device, self.dtype, self.quantization = cfg, device, dtype, quantization
        H, D, I = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
        q_dim, kv_dim = cfg.num_heads * D, cfg.num_kv_heads * D

        def get(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            return take(tensors, name, shape, source).to(device=device, dtype=dtype)

        def linear(names: list[tuple[str, int, int]], bias: torch.Tensor | None = None, keep_rows: bool = False) -> Linear:
            parts = [take(tensors, name, (n, k), source) for name, n, k in names]
            return linear_from_parts(parts, bias, quantization, device, dtype, keep_rows)

        embedding = take(tensors, "model.embed_tokens.weight", (cfg.vocab_size, H), source)
        # a GGUF's table stays the file's blocks on the CPU, its rows dequantized on lookup (the same
        # values; Qwen2.5-1.5B's float32 copy was 890 MiB next to a 1 GB file, for ~50 us a step)
        keep_blocks = isinstance(embedding, GGUFWeight) and device.type == "cpu"
        self.embedding = embedding if keep_blocks else embedding.to(device=device, dtype=dtype)
        self.layers: list[LayerWeights] = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            qkv_bias = None
            if cfg.qkv_bias:
                qkv_bias = torch.cat([get(p + "self_attn.q_proj.bias", (q_dim,)),
                                      get(p + "self_attn.k_proj.bias", (kv_dim,)),
                                      get(p + "self_attn.v_proj.bias", (kv_dim,))])
            qkv = linear([(p + "self_attn.q_proj.weight", q_dim, H), (p + "self_attn.k_proj.weight", kv_dim, H),
                          (p + "self_attn.v_proj.weight", kv_dim, H)], qkv_bias, keep_rows=True)
            kv = qkv.take_rows(slice(q_dim, None))  # from the rows kept until here
            qkv.release_rows()
            self.layers.append(LayerWeights(
                attn_norm=get(p + "input_layernorm.weight", (H,)),
                qkv=qkv,
                kv=kv,
                o=linear([(p + "self_attn.o_proj.weight", H, q_dim)],
                         get(p + "self_attn.o_proj.bias", (H,)) if cfg.o_bias else None),
                mlp_norm=get(p + "post_attention_layernorm.weight", (H,)),
                gate_up=linear([(p + "mlp.gate_proj.weight", I, H), (p + "mlp.up_proj.weight", I, H)]),
                down=linear([(p + "mlp.down_proj.weight", H, I)]),
            ))
        self.final_norm = get("model.norm.weight", (H,))
        self.final_norm_f32 = self.final_norm.float()  # the exit features' norm runs in float32
        if cfg.tie_word_embeddings:
            tensors.pop("lm_head.weight", None)
            self.head: Linear = linear_from_parts([embedding], None, quantization, device, dtype, keep_rows=True)
            if isinstance(self.head, FloatLinear) and not keep_blocks:
                self.head = FloatLinear(self.embedding)  # one tensor for both, no copy
        else:
            self.head = linear([("lm_head.weight", cfg.vocab_size, H)], keep_rows=True)
        self.head = RefinedHead.around(self.head)  # a quantized head's best logits exact (quant.py)
        check_config_fits(cfg, tensors, source)
        cos, sin = rope_tables(cfg, cfg.max_position_embeddings, device, dtype)
        self.cos_table, self.sin_table = cos, signed_sin(sin)
        # slot / position indices 0..context-1, made once: decode steps slice it instead of allocating
        self.slot_ids = torch.arange(cfg.max_position_embeddings, device=device)
        self._row_inputs: dict[int, StepInputs] = {}  # a decode row's inputs per slot below KEPT_ROW_INPUTS
        # CUDA's fused attention kernels take no mask together with grouped KV heads (it falls back to
        # the math kernel, scores materialised): where a mask is needed there, KV heads are expanded
        self.expand_kv_for_mask = device.type == "cuda"
        if device.type == "cuda":
            # cuDNN's attention (PyTorch's first choice on Hopper) builds a plan per new key length: 80-90
            # ms of host time each at Llama-2-7B's shape (H200), and decoding meets a new length every
            # step; flash and memory-efficient attention have no plans (benchmarks/gpu_cost.py, 7B bf16: 10.99
            # -> 102.02 tokens/s at 1 request). Process-wide, as torch offers it.
            torch.backends.cuda.enable_cudnn_sdp(False)
        move_to_huge_pages(self.resident_tensors())  # before the C++ layers take their pointers
        self.fast_layers = self.fast_layers_for()
        self.kv_dtype = self.kv_dtype_for(kv_cache_dtype)

    def kv_dtype_for(self, choice: str) -> torch.dtype:
        """What the KV cache stores. "auto": float16 where the C++ layer's row attention reads it (an
        AVX-512 or AVX2 CPU), as llama.cpp's default: half the bytes, which bound attention with 8 requests,
        and twice the tokens in a memory budget; elsewhere the model's dtype (the Python layer, the
        reference, and ATen's attention, which would convert a float16 cache on every call)."""
        if choice != "auto":
            return getattr(torch, choice)
        if self.fast_layers is None:
            return self.dtype
        from .kernels import cpu_kernels

        return torch.float16 if cpu_kernels().row_attention_available(self.cfg.head_dim) else self.dtype

    @property
    def fast_layers(self) -> list | None:
        return self._fast_layers

    @fast_layers.setter
    def fast_layers(self, layers: list | None) -> None:
        """Set the C++ layers (None: the Python layer runs), and with them the stack that runs a range
        in one call (None unless every entry is a C++ layer: a test may wrap them to count calls)."""
        self._fast_layers, self.fast_stack, self.fast_kernels = layers, None, None
        if layers:
            from .kernels import cpu_kernels

            self.fast_kernels = kernel = cpu_kernels()
            if kernel is not None and all(isinstance(x, kernel.DecodeLayer) for x in layers):
                self.fast_stack = kernel.DecodeStack(list(layers))

    def fast_layers_for(self) -> list | None:
        """The C++ batch-1 layers, for a quantized float32 model on the CPU where the kernel builds
        (model/kernels); None elsewhere. Float models keep the Python layer, the reference that
        matches transformers bit for bit."""
        linears = [lin for w in self.layers for lin in (w.qkv, w.o, w.gate_up, w.down)]
        if self.device.type != "cpu" or self.dtype != torch.float32 or all(isinstance(x, FloatLinear) for x in linears):
            return None
        from .kernels import cpu_kernels

        kernel = cpu_kernels()
        if kernel is None:
            return None
        cfg = self.cfg
        return [kernel.DecodeLayer(w.attn_norm, w.mlp_norm, cfg.rms_norm_eps, cfg.num_heads, cfg.num_kv_heads,
                                   cfg.head_dim, *map(list, zip(*(kernel_spec(x) for x in (w.qkv, w.o, w.gate_up, w.down)))))
                for w in self.layers]

    @classmethod
    def layers_only(cls, cfg: ModelConfig, layers: list[LayerWeights], device: torch.device,
                    dtype: torch.dtype) -> "Transformer":
        """A runtime of decoder layers alone (no embedding, norm or head): what `layer` needs, for
        modules that run their own layers through this code (the EAGLE head)."""
        runtime = object.__new__(cls)
        runtime.cfg, runtime.layers, runtime.device, runtime.dtype = cfg, layers, device, dtype
        runtime.expand_kv_for_mask = device.type == "cuda"
        runtime.fast_layers = runtime.fast_layers_for()
        runtime.kv_dtype = runtime.kv_dtype_for("auto")
        return runtime

    @classmethod
    def load(cls, source: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
             quantization: str | None = None, kv_cache_dtype: str = "auto") -> "Transformer":
        """source: a checkpoint directory (config.json + safetensors), a .gguf file, or a directory holding one.
        quantization: see __init__; a quantized GGUF's weight matrices then stay raw blocks until repacked."""
        path = local_model(source)
        cfg = model_config(path)
        if is_gguf(path):
            tensors = read_gguf_state_dict(open_gguf(path), cfg, path, dtype, raw_matrices=quantization is not None)
            return cls(cfg, tensors, torch.device(device), dtype, path, quantization, kv_cache_dtype)
        return cls(cfg, read_state_dict(path), torch.device(device), dtype, path, quantization, kv_cache_dtype)

    def decode_linears(self) -> list:
        """The products a full-depth decode token runs: every layer's (`kv`, rows of qkv, serves
        skipped layers only) and what ranks the head (a RefinedHead's ranker, else the head)."""
        head = getattr(self.head, "ranker", None) or getattr(self.head, "head", self.head)
        return [lin for w in self.layers for lin in (w.qkv, w.o, w.gate_up, w.down)] + [head]

    def resident_tensors(self) -> list[torch.Tensor]:
        """The weights held in memory (embedding unless it stays GGUF blocks, norms, linears; not the
        RoPE tables or KV cache); tensors may share a storage (a float kv is a view of qkv)."""
        tensors = ([] if isinstance(self.embedding, GGUFWeight) else [self.embedding])
        tensors += [self.final_norm, *self.head.tensors()]
        for w in self.layers:
            tensors += [w.attn_norm, w.mlp_norm]
            for lin in (w.qkv, w.kv, w.o, w.gate_up, w.down):
                tensors += lin.tensors()
        return tensors

    @property
    def quantized(self) -> bool:
        """Whether the layers' linears hold quantized weights (quantization "auto" keeps a float checkpoint float)."""
        return any(not isinstance(lin, FloatLinear) for w in self.layers for lin in (w.qkv, w.o, w.gate_up, w.down))

    def weight_formats(self) -> str:
        """What the layers' linears hold, as a user reads it ("int4", "Q4_K + Q6_K", "float32"): the note a
        command prints names this, not the quantization it asked for ("auto" says nothing)."""
        names = set()
        for w in self.layers:
            for lin in (w.qkv, w.o, w.gate_up, w.down):  # (kv: qkv's rows)
                if isinstance(lin, FloatLinear):
                    names.add(str(lin.weight.dtype).removeprefix("torch."))
                elif hasattr(lin, "parts"):  # GGUF blocks as stored (quant_gguf.KQuantLinear)
                    names.update(p.qtype.name for p in lin.parts)
                else:
                    names.add(type(lin).__name__.removesuffix("Linear").lower())
        return " + ".join(sorted(names))

    def weight_bytes(self) -> int:
        """Bytes of resident weights, each storage counted once (a float tied head is the embedding)."""
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in self.resident_tensors()}
        blocks = self.embedding.data.nbytes if isinstance(self.embedding, GGUFWeight) else 0
        return sum(storages.values()) + blocks

    # ---- pieces of a forward pass -------------------------------------------------------
    def new_cache(self, batch_size: int, max_len: int) -> KVCache:
        return KVCache(self.cfg, batch_size, max_len, self.device, self.kv_dtype)

    def step_inputs(self, positions: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor | None, kv_len: int) -> StepInputs:
        """positions: [B, S] RoPE positions of the rows; slots: [S] cache slots they write."""
        cos = self.cos_table[positions].unsqueeze(2)
        sin = self.sin_table[positions].unsqueeze(2)
        return StepInputs(slots=slots, cos=cos, sin=sin, kv_len=kv_len, reads="all" if mask is None else "mask",
                          mask=mask)

    def range_inputs(self, start: int, count: int, prompt: bool = False) -> StepInputs:
        """Inputs for `count` rows of one unpadded sequence at slots (= positions) start..start+count-1,
        each reading the slots up to its own: RoPE rows are views of the tables, not gathers. Rows
        from slot 0, or a `prompt`'s part from a later slot (chunked prefill), read as a prompt's
        ("causal"); other rows past slot 0 as a verification chain."""
        if count == 1 and (kept := self._row_inputs.get(start)) is not None:
            return kept  # a decode row: its three views took ~13 us a request a step (Intel Xeon)
        end = start + count
        slots = self.slot_ids[start:end]
        D = self.cfg.head_dim
        reads = "all" if count == 1 else "causal" if start == 0 or prompt else "chain"
        mask = (self.slot_ids[:end][None, :] <= slots[:, None]).view(1, 1, count, end) if start and count > 1 else None
        step = StepInputs(slots=slots, cos=self.cos_table[start:end].view(1, count, 1, D),
                          sin=self.sin_table[start:end].view(1, count, 1, D), kv_len=end, reads=reads, mask=mask)
        if count == 1 and start < KEPT_ROW_INPUTS:
            self._row_inputs[start] = step
        return step

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.embedding, GGUFWeight):
            rows = self.embedding.rows(token_ids.reshape(-1))
            return rows.to(self.dtype).view(*token_ids.shape, self.cfg.hidden_size)
        return F.embedding(token_ids, self.embedding)

    def layer(self, i: int, h: torch.Tensor, step: StepInputs, cache: KVCache) -> torch.Tensor:
        """Decoder layer i on rows h [B, S, H]; writes their K/V into the cache at step.slots."""
        if self.fast_layers is not None and h.shape[0] == 1:
            mask = NO_MASK if step.mask is None else step.mask
            return self.fast_layers[i](h, step.cos, step.sin, cache.k[i], cache.v[i], step.slots, step.kv_len, mask,
                                       step.causal, step.chain)
        cfg, w = self.cfg, self.layers[i]
        B, S, _ = h.shape
        D = cfg.head_dim
        x = F.rms_norm(h, (cfg.hidden_size,), w.attn_norm, cfg.rms_norm_eps)
        qkv = w.qkv(x).view(B, S, cfg.num_heads + 2 * cfg.num_kv_heads, D)
        qk = apply_rope(qkv[:, :, : cfg.num_heads + cfg.num_kv_heads], step.cos, step.sin)
        q = qk[:, :, : cfg.num_heads].transpose(1, 2)
        k = qk[:, :, cfg.num_heads :].transpose(1, 2)
        v = qkv[:, :, cfg.num_heads + cfg.num_kv_heads :].transpose(1, 2)
        k_cache, v_cache = cache.k[i], cache.v[i]
        k_cache.index_copy_(2, step.slots, k.to(k_cache.dtype))
        v_cache.index_copy_(2, step.slots, v.to(v_cache.dtype))
        attn = self.attention(q, k_cache[:, :, : step.kv_len], v_cache[:, :, : step.kv_len], step)
        h = h + w.o(attn.transpose(1, 2).reshape(B, S, cfg.num_heads * D))
        x = F.rms_norm(h, (cfg.hidden_size,), w.mlp_norm, cfg.rms_norm_eps)
        gate, up = w.gate_up(x).chunk(2, dim=-1)
        return h + w.down(F.silu(gate) * up)

    def ragged_layer(self, i: int, h: torch.Tensor, batch: RaggedInputs) -> torch.Tensor:
        """Decoder layer i on the rows h [1, N, H] of several sequences: the products run once over all
        rows, attention per sequence over its own cache (what the sequence would compute alone)."""
        if self.fast_layers is not None:
            return self.fast_layers[i].ragged(h, batch.cos, batch.sin, batch.slots, batch.k_layers[i], batch.v_layers[i],
                                              batch.rows, batch.kv_lens, batch.masks, batch.causal, batch.chain)
        cfg, w = self.cfg, self.layers[i]
        N, D = h.shape[1], cfg.head_dim
        x = F.rms_norm(h, (cfg.hidden_size,), w.attn_norm, cfg.rms_norm_eps)
        qkv = w.qkv(x).view(1, N, cfg.num_heads + 2 * cfg.num_kv_heads, D)
        qk = apply_rope(qkv[:, :, : cfg.num_heads + cfg.num_kv_heads], batch.cos, batch.sin)
        outs, first = [], 0
        for n, k_cache, v_cache, step in zip(batch.rows, batch.k_layers[i], batch.v_layers[i], batch.steps):
            rows = slice(first, first + n)
            q = qk[:, rows, : cfg.num_heads].transpose(1, 2)
            k = qk[:, rows, cfg.num_heads :].transpose(1, 2)
            v = qkv[:, rows, cfg.num_heads + cfg.num_kv_heads :].transpose(1, 2)
            k_cache.index_copy_(2, step.slots, k.to(k_cache.dtype))
            v_cache.index_copy_(2, step.slots, v.to(v_cache.dtype))
            outs.append(self.attention(q, k_cache[:, :, : step.kv_len], v_cache[:, :, : step.kv_len], step))
            first += n
        attn = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]
        h = h + w.o(attn.transpose(1, 2).reshape(1, N, cfg.num_heads * D))
        x = F.rms_norm(h, (cfg.hidden_size,), w.mlp_norm, cfg.rms_norm_eps)
        gate, up = w.gate_up(x).chunk(2, dim=-1)
        return h + w.down(F.silu(gate) * up)

    def ragged_layers(self, first: int, last: int, h: torch.Tensor, batch: RaggedInputs) -> torch.Tensor:
        """Layers first .. last - 1 on the rows h [1, N, H]: one C++ call where the stack runs, else
        ragged_layer one at a time."""
        if self.fast_stack is not None:
            return self.fast_stack.ragged(first, last, h, batch.cos, batch.sin, batch.slots, batch.k_layers,
                                          batch.v_layers, batch.rows, batch.kv_lens, batch.masks, batch.causal,
                                          batch.chain)
        for i in range(first, last):
            h = self.ragged_layer(i, h, batch)
        return h

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: StepInputs) -> torch.Tensor:
        """q [B, heads, S, D] over the cache's k, v [B, kv_heads, kv_len, D] (read in q's dtype)."""
        k, v = k.to(q.dtype), v.to(q.dtype)
        gqa = self.cfg.num_kv_heads != self.cfg.num_heads
        if gqa and step.mask is not None and self.expand_kv_for_mask:
            groups = self.cfg.num_heads // self.cfg.num_kv_heads
            k, v, gqa = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1), False
        is_causal = step.causal and step.mask is None  # a later part of a prompt reads through its mask
        return F.scaled_dot_product_attention(q, k, v, attn_mask=step.mask, is_causal=is_causal, enable_gqa=gqa)

    def project_kv(self, i: int, h: torch.Tensor, step: StepInputs, cache: KVCache) -> None:
        """Write layer i's K/V for rows h without running the layer (CALM-style propagation)."""
        cfg, w = self.cfg, self.layers[i]
        B, S, _ = h.shape
        D = cfg.head_dim
        x = F.rms_norm(h, (cfg.hidden_size,), w.attn_norm, cfg.rms_norm_eps)
        kv = w.kv(x).view(B, S, 2 * cfg.num_kv_heads, D)
        k = apply_rope(kv[:, :, : cfg.num_kv_heads], step.cos, step.sin)
        cache.k[i].index_copy_(2, step.slots, k.transpose(1, 2).to(cache.k.dtype))
        cache.v[i].index_copy_(2, step.slots, kv[:, :, cfg.num_kv_heads :].transpose(1, 2).to(cache.v.dtype))

    def norm(self, h: torch.Tensor) -> torch.Tensor:
        """The final RMS norm: the C++ layers' own where they run (one call: after a token's weights
        streamed through the caches, ATen's took 85 us of a SmolLM2 token, Intel Xeon), else ATen's."""
        if self.fast_kernels is not None:
            return self.fast_kernels.rms_norm(h, self.final_norm, self.cfg.rms_norm_eps)
        return F.rms_norm(h, (self.cfg.hidden_size,), self.final_norm, self.cfg.rms_norm_eps)

    def lm_head(self, h_normed: torch.Tensor) -> torch.Tensor:
        return self.head(h_normed)

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
