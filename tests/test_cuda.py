"""Every mode on a GPU (skipped without one; CI has none): the engine core's modes give the CPU's
greedy tokens, lossless early exit gives full depth's, and the GPU cost benchmark runs with one host
read per engine step. Run on a lent GPU with `python -m pytest -q -m cuda`."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from checkpoints import Variant, make_checkpoint
from ee_helpers import EXIT_MODES, AllTokensDrafter, constant_bank, decoder, exit_decoding, random_forcing, run

from specee import LLM, SamplingParams
from specee.calibration import calibrate
from specee.drafters import DraftModelDrafter, NGramDrafter
from specee.engine import cuda_graphs

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (CI has none)")]

SMALL = Variant("cuda3", "llama", dict(num_hidden_layers=3, num_key_value_heads=2), vocab_padding=8)
DRAFT = Variant("cuda-draft", "llama", dict(num_hidden_layers=1, num_key_value_heads=2), vocab_padding=8)
CONFIGS = [None, {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2},
           {"method": "draft_model", "num_speculative_tokens": 3},
           {"method": "draft_model", "num_speculative_tokens": 2, "tree": {"topk": 2, "size": 4}}]
PROMPTS = ["one", "The quick brown fox jumps over the lazy dog", "Tom and his friend went", "two"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("cuda")
    return make_checkpoint(root / "m", SMALL, seed=2), make_checkpoint(root / "d", DRAFT, seed=2)


@pytest.mark.parametrize("config", CONFIGS, ids=["full", "ngram", "draft_model", "draft_tree"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_engine_mode_on_cuda(checkpoints, config, dtype):
    target, draft = checkpoints
    if config is not None and config["method"] == "draft_model":
        config = {**config, "model": str(draft)}
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (12, 5, 9, 3)]
    cuda = LLM(target, device="cuda", dtype=dtype, speculative_config=config)
    full = LLM(target, device="cuda", dtype=dtype)
    together = [o.token_ids for o in cuda.generate(PROMPTS, params)]
    assert not torch.backends.cuda.cudnn_sdp_enabled()  # its per-length plans cost ~90 ms a decode step
    if config is None or config["method"] == "draft_model" and "tree" not in config:  # decode rows, chains
        assert cuda.engine.runner.graphs.replays > 0
    assert together == [o.token_ids for o in full.generate(PROMPTS, params)]  # lossless, batched
    if dtype == "float32":
        cpu = LLM(target, dtype="float32", quantization=None)
        assert together == [o.token_ids for o in cpu.generate(PROMPTS, params)]


def test_a_long_prompt_prefills_in_parts_on_cuda_with_the_tokens_of_one_pass(checkpoints):
    """Chunked prefill on the GPU (parts of 32 rows, each reading the earlier parts through its mask)
    beside requests that decode meanwhile: every request's tokens equal those of whole prefills."""
    prompts = [" ".join(PROMPTS * 6), *PROMPTS]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    parts = LLM(checkpoints[0], device="cuda", dtype="float32", prefill_chunk=32)
    assert len(parts.encode(prompts[0])) >= 96
    whole = LLM(checkpoints[0], device="cuda", dtype="float32", prefill_chunk=0)
    assert [o.token_ids for o in parts.generate(prompts, params)] == [o.token_ids for o in whole.generate(prompts, params)]


def test_lossless_early_exit_on_cuda_equals_full_depth(checkpoints):
    llm = LLM(checkpoints[0], device="cuda", dtype="float32")
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    ids = llm.encode("Once upon a time")
    full = llm.generate([ids], params)[0].token_ids
    dec = decoder(llm, AllTokensDrafter(llm.model.cfg.vocab_size, llm.model.device), kv_policy="recompute",
                  mode="lossless", max_pending=3)
    seq, _ = run(llm, dec, ids, params, random_forcing(seed=0, rate=0.5))
    assert seq.output_ids == full


@pytest.mark.parametrize("mode", list(EXIT_MODES))
def test_every_early_exit_mode_batches_on_cuda(checkpoints, mode):
    """Early exit (each KV policy, lossless, exits in verification) in one batch on the GPU: each
    request's tokens equal its tokens alone there, and the lossless modes give full depth's."""
    llm = LLM(checkpoints[0], device="cuda", dtype="float32")
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (12, 5, 9, 3)]
    full = [o.token_ids for o in llm.generate(PROMPTS, params)]
    llm.early_exit = exit_decoding(llm, EXIT_MODES[mode])
    together = [o.token_ids for o in llm.generate(PROMPTS, params)]
    assert together == [llm.generate(p, sp)[0].token_ids for p, sp in zip(PROMPTS, params)]
    if "lossless" in mode:
        assert together == full


@pytest.mark.parametrize("drafter", ["ngram", "draft_model"])
def test_production_drafters_and_predictors_on_cuda(checkpoints, drafter):
    """The shipped drafters and real predictor MLPs (every layer firing) on the GPU: lossless early
    exit in one batch gives full depth's tokens, and calibration runs there."""
    target, draft = checkpoints
    llm = LLM(target, device="cuda", dtype="float32")
    dev, V, L = llm.model.device, llm.model.cfg.vocab_size, llm.model.cfg.num_layers
    make = (lambda: NGramDrafter(4, V, dev)) if drafter == "ngram" else (
        lambda: DraftModelDrafter(draft, llm.tokenizer, 4, dev, torch.float32))
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (12, 5, 9, 3)]
    full = [o.token_ids for o in llm.generate(PROMPTS, params)]
    llm.early_exit = decoder(llm, make(), constant_bank(L, 4, [0.0] * L), mode="lossless", max_pending=3)
    out = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in out] == full
    assert all(o.stats.early_exit["predictor_calls"] > 0 for o in out)  # the predictors ran
    bank = calibrate(llm.model, llm.tokenizer, make(), [llm.encode(p) for p in PROMPTS], max_new_tokens=8,
                     min_exits=1, train_steps=5, folds=2, progress=False)
    assert bank.to("cpu").num_layers == L


def test_gpu_cost_benchmark_reads_the_host_once_per_step():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import gpu_cost

    report = gpu_cost.main(["--device", "cuda", "--shape", "tiny", "--tokens", "8", "--repeats", "3"])
    assert all(d["host_reads_per_step"] == 1.0 for d in report["decode"])


def test_cuda_graphs_replay_decode_steps_with_the_eager_tokens(checkpoints, monkeypatch):
    """Decode steps replayed from CUDA graphs (engine/cuda_graphs.py) give the tokens of the same steps
    launched one kernel at a time: a batch whose requests finish at different steps (new keys), a
    request whose cache crosses buckets of slots mid-decode, and one alone at the batch's place."""
    monkeypatch.setattr(cuda_graphs, "BUCKET", 64)
    llm = LLM(checkpoints[0], device="cuda", dtype="float32")
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (200, 7, 40, 3)]
    graphed = [o.token_ids for o in llm.generate(PROMPTS, params)]
    alone = llm.generate(PROMPTS[0], params[0])[0].token_ids
    graphs = llm.engine.runner.graphs
    assert graphs.replays > 180 and len(graphs.graphs) >= 4
    llm.engine.runner.graphs = None
    assert graphed == [o.token_ids for o in llm.generate(PROMPTS, params)]
    assert alone == graphed[0]
