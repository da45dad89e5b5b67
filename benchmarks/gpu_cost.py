"""What decoding costs on a GPU, on a random-weight Llama-2-7B-shaped model (nothing to download).

Reports, for the engine core on the device and dtype given:
  - full-depth decode tokens/s through the engine with 1 and 8 requests (greedy, EOS ignored), on
    CUDA both with decode steps replayed from CUDA graphs (engine/cuda_graphs.py) and without;
  - host reads per engine step (every tensor read back: one per step is the design);
  - a verification pass over 1, 2, 4 and 8 chain rows, each as a ratio of one row;
  - the exit predictors' cost per checked layer (features + MLP + the decision's read).

    python benchmarks/gpu_cost.py --device cuda                  # Llama-2-7B shape, bfloat16
    python benchmarks/gpu_cost.py --device cpu --shape tiny      # the same code, small (tests run this)
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from specee.bench.timing import count_host_reads
from specee.engine.engine import Engine
from specee.engine.runner import Segment, run_checks
from specee.engine.sequence import Sequence
from specee.exit.bank import PredictorBank
from specee.exit.controller import ExitController
from specee.exit.features import num_features
from specee.model.config import ModelConfig
from specee.model.llama import Transformer
from specee.sampling import SamplingParams

SHAPES = {  # Llama-2-7B, and a small shape with the same structure
    "7b": dict(hidden=4096, intermediate=11008, layers=32, heads=32, kv_heads=32, vocab=32000, context=4096),
    "tiny": dict(hidden=256, intermediate=512, layers=4, heads=4, kv_heads=2, vocab=512, context=512),
}


def random_model(shape: str, device: torch.device, dtype: torch.dtype, seed: int = 0) -> Transformer:
    s = SHAPES[shape]
    D = s["hidden"] // s["heads"]
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=s["vocab"], hidden_size=s["hidden"],
                      intermediate_size=s["intermediate"], num_layers=s["layers"], num_heads=s["heads"],
                      num_kv_heads=s["kv_heads"], head_dim=D, rms_norm_eps=1e-5, rope_theta=10000.0,
                      rope_type="default", rope_scaling=None, max_position_embeddings=s["context"],
                      tie_word_embeddings=False, qkv_bias=False, o_bias=False, sliding_window=None,
                      checkpoint_dtype="bfloat16", bos_token_id=1, eos_token_ids=(2,))
    g = torch.Generator(device=device).manual_seed(seed)

    def rnd(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=g, device=device, dtype=dtype) * (1 / math.sqrt(size[-1]))

    H, I, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_kv_heads * D
    tensors = {"model.embed_tokens.weight": rnd(cfg.vocab_size, H), "model.norm.weight": torch.ones(H, device=device,
                                                                                                     dtype=dtype),
               "lm_head.weight": rnd(cfg.vocab_size, H)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        tensors.update({p + "input_layernorm.weight": torch.ones(H, device=device, dtype=dtype),
                        p + "post_attention_layernorm.weight": torch.ones(H, device=device, dtype=dtype),
                        p + "self_attn.q_proj.weight": rnd(H, H), p + "self_attn.k_proj.weight": rnd(kv, H),
                        p + "self_attn.v_proj.weight": rnd(kv, H), p + "self_attn.o_proj.weight": rnd(H, H),
                        p + "mlp.gate_proj.weight": rnd(I, H), p + "mlp.up_proj.weight": rnd(I, H),
                        p + "mlp.down_proj.weight": rnd(H, I)})
    return Transformer(cfg, tensors, device, dtype, Path(f"random-{shape}"))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def engine_decode(model: Transformer, requests: int, prompt: int, tokens: int, graphs: bool = True) -> dict:
    """Decode tokens/s (aggregate) and host reads per step of `requests` concurrent requests; graphs:
    whether decode steps replay CUDA graphs (engine/cuda_graphs.py; on CUDA) or launch each kernel."""
    engine = Engine(model, kv_cache_memory=requests * (prompt + tokens + 16))
    if not graphs:
        engine.runner.graphs = None
    quiet = SimpleNamespace(decode=lambda ids: "")  # no text is needed
    g = torch.Generator().manual_seed(1)
    seqs = [Sequence([], torch.randint(3, model.cfg.vocab_size, (prompt,), generator=g).tolist(),
                     SamplingParams(max_tokens=tokens, ignore_eos=True), quiet, frozenset()) for _ in range(requests)]
    for s in seqs:
        engine.add_request(s)
    engine.step()  # the prefills
    sync(model.device)
    steps, t0 = 0, time.perf_counter()
    with count_host_reads() as reads:
        while engine.has_unfinished():
            engine.step()
            steps += 1
    sync(model.device)
    seconds = time.perf_counter() - t0
    decoded = sum(len(s.output_ids) - 1 for s in seqs)
    return {"requests": requests, "graphs": engine.runner.graphs is not None,
            "tokens_per_second": round(decoded / seconds, 2),
            "host_reads_per_step": round(sum(reads.values()) / max(steps, 1), 2)}


@torch.inference_mode()
def verification_cost(model: Transformer, prompt: int, repeats: int) -> dict:
    """Seconds of a pass over 1, 2, 4, 8 chain rows after a `prompt`-token prefill, and ratios to 1 row."""
    engine = Engine(model, kv_cache_memory=prompt + 32)
    cache = engine.kv.allocate("probe", prompt + 16)
    dev = model.device
    ids = torch.randint(3, model.cfg.vocab_size, (prompt + 8,), device=dev)
    engine.runner.forward([Segment(ids[:prompt], cache, model.range_inputs(0, prompt))])
    out = {}
    for rows in (1, 2, 4, 8):
        seg = Segment(ids[prompt:prompt + rows], cache, model.range_inputs(prompt, rows))
        engine.runner.forward([seg])  # warm-up
        sync(dev)
        t0 = time.perf_counter()
        for _ in range(repeats):
            engine.runner.forward([seg])
        sync(dev)
        out[rows] = (time.perf_counter() - t0) / repeats
    return {"seconds": {r: round(t, 6) for r, t in out.items()},
            "ratio_to_one_row": {r: round(t / out[1], 3) for r, t in out.items()}}


@torch.inference_mode()
def predictor_cost(model: Transformer, repeats: int, k: int = 4, hidden: int = 16) -> dict:
    """Seconds per checked layer for one row: features, the layer's MLP and the decision's host read."""
    L, dev = model.cfg.num_layers, model.device
    bank = PredictorBank(torch.randn(L, num_features(k), hidden), torch.zeros(L, hidden), torch.randn(L, hidden),
                         torch.zeros(L), [math.inf] * L, list(range(L - 1)), k, "random", "random")
    exits = ExitController(model, bank, bank.thresholds)
    h = torch.randn(1, model.cfg.hidden_size, device=dev, dtype=model.dtype)
    exits.begin_pass(torch.arange(k, device=dev)[None], torch.empty(0, dtype=torch.long, device=dev), 0)
    run_checks({0: exits.check(L // 2, h, h)})
    sync(dev)
    t0 = time.perf_counter()
    for _ in range(repeats):
        run_checks({0: exits.check(L // 2, h, h)})
    sync(dev)
    return {"seconds_per_check": round((time.perf_counter() - t0) / repeats, 6)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--shape", default="7b", choices=sorted(SHAPES))
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default=None, help="write the report as JSON here")
    args = ap.parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    model = random_model(args.shape, device, dtype)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    report = {"device": name, "dtype": args.dtype, "shape": args.shape,
              "decode": [engine_decode(model, n, args.prompt, args.tokens, graphs)
                         for graphs in ((True, False) if device.type == "cuda" else (False,)) for n in (1, 8)],
              "verification": verification_cost(model, args.prompt, args.repeats),
              "predictors": predictor_cost(model, args.repeats)}
    print(json.dumps(report, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
