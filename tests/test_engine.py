"""The engine core (scheduler + KV-cache manager + model runner): continuous batching in every mode
it serves, requests joining and leaving without copies, a request lifecycle that isolates bad
requests and aborts, and a memory budget that admission respects."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from checkpoints import make_checkpoint
from ee_helpers import EXIT_MODES
from engine_helpers import DRAFT, LOSSLESS, MODES, PROMPTS, SMALL, drive, mode_llms_for, sequence, solo

from specee import LLM, SamplingParams
from specee.engine.kv_manager import BLOCK_SIZE, KVCacheManager, parse_kv_budget
from specee.engine.sequence import Sequence
from specee.model.kv_cache import ContextLengthError

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine")
    return make_checkpoint(root / "m", SMALL, seed=2), make_checkpoint(root / "d", DRAFT, seed=2)


@pytest.fixture(scope="module")
def llm(checkpoints):
    return LLM(checkpoints[0], dtype="float32", quantization=None)


@pytest.fixture(scope="module", params=[None, "int4"], ids=["float", "int4"])
def mode_llms(request, checkpoints):
    """mode -> LLM for that mode, all on one precision."""
    return mode_llms_for(*checkpoints, request.param)


@pytest.mark.parametrize("mode", [*MODES, *EXIT_MODES])
def test_every_mode_batches_mixed_requests_as_each_decodes_alone(mode_llms, mode):
    """Requests of different lengths, parameters and max_tokens join and leave a running batch, one is
    aborted: each greedy request gets exactly the tokens it gets decoded alone (at full depth and in
    early exit a seeded sampled one too), and in the lossless modes those are full depth's."""
    llm, full = mode_llms[mode], mode_llms["full"]
    greedy = SamplingParams(ignore_eos=True, max_tokens=10)
    seqs = [sequence(llm, PROMPTS[0], greedy),
            sequence(llm, PROMPTS[1], dataclasses.replace(greedy, max_tokens=4)),
            sequence(llm, PROMPTS[2], dataclasses.replace(greedy, max_tokens=12)),
            sequence(llm, PROMPTS[3], dataclasses.replace(greedy, max_tokens=2)),
            sequence(llm, PROMPTS[4], SamplingParams(max_tokens=8, temperature=0.8, seed=3, ignore_eos=True))]
    aborted = sequence(llm, PROMPTS[2], dataclasses.replace(greedy, max_tokens=30))
    drive(llm, {0: [seqs[0], aborted], 2: [seqs[1]], 3: [seqs[2], seqs[3]], 4: [seqs[4]]}, aborts={3: [aborted]})
    assert aborted.finish_reason == "abort" and 1 <= len(aborted.output_ids) < 30
    # a seeded sampled request draws the same tokens in any batch at full depth; under speculation
    # its draws depend on how many drafts each step verified (the gate decides per batch size)
    for s in seqs if mode == "full" or mode in EXIT_MODES else seqs[:4]:
        assert (s.output_ids, s.text, s.finish_reason) == solo(llm, s), s.prompt
    for s in seqs[:4] if mode in LOSSLESS else ():
        assert s.output_ids == solo(full, s)[0], s.prompt
    assert llm.engine.kv.free_blocks == llm.engine.kv.num_blocks  # every request gave its blocks back
    if mode in EXIT_MODES:
        exits = [s.stats.early_exit["exits_accepted"] for s in seqs]  # lossless: many are then rolled back
        assert sum(exits) >= 5, f"the forcing should make passes exit early: {exits}"
    elif mode != "full":
        assert seqs[0].stats.speculative["target_passes"] >= 1


def test_requests_join_and_leave_without_copying_anyones_cache(mode_llms):
    """A running request's cache is a view of the pool that never moves, whoever joins or leaves."""
    llm = mode_llms["ngram"]
    engine, greedy = llm.engine, SamplingParams(ignore_eos=True, max_tokens=12)
    first = sequence(llm, PROMPTS[0], greedy)
    engine.add_request(first)
    engine.step()
    (running,) = engine.scheduler.running
    where = running.cache.k.data_ptr(), running.cache.v.data_ptr(), running.cache.filled.data_ptr()
    pool = engine.kv.k.data_ptr()
    for step in range(10):
        if step in (1, 4):
            engine.add_request(sequence(llm, PROMPTS[1 + step % 3], dataclasses.replace(greedy, max_tokens=3)))
        engine.step()
        assert (running.cache.k.data_ptr(), running.cache.v.data_ptr(), running.cache.filled.data_ptr()) == where
        assert engine.kv.k.data_ptr() == pool
        assert running.cache.k.untyped_storage().data_ptr() == engine.kv.k.untyped_storage().data_ptr()
    while engine.has_unfinished():
        engine.step()
    assert first.output_ids == solo(llm, first)[0]


def test_a_request_that_cannot_run_ends_with_an_error_and_the_others_run_on(llm):
    """A prompt that does not fit the context, added next to a running request, ends with finish_reason
    "error" and its message; the running request never sees it and matches decoding alone."""
    running = sequence(llm, "one", SamplingParams(max_tokens=5, ignore_eos=True))
    llm.engine.add_request(running)
    llm.engine.step()
    bad = Sequence([5] * 250, [5] * 250, SamplingParams(max_tokens=10), llm.tokenizer, llm.eos_ids)
    empty = Sequence([], [], SamplingParams(max_tokens=10), llm.tokenizer, llm.eos_ids)
    llm.engine.add_request(bad)
    llm.engine.add_request(empty)
    finished = llm.engine.step()
    assert bad in finished and empty in finished and running not in finished
    assert bad.finish_reason == "error" and "exceeds the model's context of 256 tokens" in bad.error
    assert empty.finish_reason == "error" and "empty prompt" in empty.error
    assert bad.output().error == bad.error and not bad.output_ids
    while llm.engine.has_unfinished():
        assert bad not in llm.engine.step()  # reported once
    assert running.output_ids == solo(llm, running)[0]
    # the synchronous API refuses it before any work
    with pytest.raises(ContextLengthError, match=r"prompt \(250 tokens\)"):
        llm.generate([[5, 6], [5] * 250], SamplingParams(max_tokens=10))


def test_a_request_id_in_flight_already_is_refused_and_the_first_runs_on(llm):
    """Two requests with one id: the pool's blocks and the engine thread's handles go by id, so the second
    took over the first's blocks (its tokens changed, a block leaked) or left its handle waiting forever."""
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    first = dataclasses.replace(sequence(llm, "one two", params), request_id="x")
    second = dataclasses.replace(sequence(llm, "three", params), request_id="x")
    free = llm.engine.scheduler.kv.free_blocks
    llm.engine.add_request(first)
    llm.engine.step()
    llm.engine.add_request(second)
    assert second in llm.engine.step() and second.finish_reason == "error" and "'x' is already in flight" in second.error
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert first.finish_reason == "length" and first.output_ids == solo(llm, first)[0]
    assert llm.engine.scheduler.kv.free_blocks == free
    # through the engine thread: the duplicate's handle ends with its error, the first's with its tokens
    a, b = (dataclasses.replace(sequence(llm, p, params), request_id="y") for p in ("one two", "three"))
    outs = [h.result(timeout=60) for h in llm.worker.submit_all([a, b])]
    assert outs[0].token_ids == first.output_ids
    assert outs[1].finish_reason == "error" and "'y' is already in flight" in outs[1].error


def test_seeded_sampling_per_request_is_independent_of_the_batch(llm):
    p = SamplingParams(max_tokens=8, temperature=0.9, seed=3, ignore_eos=True)
    params = [p, dataclasses.replace(p, seed=4, top_k=5), dataclasses.replace(p, seed=5, top_p=0.8, max_tokens=5),
              SamplingParams(max_tokens=6, ignore_eos=True)]
    outs = []
    for arrivals in ({0: [0, 1, 2, 3]}, {0: [3], 1: [0], 4: [1, 2]}, {0: [2], 3: [1], 5: [0, 3]}):
        seqs = [sequence(llm, prompt, sp) for prompt, sp in zip(PROMPTS, params)]
        drive(llm, {step: [seqs[i] for i in rows] for step, rows in arrivals.items()})
        outs.append([s.output_ids for s in seqs])
    assert outs[0] == outs[1] == outs[2] == [solo(llm, s)[0] for s in seqs]


def test_a_stop_in_one_row_does_not_disturb_the_others(llm):
    greedy = SamplingParams(max_tokens=12, ignore_eos=True)
    tokens = solo(llm, sequence(llm, PROMPTS[2], greedy))[0]
    eos = sequence(llm, PROMPTS[2], dataclasses.replace(greedy, ignore_eos=False))
    eos.eos_ids = frozenset({tokens[3]})  # its 4th token (or an earlier one like it) ends it
    text = solo(llm, sequence(llm, "one", greedy))[1]
    stop = sequence(llm, "one", dataclasses.replace(greedy, stop=(text[3:6],)))  # a stop string inside its text
    others = [sequence(llm, "two", greedy), sequence(llm, PROMPTS[1], dataclasses.replace(greedy, max_tokens=9))]
    drive(llm, {0: [others[0], eos], 1: [stop, others[1]]})
    assert eos.finish_reason == stop.finish_reason == "stop"
    assert len(eos.output_ids) <= 4 and len(stop.output_ids) < 12
    for s in (eos, stop, *others):
        assert (s.output_ids, s.text, s.finish_reason) == solo(llm, s)


def test_finished_requests_are_reported_once_when_they_finish(llm):
    a = SamplingParams(max_tokens=4, ignore_eos=True)
    seqs = [sequence(llm, "one", a), sequence(llm, "two", dataclasses.replace(a, max_tokens=7)),
            sequence(llm, "three", dataclasses.replace(a, max_tokens=5))]
    finished = drive(llm, {0: seqs})
    # the prefill step gives each its first token, then one step per token
    assert [[s.prompt for s in f] for f in finished] == [[], [], [], ["one"], ["three"], [], ["two"]]
    assert seqs[0].stats.decode_tokens == 3 and seqs[0].stats.prefill_seconds > 0
    assert seqs[0].stats.time_to_first_token is not None and seqs[0].stats.queue_seconds >= 0


def test_five_hundred_requests_against_a_small_budget_all_finish_within_it(checkpoints):
    """The pool holds 192 tokens (4 to 12 of these requests): the rest wait for blocks, none fails, the pool
    never grows, and each request's tokens equal its tokens decoded alone."""
    llm = LLM(checkpoints[0], dtype="float32", quantization=None, kv_cache_memory=4 * 48)
    engine = llm.engine
    capacity, pool = engine.kv.capacity, engine.kv.k.data_ptr()
    g = torch.Generator().manual_seed(0)
    seqs = []
    for i in range(500):
        ids = torch.randint(3, llm.model.cfg.vocab_size, (int(torch.randint(1, 16, (1,), generator=g)),),
                            generator=g).tolist()
        seqs.append(Sequence(ids, ids, SamplingParams(max_tokens=1 + i % 24, ignore_eos=True), llm.tokenizer,
                             llm.eos_ids))
        engine.add_request(seqs[-1])
    most = 0
    while engine.has_unfinished():
        engine.step()
        used = sum(n for _, n in engine.kv.owned.values()) * BLOCK_SIZE
        assert used <= capacity
        most = max(most, len(engine.scheduler.running))
    assert engine.kv.capacity == capacity and engine.kv.k.data_ptr() == pool
    assert all(s.finish_reason == "length" and len(s.output_ids) == s.params.max_tokens for s in seqs)
    assert 2 <= most <= capacity // BLOCK_SIZE  # several at a time (a block each at least), within the budget
    for s in seqs[:: 50]:
        assert s.output_ids == llm.generate([s.prompt_ids], s.params)[0].token_ids


def test_max_num_seqs_bounds_the_running_batch(checkpoints):
    llm = LLM(checkpoints[0], dtype="float32", quantization=None, max_num_seqs=2)
    seqs = [sequence(llm, p, SamplingParams(max_tokens=3, ignore_eos=True)) for p in PROMPTS[:4]]
    for s in seqs:
        llm.engine.add_request(s)
    while llm.engine.has_unfinished():
        llm.engine.step()
        assert len(llm.engine.scheduler.running) <= 2
    assert all(len(s.output_ids) == 3 for s in seqs)
    with pytest.raises(ValueError, match="max_num_seqs"):
        LLM(checkpoints[0], quantization=None, max_num_seqs=0)


@pytest.mark.parametrize("mode", ["full", "ngram"])
def test_warm_up_leaves_nothing_behind(mode_llms, mode):
    """`serve` warms its LLM up before it says ready: one token decoded, then the engine is empty, every
    block free, and the next requests decode exactly as they would have (default quantized path too)."""
    llm = mode_llms[mode]
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (9, 4)]
    prompts = ["The quick brown fox jumps over", "two"]
    before = [o.token_ids for o in llm.generate(prompts, params)]
    llm.warm_up()
    assert not llm.engine.has_unfinished() and llm.engine.kv.free_blocks == llm.engine.kv.num_blocks
    assert [o.token_ids for o in llm.generate(prompts, params)] == before


def test_kv_manager_hands_out_consecutive_runs_and_merges_them_back(llm):
    cfg = llm.model.cfg
    kv = KVCacheManager(cfg, torch.device("cpu"), torch.float32, 10 * BLOCK_SIZE)
    a = kv.allocate("a", 3 * BLOCK_SIZE)
    b = kv.allocate("b", 2 * BLOCK_SIZE + 1)  # rounds up to 3 blocks
    c = kv.allocate("c", 4 * BLOCK_SIZE)
    assert a.max_len == 3 * BLOCK_SIZE and b.max_len == 3 * BLOCK_SIZE and kv.free_blocks == 0
    assert kv.allocate("d", 1) is None  # waits
    kv.free("b")
    assert kv.allocate("d", 4 * BLOCK_SIZE) is None  # 3 free blocks, not 4
    kv.free("a")
    assert kv.free_runs == [(0, 6)]  # merged with its free neighbour
    d = kv.allocate("d", 5 * BLOCK_SIZE)
    assert d is not None and kv.owned["d"] == (0, 5)
    kv.free("c")
    kv.free("d")
    assert kv.free_runs == [(0, 10)] and kv.free_blocks == kv.num_blocks
    del c


@pytest.mark.parametrize("quantization", [None, "int4"], ids=["float", "int4"])
def test_a_new_engine_takes_over_the_last_ones_pool_where_it_fits(checkpoints, quantization):
    """A mode switch builds a new engine on the last one's KV pool (its pages are in already), and
    decodes there as on a fresh pool; a pool of another size, of another dtype, or with a request
    still holding blocks in it is not taken over."""
    llm = LLM(checkpoints[0], dtype="float32", quantization=quantization)
    params = SamplingParams(max_tokens=9, ignore_eos=True)
    prompts = ["The quick brown fox jumps over", "two"]
    full = [o.token_ids for o in llm.generate(prompts, params)]
    pool = llm.engine.kv
    llm.enable_speculative(MODES["ngram"])
    assert llm.engine.kv is pool
    assert [o.token_ids for o in llm.generate(prompts, params)] == full  # greedy n-gram is lossless
    fresh = LLM(checkpoints[0], dtype="float32", quantization=quantization, speculative_config=MODES["ngram"])
    assert fresh.engine.kv is not pool and [o.token_ids for o in fresh.generate(prompts, params)] == full
    pool.allocate("held", 1)
    llm.speculative = None
    assert llm.engine.kv is not pool and llm.engine.kv.free_blocks == llm.engine.kv.num_blocks
    pool.free("held")
    cfg, cpu, dtype = llm.model.cfg, torch.device("cpu"), pool.k.dtype  # float16 K/V on the int4 path
    other = torch.float32 if dtype == torch.float16 else torch.float16
    assert KVCacheManager.reusing(pool, cfg, cpu, dtype, pool.capacity) is pool
    assert KVCacheManager.reusing(pool, cfg, cpu, other, pool.capacity) is not pool
    assert KVCacheManager.reusing(pool, cfg, cpu, dtype, pool.capacity + BLOCK_SIZE) is not pool
    llm.fit_kv_cache(64)
    assert llm.engine.kv.capacity < pool.capacity


def test_kv_budget_is_parsed_from_tokens_or_a_size(llm):
    cfg, dtype = llm.model.cfg, torch.float32
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4 + cfg.num_layers  # K, V and fill flags
    assert parse_kv_budget(1000, cfg, dtype) == 1000
    assert parse_kv_budget("1MiB", cfg, dtype) == (1 << 20) // per_token // 16 * 16  # whole blocks within it
    assert parse_kv_budget("2 GB", cfg, dtype) == (2 << 30) // per_token // 16 * 16
    assert parse_kv_budget(None, cfg, dtype) >= cfg.context_limit
    for bad in ("lots", "-1MiB", "0", "2000TiB", 10**18):  # past 1 PiB: an OverflowError traceback once
        with pytest.raises(ValueError, match="--kv-cache-memory"):
            parse_kv_budget(bad, cfg, dtype)


@pytest.mark.parametrize("chunk", [0, 32])
def test_lossy_early_exit_times_its_prefill_with_every_part(checkpoints, chunk):
    """Its first pass rides on the prompt's last part, and the stats used to say prefill 0 s: the time
    went to decoding (one part), or nowhere (earlier parts)."""
    from ee_helpers import exit_decoding

    llm = LLM(checkpoints[0], dtype="float32", quantization=None, prefill_chunk=chunk)
    llm.early_exit = exit_decoding(llm, EXIT_MODES["exit_recompute"])
    prompt = [3 + i % 50 for i in range(100)]  # 4 parts of 32 rows or more where chunked
    out = llm.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    stats = out.stats
    assert len(out.token_ids) == 6 and stats.decode_tokens == 5  # the first token came with the prefill
    assert stats.prefill_seconds > 0 and stats.decode_seconds > 0
    assert stats.prefill_seconds + stats.decode_seconds <= stats.finish_time - stats.scheduled_time + 1e-3


def test_decode_time_ends_with_the_last_forward_not_when_the_request_is_retired(llm, monkeypatch):
    """It was read when the finished request was settled, after the step's bookkeeping: on a busy
    machine decode and prefill time summed past the request's own wall time."""
    import time

    retire = llm.engine.scheduler.retire

    def slow_retire():
        out = retire()
        time.sleep(0.05)  # what a busy machine's bookkeeping may take
        return out

    monkeypatch.setattr(llm.engine.scheduler, "retire", slow_retire)
    stats = llm.generate([[3, 4, 5, 6]], SamplingParams(max_tokens=3, ignore_eos=True))[0].stats
    assert stats.decode_seconds > 0
    assert stats.prefill_seconds + stats.decode_seconds <= stats.finish_time - stats.scheduled_time + 1e-3


def test_the_default_pool_holds_a_full_context_request_with_its_draft_rows(checkpoints, monkeypatch):
    """Where one context's K/V passes the default 1 GiB, the pool was exactly one context: a request of
    the whole context never fitted beside speculation's draft rows (here: the default made one byte)."""
    import specee.engine.kv_manager as kv_manager

    monkeypatch.setattr(kv_manager, "DEFAULT_KV_MEMORY", 1)
    llm = LLM(checkpoints[0], dtype="float32", quantization=None, speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    limit, extra = llm.model.cfg.context_limit, llm.engine.decoding.extra_rows
    assert extra == 5 and llm.engine.kv.capacity >= limit + extra
    prompt = [3, 4, 5, 6]
    out = llm.generate([prompt], SamplingParams(max_tokens=limit - len(prompt), ignore_eos=True))[0]
    assert len(out.token_ids) == limit - len(prompt) and out.finish_reason == "length"


@pytest.mark.parametrize("budget", ["1MiB", "1GiB"])
def test_a_byte_budget_bounds_the_pool_with_its_fill_flags(checkpoints, budget):
    """Tokens were rounded up to whole blocks and the fill flags not counted: 1 MiB made a 1,105,920-byte pool."""
    from specee.engine.kv_manager import size_bytes

    kv = LLM(checkpoints[0], dtype="float32", quantization=None, kv_cache_memory=budget).engine.kv
    pool = kv.k.nbytes + kv.v.nbytes + kv.filled.nbytes
    per_block = pool // kv.num_blocks
    assert size_bytes(budget) - per_block < pool <= size_bytes(budget)


def test_a_kv_pool_that_cannot_be_allocated_names_the_flag(checkpoints):
    with pytest.raises(ValueError, match=r"the KV cache pool of \d+ tokens \(.* GiB\) cannot be allocated .*--kv-cache-memory"):
        LLM(checkpoints[0], dtype="float32", quantization=None, kv_cache_memory="100TiB")  # was "[Errno 12] ..." alone


def test_kv_cache_memory_flag(capsys):
    """--kv-cache-memory sizes the pool from the command line: a bad value is one line before any
    work; a pool too small for the request is refused with the flag named; a fitting one serves."""
    from conftest import real_model_dir

    from specee import cli

    stories = str(real_model_dir("stories260K"))
    base = ["generate", "--model", stories, "--prompt", "Once", "--no-chat", "--max-new-tokens", "8"]
    assert cli.main([*base, "--kv-cache-memory", "lots"]) == 2
    assert "--kv-cache-memory: 'lots' is not a token count or a size" in capsys.readouterr().err
    for huge in ("0", "0GiB", "99999999999999999999GiB", str(10**20)):  # huge: a traceback after loading once
        assert cli.main([*base, "--kv-cache-memory", huge]) == 2
        assert "--kv-cache-memory: " in capsys.readouterr().err
    assert cli.main([*base, "--max-new-tokens", "40", "--kv-cache-memory", "5"]) == 2  # one block: 16 slots
    assert "raise kv_cache_memory (--kv-cache-memory)" in capsys.readouterr().err
    assert cli.main([*base, "--kv-cache-memory", "1MiB"]) == 0
    assert "8 tokens" in capsys.readouterr().err


def test_kv_cache_dtype_is_float16_where_row_attention_reads_it_else_the_compute_dtype(checkpoints, capsys):
    """auto: float16 on the C++ layer's AVX-512 path (the same memory then holds twice the tokens),
    the compute dtype on the Python layer and below AVX-512; a bad choice names its flag before any work."""
    from specee import cli
    from specee.cli.args import KV_CACHE_DTYPES as CLI_CHOICES
    from specee.model import kernels
    from specee.model.kv_cache import KV_CACHE_DTYPES

    assert CLI_CHOICES == KV_CACHE_DTYPES
    float_llm = LLM(checkpoints[0], dtype="float32", quantization=None, kv_cache_memory="1MiB")
    assert float_llm.model.kv_dtype == torch.float32 and float_llm.engine.kv.k.dtype == torch.float32
    kernel = kernels.cpu_kernels()
    if kernel is None:
        pytest.skip("the C++ kernels could not be built here (no compiler)")
    fast = kernel.row_attention_available(float_llm.model.cfg.head_dim)
    quantized = LLM(checkpoints[0], quantization="int4", kv_cache_memory="1MiB")
    assert quantized.model.kv_dtype == (torch.float16 if fast else torch.float32)
    assert quantized.engine.kv.k.dtype == quantized.model.kv_dtype
    if fast:
        assert quantized.engine.kv.capacity >= 2 * float_llm.engine.kv.capacity - 16  # one block of rounding
        before = kernels.use_level("portable")
        try:
            assert LLM(checkpoints[0], quantization="int4").model.kv_dtype == torch.float32  # ATen reads it there
        finally:
            kernels.use_level(before)
    forced = LLM(checkpoints[0], quantization="int4", kv_cache_dtype="float32")
    assert forced.model.kv_dtype == torch.float32
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    assert len(forced.generate(["Tom and his friend went"], params)[0].token_ids) == 12
    with pytest.raises(ValueError, match=r"kv_cache_dtype \(--kv-cache-dtype\)"):
        LLM(checkpoints[0], kv_cache_dtype="int8")
    assert cli.main(["generate", "--model", str(checkpoints[0]), "--prompt", "x", "--kv-cache-dtype", "int8"]) == 2
    assert "--kv-cache-dtype" in capsys.readouterr().err
