"""Runs that grow as requests decode, and requests parked out of a full pool: a request's first run holds
FIRST_ROOM new tokens (not its whole max_tokens), so a pool serves more requests at once; memory then
decides only when a request's tokens come, never which."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from checkpoints import make_checkpoint
from ee_helpers import EXIT_MODES
from engine_helpers import DRAFT, LOSSLESS, MODES, PROMPTS, SMALL, mode_llms_for, sequence, solo

from specee import SamplingParams
from specee.engine import scheduler
from specee.engine.engine import Engine
from specee.engine.kv_manager import BLOCK_SIZE, KVCacheManager

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module", params=[None, "int4"], ids=["float", "int4"])
def mode_llms(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("growth")
    return mode_llms_for(make_checkpoint(root / "m", SMALL, seed=2), make_checkpoint(root / "d", DRAFT, seed=2),
                         request.param)


def pool(blocks: int) -> KVCacheManager:
    cfg = SimpleNamespace(num_layers=2, num_kv_heads=1, head_dim=4)  # what the pool's shape reads
    return KVCacheManager(cfg, torch.device("cpu"), torch.float32, blocks * BLOCK_SIZE)


def fill(kv: KVCacheManager, cache, value: float) -> None:
    cache.k.fill_(value)
    cache.v.fill_(-value)
    cache.filled[:, :, ::2] = True
    cache.length = 5


def test_a_run_grows_in_place_moves_with_its_own_rows_and_parks_exactly():
    kv = pool(8)
    a, b = kv.allocate("a", BLOCK_SIZE), kv.allocate("b", BLOCK_SIZE)
    fill(kv, a, 1.0)
    fill(kv, b, 2.0)
    b_storage = b.k.data_ptr()
    assert kv.grow("b", b, 3 * BLOCK_SIZE) and kv.owned["b"] == (1, 3)  # the blocks after it were free
    assert b.k.data_ptr() == b_storage and b.max_len == 3 * BLOCK_SIZE and b.length == 5
    assert (b.k[:, :, :, :BLOCK_SIZE] == 2).all() and (b.k[:, :, :, BLOCK_SIZE:] == 0).all()
    assert not b.filled[:, :, BLOCK_SIZE:].any()
    before = b.k.clone(), b.v.clone(), b.filled.clone()
    assert kv.grow("a", a, 2 * BLOCK_SIZE) and kv.owned["a"] == (4, 2)  # b follows it: a moves, with its rows
    assert (a.k[:, :, :, :BLOCK_SIZE] == 1).all() and (a.v[:, :, :, :BLOCK_SIZE] == -1).all()
    assert (a.k[:, :, :, BLOCK_SIZE:] == 0).all() and a.filled[:, :, :BLOCK_SIZE:2].all()
    assert a.pool_slot == 4 * BLOCK_SIZE and kv.free_runs == [(0, 1), (6, 2)]
    assert b.k.data_ptr() == b_storage and all(torch.equal(x, y) for x, y in zip(before, (b.k, b.v, b.filled)))
    assert not kv.grow("a", a, 5 * BLOCK_SIZE)  # no run of 5 free blocks: it stays as it was
    assert kv.owned["a"] == (4, 2) and (a.k[:, :, :, :BLOCK_SIZE] == 1).all()
    saved = kv.park("b", b, b.length)  # 5 slots written: one block leaves the pool
    assert saved[0].shape[3] == BLOCK_SIZE
    assert "b" not in kv.owned and kv.free_blocks == 6
    assert kv.grow("a", a, 5 * BLOCK_SIZE) and kv.owned["a"] == (0, 5)  # with the free blocks either side
    assert (a.k[:, :, :, :BLOCK_SIZE] == 1).all() and (a.k[:, :, :, BLOCK_SIZE:] == 0).all()
    assert a.filled[:, :, :BLOCK_SIZE:2].all() and not a.filled[:, :, BLOCK_SIZE:].any()
    assert kv.free_runs == [(5, 3)] and not kv.restore("b", b, saved, 4 * BLOCK_SIZE)  # 3 free blocks, not 4
    kv.free("a")
    assert kv.restore("b", b, saved, 4 * BLOCK_SIZE) and kv.owned["b"] == (0, 4)
    n = 3 * BLOCK_SIZE
    assert all(torch.equal(x, y) for x, y in zip((b.k[:, :, :, :n], b.v[:, :, :, :n], b.filled[:, :, :n]), before))
    assert (b.k[:, :, :, 3 * BLOCK_SIZE:] == 0).all() and b.length == 5
    kv.free("b")
    assert kv.free_runs == [(0, 8)]


def test_a_run_moves_onto_blocks_it_held_with_its_rows_intact():
    """Its own run with the free block before it: the copy overlaps the rows it reads (blocks 1-2 to 0-1)."""
    kv = pool(5)
    kv.allocate("x", BLOCK_SIZE)
    a = kv.allocate("a", 2 * BLOCK_SIZE)
    kv.allocate("y", BLOCK_SIZE)
    a.k[:, :, :, :] = torch.arange(2 * BLOCK_SIZE, dtype=torch.float32)[:, None]  # every slot its own value
    a.filled[:, :, :BLOCK_SIZE + 3] = True
    kv.free("x")
    assert kv.grow("a", a, 3 * BLOCK_SIZE) and kv.owned["a"] == (0, 3) and a.pool_slot == 0
    assert torch.equal(a.k[0, 0, 0, : 2 * BLOCK_SIZE, 0], torch.arange(2 * BLOCK_SIZE, dtype=torch.float32))
    assert (a.k[:, :, :, 2 * BLOCK_SIZE:] == 0).all() and a.filled[0, 0].tolist() == [True] * (BLOCK_SIZE + 3) + [
        False] * (2 * BLOCK_SIZE - 3)
    assert kv.free_runs == [(4, 1)]


@pytest.mark.parametrize("mode", [*MODES, *EXIT_MODES])
def test_requests_grow_and_park_in_a_small_pool_and_decode_as_alone(mode_llms, mode, monkeypatch):
    """Five requests of 20-26 new tokens in a pool that holds about two of them whole: runs start with 2
    new tokens and grow, the newest request is parked when one cannot grow and comes back before any
    newcomer, and each greedy request (a seeded sampled one too where its draws do not depend on the
    batch) gets exactly the tokens it gets alone, on the float and the quantized C++ path."""
    llm, full = mode_llms[mode], mode_llms["full"]
    greedy = SamplingParams(ignore_eos=True, max_tokens=24)
    seqs = [sequence(llm, PROMPTS[0], greedy), sequence(llm, PROMPTS[1], dataclasses.replace(greedy, max_tokens=20)),
            sequence(llm, PROMPTS[2], dataclasses.replace(greedy, max_tokens=26)), sequence(llm, PROMPTS[3], greedy),
            sequence(llm, PROMPTS[4], SamplingParams(max_tokens=22, temperature=0.8, seed=3, ignore_eos=True))]
    alone = [solo(llm, s)[:2] for s in seqs]  # each run whole from the start (FIRST_ROOM holds all 26 tokens)
    monkeypatch.setattr(scheduler, "FIRST_ROOM", 2)
    engine = Engine(llm.model, llm.engine.decoding, kv_cache_memory=7 * BLOCK_SIZE)
    for s in seqs:
        engine.add_request(s)
    parked = grown = 0
    while engine.has_unfinished():
        engine.step()
        parked = max(parked, len(engine.scheduler.parked))
        grown = max([grown] + [n for _, n in engine.kv.owned.values()])
    assert parked >= 1 and grown >= 3  # requests were parked, and runs grew past their first block or two
    assert all(s.finish_reason == "length" and len(s.output_ids) == s.params.max_tokens for s in seqs)
    assert engine.kv.free_blocks == engine.kv.num_blocks
    for s, expected in list(zip(seqs, alone))[: 5 if mode == "full" or mode in EXIT_MODES else 4]:
        assert (s.output_ids, s.text) == expected, s.prompt
    for s, expected in zip(seqs[:4] if mode in LOSSLESS else (), alone):
        assert s.output_ids == expected[0] == solo(full, s)[0], s.prompt


def test_a_parked_request_aborted_ends_and_the_others_decode_as_alone(mode_llms, monkeypatch):
    """Aborting a parked request ends it (its rows were out of the pool already, nothing to free); the
    others run on to the tokens they get alone, and the pool ends empty."""
    monkeypatch.setattr(scheduler, "FIRST_ROOM", 2)
    llm = mode_llms["full"]
    engine = Engine(llm.model, llm.engine.decoding, kv_cache_memory=5 * BLOCK_SIZE)
    params = SamplingParams(ignore_eos=True, max_tokens=40)
    seqs = [sequence(llm, p, params) for p in (PROMPTS[0], PROMPTS[3], PROMPTS[2])]
    for s in seqs:
        engine.add_request(s)
    while not engine.scheduler.parked:
        engine.step()
    victim = engine.scheduler.parked[0].seq
    engine.abort(victim)
    while engine.has_unfinished():
        engine.step()
    assert victim.finish_reason == "abort" and not engine.scheduler.parked and not engine.kv.owned
    engine.kv.drop_prompts()  # cached prompts aside, every block is free
    assert engine.kv.free_runs == [(0, engine.kv.num_blocks)]
    for s in seqs:
        if s is not victim:
            assert s.finish_reason == "length" and s.output_ids == solo(llm, s)[0]



def test_a_request_whose_parking_would_pass_the_swap_space_ends_with_an_error(mode_llms, monkeypatch):
    """With room in host memory for one parked request's rows and no more, the request a second park
    would take ends with finish_reason "error" naming swap_space; the others decode as they do alone,
    the parked one included, and every block comes back."""
    monkeypatch.setattr(scheduler, "FIRST_ROOM", 2)
    llm = mode_llms["full"]
    one = KVCacheManager(llm.model.cfg, llm.model.device, llm.model.kv_dtype, BLOCK_SIZE)
    block_bytes = one.park_bytes(one.allocate("x", BLOCK_SIZE), BLOCK_SIZE)
    params = SamplingParams(ignore_eos=True, max_tokens=40)
    seqs = [sequence(llm, p, params) for p in (PROMPTS[0], PROMPTS[3], PROMPTS[2], PROMPTS[1])]
    engine = Engine(llm.model, llm.engine.decoding, kv_cache_memory=6 * BLOCK_SIZE,
                    swap_space=3.5 * block_bytes / 2**30)  # one request's 2-3 written blocks, not two requests'
    for s in seqs:
        engine.add_request(s)
    parked = 0
    while engine.has_unfinished():
        engine.step()
        parked = max(parked, len(engine.scheduler.parked))
        assert engine.scheduler._parked_bytes() <= engine.scheduler.swap_space
    failed = [s for s in seqs if s.finish_reason == "error"]
    assert parked == 1 and 1 <= len(failed) <= 2, [s.finish_reason for s in seqs]
    assert all("swap_space (--swap-space" in s.error and "kv_cache_memory" in s.error for s in failed)
    engine.kv.drop_prompts()  # cached prompts aside, every block is free
    assert engine.kv.free_runs == [(0, engine.kv.num_blocks)] and not engine.kv.owned
    for s in seqs:
        if s.finish_reason != "error":
            assert s.finish_reason == "length" and s.output_ids == solo(llm, s)[0]


@pytest.mark.parametrize("gib", [-1, float("nan"), "4", True])
def test_a_bad_swap_space_is_refused_before_loading(gib, tmp_path):
    from specee import LLM

    with pytest.raises(ValueError, match=r"swap_space \(--swap-space\)"):
        LLM(tmp_path / "no-model", swap_space=gib)


def test_an_early_exit_draft_models_cache_grows_as_the_request_decodes(mode_llms, tmp_path, monkeypatch):
    """It was sized for max_tokens at the start, outside the pool (a server's requests without max_tokens:
    a whole context each); now for the target's first run (it doubles as it fills), with the same tokens
    as a cache sized for max_tokens. (Not full depth's: lossy early exit prefills all but the last prompt
    token, whose row a CPU with AMX computes in other arithmetic than a prompt's rows.)"""
    import torch
    from ee_helpers import constant_bank, decoder

    from specee.drafters import DraftModelDrafter
    from specee.engine import early_exit

    llm = mode_llms["full"]
    drafter = DraftModelDrafter(make_checkpoint(tmp_path / "d", DRAFT, seed=2), llm.tokenizer, k=4, device="cpu",
                                dtype=torch.float32)

    proposals, propose = [], type(drafter).propose  # what the draft model proposes at each checked pass
    monkeypatch.setattr(type(drafter), "propose", lambda self: (t := propose(self), proposals.append(t.tolist()))[0])

    def decode(first_room: int):
        proposals.clear()
        monkeypatch.setattr(early_exit, "FIRST_ROOM", first_room)
        never = constant_bank(llm.model.cfg.num_layers, drafter.k, [0.6] * llm.model.cfg.num_layers)  # asked, never fires
        engine = Engine(llm.model, decoder(llm, drafter, never, max_pending=3))
        seq = sequence(llm, PROMPTS[1], SamplingParams(ignore_eos=True, max_tokens=40))
        engine.add_request(seq)
        engine.step()
        cache = engine.scheduler.running[0].state.drafter
        first = cache._cache.max_len
        while engine.has_unfinished():
            engine.step()
        return seq, first, cache, list(proposals)

    seq, first, cache, grown = decode(8)
    whole, whole_first, _, sized = decode(4096)
    assert first == len(seq.prompt_ids) + 8 < cache._n <= cache._cache.max_len and first < whole_first
    assert len(grown) >= 5 and grown == sized  # the draft model's candidates at every checked pass
    assert seq.output_ids == whole.output_ids and seq.finish_reason == whole.finish_reason == "length"


def test_a_run_that_cannot_grow_moves_the_next_run_aside_rather_than_parking():
    """A [0,2) needs a third block; N [2,4), the newest, follows it; [4,6) is free; W holds [6,8). Parking N
    let A grow, and N came straight back into [4,6) in the same schedule(): its rows went to host memory
    and back. Now N moves to [4,6) in the pool and nobody is parked."""
    from specee.engine.scheduler import Running, Scheduler

    kv = pool(8)
    s = Scheduler(kv, 4096, 0, 64, 2048, 0, lambda q: len(q.prompt_ids), swap_space=1 << 30, prefix_caching=False)

    def running(name: str, admitted: int, length: int) -> Running:
        seq = SimpleNamespace(prompt_ids=[1] * 8, params=SamplingParams(max_tokens=100), output_ids=[0] * (length - 8),
                              request_id=name, finished=False)
        cache = kv.allocate(name, 2 * BLOCK_SIZE)
        cache.length = length
        cache.k[:] = admitted + 1
        r = Running(seq, cache, None, prefilled=True, admitted=admitted)
        s.running.append(r)
        return r

    a, gone, n, w = (running("A", 0, 2 * BLOCK_SIZE - 1), running("Y", 1, 10), running("N", 2, 10),
                     running("W", 3, 10))
    s.running.remove(gone)
    kv.free("Y")
    kv.free("N")
    s.running.remove(n)
    n = running("N", 4, 10)  # now [2,4), after A's run; [4,6) free
    assert kv.owned["N"] == (2, 2) and kv.free_runs == [(4, 2)]
    assert s.schedule() == [a, w, n] and not s.parked
    assert kv.owned["A"][0] == 0 and kv.owned["A"][1] >= 3 and kv.owned["N"] == (4, 2)
    assert (n.cache.k == 5).all() and (a.cache.k[:, :, :, : 2 * BLOCK_SIZE] == 1).all()


def test_a_request_that_went_wrong_leaves_zeros_not_its_rows():
    """Its rows may hold NaN, which a graphed CUDA step reads between its own runs (masked, but 0 x NaN is
    NaN); a request that finished well leaves its rows (prompt rows may be kept for the prefix cache)."""
    from specee.engine.scheduler import Running, Scheduler

    kv = pool(4)
    s = Scheduler(kv, 4096, 0, 64, 2048, 0, lambda q: len(q.prompt_ids), swap_space=0, prefix_caching=False)
    for name, reason in (("bad", "error"), ("good", "length")):
        seq = SimpleNamespace(prompt_ids=[1] * 8, request_id=name, finished=True, finish_reason=reason)
        cache = kv.allocate(name, 2 * BLOCK_SIZE)
        cache.k.fill_(float("nan"))
        cache.v.fill_(float("nan"))
        s.running.append(Running(seq, cache, None, prefilled=True))
    bad, good = (r.cache for r in s.running)
    s.retire()
    assert (bad.k == 0).all() and (bad.v == 0).all() and good.k.isnan().all()
    assert kv.free_runs == [(0, 4)] and not kv.owned
