"""Time y = x W^T for SmolLM2-135M's linear shapes, float and weight-only quantized kernels,
then one decode step of a SmolLM2-135M-shaped model in each weight format.

    python benchmarks/bench_kernels.py [--threads 2 1] [--rows 1 4 8] [--shapes head] [--no-decode]
    python benchmarks/bench_kernels.py --no-kernels --model SmolLM2-135M-Instruct.Q4_1.gguf --modes float auto int4 int8

Prints milliseconds per product (median of repeats) for float32, bfloat16, int8 per channel
(`_weight_int8pack_mm`), int4 group 32/64 (`_weight_int4pack_mm_for_cpu`) with bf16 activations,
int4 with float32 activations and scales, int4 as specee's Int4Linear calls it from a float32
model (cast to bf16 and back around each product), and torchao's int8 weight-only when torchao
imports. Each product reads the next of several copies of the weight (at least --cold-mb of
float32 in all), so weights come from memory as in a model, not from cache. Random weights:
the kernels' speed does not depend on the values.

The decode section times `decode_step` + LM head of a random SmolLM2-135M-shaped Transformer
(float32 / int8 / int4 weights; the model in float32, whose activations the quantized linears
cast to bf16 and back, or the whole model in bf16) and prints tokens/s and bytes read per token.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specee.engine.full_depth import decode_step  # noqa: E402
from specee.model.config import ModelConfig  # noqa: E402
from specee.model.gguf_blocks import GGUFWeight  # noqa: E402
from specee.model.llama import Transformer  # noqa: E402
from specee.model.quant import Int4Linear, Int8Linear  # noqa: E402

SHAPES = {  # name: (out, in) of SmolLM2-135M's linears, fused as specee runs them
    "qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "head": (49152, 576),
}


def time_ms(fn, min_time: float = 0.15, repeats: int = 5) -> float:
    fn()
    n, t0 = 1, time.perf_counter()
    fn()
    one = max(time.perf_counter() - t0, 1e-6)
    n = max(1, int(min_time / repeats / one))
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        samples.append((time.perf_counter() - t0) / n)
    return 1e3 * statistics.median(samples)


def torchao_int8(w: torch.Tensor):
    try:
        from torchao.quantization import Int8WeightOnlyConfig, quantize_
    except Exception as e:  # noqa: BLE001 - any import failure means "not available here"
        return None, f"torchao unavailable ({type(e).__name__})"
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False).to(torch.bfloat16)
    lin.weight.data.copy_(w)
    quantize_(lin, Int8WeightOnlyConfig())
    return lin, ""


def variant(label: str, w: torch.Tensor):
    """One kernel on one weight copy: a function of x."""
    i4mm = torch.ops.aten._weight_int4pack_mm_for_cpu
    if label == "float32":
        return lambda x: F.linear(x, w)
    if label == "bfloat16":
        w_bf = w.to(torch.bfloat16)
        return lambda x: F.linear(x.to(torch.bfloat16), w_bf)
    if label == "int8 (bf16 act)":
        i8 = Int8Linear.from_float(w)
        return lambda x: torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), i8.qweight, i8.scales)
    if label.startswith("int4 g"):
        g = int(label[6:8])
        i4 = Int4Linear.from_float(w, group=g)
        if "f32 act" in label:
            sz = i4.scales_and_zeros.float()
            return lambda x: i4mm(x, i4.packed, g, sz)
        return lambda x: i4mm(x.to(torch.bfloat16), i4.packed, g, i4.scales_and_zeros)
    if label == "Int4Linear g32 from f32":
        return Int4Linear.from_float(w, group=32)
    if label == "Int8Linear from f32":
        return Int8Linear.from_float(w)
    ao8, _ = torchao_int8(w)
    return lambda x: ao8(x.to(torch.bfloat16))


LABELS = ["float32", "bfloat16", "int8 (bf16 act)", "int4 g32 (bf16 act)", "int4 g64 (bf16 act)",
          "int4 g32 (f32 act)", "Int4Linear g32 from f32", "Int8Linear from f32", "torchao int8 (bf16 act)"]


def rotating(fns: list):
    """Call the next copy each time, so no copy is still in cache when it is read again."""
    state = {"i": 0}

    def call(x):
        state["i"] = (state["i"] + 1) % len(fns)
        return fns[state["i"]](x)
    return call


def smollm2_shaped(dtype: torch.dtype, quantization: str | None) -> Transformer:
    """A random-weight Transformer with SmolLM2-135M's config (30 layers, 576 hidden, tied 49152 vocab)."""
    cfg = ModelConfig.from_dict({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
        "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0, "max_position_embeddings": 2048, "tie_word_embeddings": True})
    H, I, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, H), "model.norm.weight": (H,)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (cfg.num_heads * D, H), p + "self_attn.k_proj.weight": (cfg.num_kv_heads * D, H),
                       p + "self_attn.v_proj.weight": (cfg.num_kv_heads * D, H), p + "self_attn.o_proj.weight": (H, cfg.num_heads * D),
                       p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H), p + "mlp.down_proj.weight": (H, I),
                       p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,)})
    tensors = {n: (torch.randn(s) * s[-1] ** -0.5 if len(s) == 2 else torch.ones(s)) for n, s in shapes.items()}
    return Transformer(cfg, tensors, torch.device("cpu"), dtype, Path("smollm2-shaped"), quantization)


def bytes_read_per_token(model: Transformer) -> int:
    """Bytes a decode step reads: every linear's kernel operands, the norms, one embedding row
    (the whole table when it is the float head). Not read: the int4 head's plain nibbles (kept
    for row gathers), int4 kv copies (project_kv only), [N, G] scale copies."""
    def operands(lin) -> list[torch.Tensor]:
        if isinstance(lin, Int4Linear):
            return [t for t in (lin.packed, lin.scales_and_zeros, lin.bias) if t is not None]
        return lin.tensors()
    emb = model.embedding
    if isinstance(emb, GGUFWeight):  # the file's blocks: one row's bytes
        total = emb.data[0].nbytes
    else:
        total = emb[0].numel() * emb.element_size() if getattr(model.head, "weight", None) is not emb else 0
    for t in [model.final_norm, *operands(model.head)]:
        total += t.numel() * t.element_size()
    for w in model.layers:
        for t in [w.attn_norm, w.mlp_norm] + [t for lin in (w.qkv, w.o, w.gate_up, w.down) for t in operands(lin)]:
            total += t.numel() * t.element_size()
    return total


def decode_section(threads_list: list[int], model_path: str | None, modes: list[str], context: int = 128,
                   steps: int = 16) -> None:
    what = model_path or "a SmolLM2-135M-shaped model (random weights)"
    print(f"\ndecode step of {what}, batch 1, {context} tokens of context: ms per token, tokens/s, MB read per token")
    for dtype in (torch.float32, torch.bfloat16):
        for mode in [None if m == "float" else m for m in modes]:
            model = Transformer.load(model_path, "cpu", dtype, mode) if model_path else smollm2_shaped(dtype, mode)
            cache = model.new_cache(1, context + steps + 1)
            cache.length = context
            cache.mark_filled(slice(None), slice(0, context))
            tok = torch.zeros(1, dtype=torch.long)

            def step():
                n = cache.length
                model.logits(decode_step(model, cache, tok, torch.tensor([n])))
                cache.length = n if cache.length >= context + steps else cache.length
            for threads in threads_list:
                torch.set_num_threads(threads)
                with torch.inference_mode():
                    ms = time_ms(step, min_time=1.0)
                print(f"  {str(dtype)[6:]:9s} {mode or 'float':6s} {threads} thread(s): {ms:7.2f} ms  "
                      f"{1e3 / ms:6.1f} tok/s  {bytes_read_per_token(model) / 1e6:6.1f} MB/token")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[2, 1])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--cold-mb", type=float, default=128, help="float32 MB of weight copies cycled through (default 128)")
    ap.add_argument("--no-decode", action="store_true", help="skip the decode-step section")
    ap.add_argument("--no-kernels", action="store_true", help="skip the per-kernel section")
    ap.add_argument("--model", default=None, help="decode a real checkpoint (directory or .gguf) instead of random weights")
    ap.add_argument("--modes", nargs="+", default=["float", "int8", "int4"], choices=["float", "int8", "int4", "auto"])
    args = ap.parse_args()
    torch.manual_seed(0)
    labels = LABELS if torchao_int8(torch.zeros(16, 32))[0] is not None else LABELS[:-1]
    if len(labels) < len(LABELS):
        print(f"torchao int8 skipped: {torchao_int8(torch.zeros(16, 32))[1]}")
    for name in [] if args.no_kernels else args.shapes:
        N, K = SHAPES[name]
        copies = max(2, int(args.cold_mb * 1e6 / (N * K * 4)))
        weights = [torch.randn(N, K) * K ** -0.5 for _ in range(copies)]
        fns = {label: rotating([variant(label, w) for w in weights]) for label in labels}
        for threads in args.threads:
            torch.set_num_threads(threads)
            print(f"\n{name} {K}->{N}, {threads} thread(s), {copies} copies cycled: ms per product (x rows)")
            print(f"{'kernel':28s}" + "".join(f"{r:>9d}" for r in args.rows) + "   vs f32 @1")
            base = None
            with torch.inference_mode():
                for label, fn in fns.items():
                    ms = [time_ms(lambda: fn(x)) for x in (torch.randn(r, K) for r in args.rows)]
                    base = base or ms[0]
                    print(f"{label:28s}" + "".join(f"{m:9.3f}" for m in ms) + f"   {base / ms[0]:5.2f}x")
        del weights, fns
    if not args.no_decode:
        decode_section(args.threads, args.model, args.modes)


if __name__ == "__main__":
    main()
