"""Prefix caching: a finished request's prompt rows stay in the KV pool, and a later prompt that starts
with the same whole blocks prefills only the rest, with the tokens a whole prefill gives, in every mode
on the float and the quantized C++ path."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from checkpoints import make_checkpoint
from conftest import real_model_dir
from ee_helpers import EXIT_MODES
from engine_helpers import DRAFT, MODES, PROMPTS, SMALL, mode_llms_for, sequence

from specee import LLM, SamplingParams
from specee.engine.engine import Engine
from specee.engine.kv_manager import BLOCK_SIZE, KVCacheManager
from specee.engine.prefix_cache import block_hashes
from specee.engine.scheduling import MIN_PROMPT_PART

pytestmark = pytest.mark.usefixtures("single_thread")

LONG = " ".join(PROMPTS[1:] * 3)  # 100-odd tokens: several whole blocks


@pytest.fixture(scope="module", params=[None, "int4"], ids=["float", "int4"])
def mode_llms(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("prefix")
    return mode_llms_for(make_checkpoint(root / "m", SMALL, seed=2), make_checkpoint(root / "d", DRAFT, seed=2),
                         request.param)


def decode(engine: Engine, seqs: list) -> list:
    for s in seqs:
        engine.add_request(s)
    while engine.has_unfinished():
        engine.step()
    return seqs


@pytest.mark.parametrize("mode", [*MODES, *EXIT_MODES])
def test_prompts_start_from_cached_rows_with_the_tokens_of_a_whole_prefill(mode_llms, mode):
    """A prompt, the same prompt again, a longer one that starts alike (a chat's next turn), then two of
    them together: each gets the tokens it gets on an engine without the cache (a seeded sampled one
    too); from the second on they start after the first one's cached blocks, leaving at least
    MIN_PROMPT_PART rows to prefill, except where the decoding reads the prompt's features (EAGLE)."""
    llm = mode_llms[mode]
    greedy = SamplingParams(ignore_eos=True, max_tokens=10)
    sampled = SamplingParams(ignore_eos=True, max_tokens=10, temperature=0.8, seed=5)
    asks = [(LONG, greedy), (LONG, sampled), (LONG + " and then the end", greedy),
            (LONG + " or", greedy), (LONG + " and then more", greedy)]  # (speculation's draws depend on the batch)
    plain = Engine(llm.model, llm.engine.decoding, kv_cache_memory=64 * BLOCK_SIZE, enable_prefix_caching=False)
    expected = [decode(plain, [sequence(llm, p, params)])[0] for p, params in asks]
    cached = Engine(llm.model, llm.engine.decoding, kv_cache_memory=64 * BLOCK_SIZE)
    got = [decode(cached, [sequence(llm, p, params)])[0] for p, params in asks[:3]]
    got += decode(cached, [sequence(llm, p, params) for p, params in asks[3:]])  # together
    for s, e in zip(got, expected):
        if s.params.temperature and mode in MODES and mode != "full":
            continue  # speculation's draws depend on whether its gate drafted, which timing decides
        assert (s.output_ids, s.text, s.finish_reason) == (e.output_ids, e.text, e.finish_reason), (mode, s.prompt)
    hits = [s.stats.cached_tokens for s in got]
    if llm.engine.decoding.feature_layers:
        assert hits == [0] * 5
        return
    assert hits[0] == 0 and all(hits[1:]), hits
    for s, hit in zip(got, hits):
        assert hit % BLOCK_SIZE == 0 and len(s.prompt_ids) - hit >= MIN_PROMPT_PART
    assert all(s.stats.prefill_seconds > 0 for s in got)
    assert cached.kv.free_blocks == cached.kv.num_blocks and not cached.kv.owned


def pool(blocks: int) -> KVCacheManager:
    cfg = SimpleNamespace(num_layers=2, num_kv_heads=1, head_dim=4)  # what the pool's shape reads
    return KVCacheManager(cfg, torch.device("cpu"), torch.float32, blocks * BLOCK_SIZE)


def written(kv: KVCacheManager, owner: str, tokens: int, value: float):
    cache = kv.allocate(owner, tokens)
    cache.k[:, :, :, :tokens] = value
    cache.v[:, :, :, :tokens] = -value
    cache.filled[:, :, :tokens] = True
    return cache


def keep(kv: KVCacheManager, owner: str, tokens: list[int]) -> None:
    kv.keep(owner, tokens, block_hashes(tokens))


def match(kv: KVCacheManager, tokens: list[int], limit: int = 1000):
    return kv.prefixes.match(tokens, block_hashes(tokens), limit)


def test_kept_prompt_blocks_are_copied_in_exactly_and_given_up_least_recently_used_first():
    kv = pool(10)
    a = list(range(40))  # 2 whole blocks and 8 tokens
    written(kv, "a", 48, 1.0)
    keep(kv, "a", a)
    assert [p.blocks for p in kv.prefixes.prompts] == [2] and kv.free_blocks == 10 and not kv.owned
    assert match(kv, a[:15]) is None and match(kv, [1] + a[1:]) is None  # no whole first block alike
    cached, blocks = match(kv, a + [7])
    assert blocks == 2 and match(kv, a, BLOCK_SIZE + 3)[1] == 1  # at most `limit` tokens
    assert match(kv, a[:16] + [0] * 16)[1] == 1  # the first block alike, the second not
    c = kv.allocate("c", 3 * BLOCK_SIZE, (cached, 2))
    assert (c.k[:, :, :, : 2 * BLOCK_SIZE] == 1).all() and (c.v[:, :, :, : 2 * BLOCK_SIZE] == -1).all()
    assert c.filled[:, :, : 2 * BLOCK_SIZE].all() and not c.filled[:, :, 2 * BLOCK_SIZE:].any()
    assert (c.k[:, :, :, 2 * BLOCK_SIZE:] == 0).all()
    kv.free("c")
    keep(kv, "b", [])  # nothing held: a no-op
    written(kv, "b", 16, 2.0)
    keep(kv, "b", [9] * 16)  # a second prompt, more recently used
    written(kv, "d", 32, 3.0)
    keep(kv, "d", a[:32])  # the first prompt holds these blocks already: not kept twice
    assert [p.blocks for p in kv.prefixes.prompts] == [2, 1]
    match(kv, a)  # the first prompt is used again: the second goes first
    big = kv.allocate("e", 8 * BLOCK_SIZE)
    assert big is not None and [p.tokens[:1] for p in kv.prefixes.prompts] == [[0]] and match(kv, [9] * 16) is None
    assert match(kv, a)[1] == 2  # still found after the other's eviction
    assert kv.allocate("f", 2 * BLOCK_SIZE, match(kv, a)) is None  # only room without the prompt it copies
    assert kv.allocate("f", 2 * BLOCK_SIZE) is not None and not kv.prefixes.prompts and not kv.prefixes.by_key
    kv.free("e")
    kv.free("f")
    assert kv.free_runs == [(0, 10)]


def test_a_prompt_that_holds_all_of_a_cached_one_takes_its_place():
    """A chat's next turn starts with the last turn's prompt: kept, it serves both, and the last turn's blocks
    go back to the pool instead of being held twice; a prompt that only shares a first block leaves the
    other as it was."""
    kv = pool(12)
    turn1, turn2 = list(range(32)), list(range(32)) + [7] * 40
    written(kv, "t1", 40, 1.0)
    keep(kv, "t1", turn1)
    written(kv, "other", 32, 2.0)
    keep(kv, "other", turn1[:16] + [5] * 16)  # shares the first block only
    written(kv, "t2", 80, 3.0)
    keep(kv, "t2", turn2)
    assert sorted(p.blocks for p in kv.prefixes.prompts) == [2, 4]
    assert kv.prefixes.blocks == 6 and sum(n for _, n in kv.free_runs) == 6 and match(kv, turn1 + [1])[1] == 2 and match(kv, turn1[:16] + [5] * 16)[1] == 2
    cached, blocks = match(kv, turn1 + [1])
    c = kv.allocate("c", 3 * BLOCK_SIZE, (cached, blocks))
    assert cached.tokens == turn2[: 4 * BLOCK_SIZE] and (c.k[:, :, :, : 2 * BLOCK_SIZE] == 3).all()


def test_a_shared_first_block_stays_found_when_the_prompt_that_indexed_it_goes():
    kv = pool(6)
    head = list(range(16))
    written(kv, "a", 32, 1.0)
    keep(kv, "a", head + [1] * 16)
    written(kv, "b", 32, 2.0)
    keep(kv, "b", head + [2] * 16)  # the newer: the shared block's key points here
    match(kv, head + [1] * 16)  # a is the most recently used: b goes first
    assert kv.allocate("c", 3 * BLOCK_SIZE) is not None and len(kv.prefixes.prompts) == 1
    assert match(kv, head + [3] * 16)[1] == 1 and match(kv, head + [1] * 16)[1] == 2


def test_a_run_grows_into_blocks_cached_prompts_gave_up():
    kv = pool(4)
    run = written(kv, "a", 16, 1.0)
    written(kv, "p", 16, 2.0)
    keep(kv, "p", list(range(16)))  # block 1, right after a's run
    assert kv.grow("a", run, 4 * BLOCK_SIZE) and not kv.prefixes.prompts and kv.owned["a"] == (0, 4)
    assert (run.k[:, :, :, :BLOCK_SIZE] == 1).all() and (run.k[:, :, :, BLOCK_SIZE:] == 0).all()


def test_without_prefix_caching_nothing_is_kept(mode_llms):
    llm = mode_llms["full"]
    engine = Engine(llm.model, llm.engine.decoding, kv_cache_memory=64 * BLOCK_SIZE, enable_prefix_caching=False)
    seqs = decode(engine, [sequence(llm, LONG, SamplingParams(max_tokens=2)) for _ in range(2)])
    assert [s.stats.cached_tokens for s in seqs] == [0, 0] and not engine.kv.prefixes.prompts


def test_a_served_chat_turn_reports_the_cached_prompt_tokens_and_decodes_as_without_the_cache():
    pytest.importorskip("fastapi", reason="the server extra (pip install 'specee[server]') is not installed")
    pytest.importorskip("openai", reason="the openai client (requirements-ci.txt) is not installed")
    from server_helpers import LiveServer

    from specee.server import create_app

    model = real_model_dir("stories260K")
    server = LiveServer(create_app(LLM(model, dtype="float32"), model_name="stories"))
    story = "Once upon a time there was a little girl who loved to play in the park with her dog and her ball. " * 3
    try:
        client = server.client()
        first = client.completions.create(model="stories", prompt=story, max_tokens=8, temperature=0)
        second = client.completions.create(model="stories", prompt=story + first.choices[0].text + " Then",
                                           max_tokens=16, temperature=0)
        cached = second.usage.prompt_tokens_details.cached_tokens
        assert first.usage.prompt_tokens_details.cached_tokens == 0 and cached >= 3 * BLOCK_SIZE
        assert server.metric("specee:prefix_cache_hits_total") == cached
        assert server.metric("specee:prefix_cache_queries_total") == first.usage.prompt_tokens + second.usage.prompt_tokens
    finally:
        server.stop()
    reference = LLM(model, dtype="float32", enable_prefix_caching=False)
    out = reference.generate([story + first.choices[0].text + " Then"], SamplingParams(max_tokens=16, temperature=0))
    assert out[0].text == second.choices[0].text


def test_a_server_without_prefix_caching_counts_no_lookups():
    pytest.importorskip("fastapi", reason="the server extra (pip install 'specee[server]') is not installed")
    pytest.importorskip("openai", reason="the openai client (requirements-ci.txt) is not installed")
    from server_helpers import LiveServer

    from specee.server import create_app

    model = real_model_dir("stories260K")
    server = LiveServer(create_app(LLM(model, dtype="float32", enable_prefix_caching=False), model_name="stories"))
    try:
        out = server.client().completions.create(model="stories", prompt="Once upon a time", max_tokens=4, temperature=0)
        assert out.usage.prompt_tokens > 0 and server.metric("specee:prompt_tokens_total") == out.usage.prompt_tokens
        assert server.metric("specee:prefix_cache_queries_total") == 0
        assert server.metric("specee:prefix_cache_hits_total") == 0
    finally:
        server.stop()


def test_the_command_line_turns_prefix_caching_off():
    from specee.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["serve"]).enable_prefix_caching is True
    assert parser.parse_args(["serve", "--no-enable-prefix-caching"]).enable_prefix_caching is False
    with pytest.raises(TypeError, match="enable_prefix_caching"):
        LLM("no-such-model", enable_prefix_caching="yes")


def test_prompts_give_up_only_the_cached_blocks_in_the_way_least_recently_used_stretch_first():
    """Forty one-block prompts fill the pool, used in a scattered order: a run of three gives up three of
    them, the stretch whose newest is oldest (it gave up prompts one at a time, least recently used
    first, until three happened to lie together: most of the cache)."""
    kv = pool(40)
    prompts = [[i] * BLOCK_SIZE for i in range(40)]
    for i, tokens in enumerate(prompts):
        written(kv, f"r{i}", BLOCK_SIZE, 1.0)
    for i, tokens in enumerate(prompts):
        keep(kv, f"r{i}", tokens)
    order = torch.randperm(40, generator=torch.Generator().manual_seed(0)).tolist()
    for i in order:
        match(kv, prompts[i])
    assert kv.allocate("new", 3 * BLOCK_SIZE) is not None and len(kv.prefixes) == 37
    start = kv.owned["new"][0]
    ranks = {i: order.index(i) for i in range(40)}
    worst = min(max(ranks[j] for j in range(s, s + 3)) for s in range(38))
    assert max(ranks[j] for j in range(start, start + 3)) == worst


def test_a_request_aborted_after_a_step_raised_keeps_nothing(mode_llms, monkeypatch):
    """The engine thread aborts every request when a step raises (worker.py); the prompt part that step was
    to write was never written, so nothing of it may be kept for later prompts."""
    llm = mode_llms["full"]
    engine = Engine(llm.model, llm.engine.decoding, kv_cache_memory=64 * BLOCK_SIZE, prefill_chunk=32)
    seq = sequence(llm, LONG, SamplingParams(max_tokens=2))
    engine.add_request(seq)
    engine.step()  # its first part
    monkeypatch.setattr(engine.runner, "forward", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError):
        engine.step()
    engine.abort(seq)
    assert seq.finish_reason == "abort" and not engine.kv.prefixes.prompts and not engine.kv.owned


def test_aborting_a_finished_request_leaves_a_newer_one_of_the_same_id_its_cache(mode_llms):
    llm = mode_llms["full"]
    engine = Engine(llm.model, llm.engine.decoding, kv_cache_memory=64 * BLOCK_SIZE)
    old = decode(engine, [sequence(llm, LONG, SamplingParams(max_tokens=2))])[0]
    new = sequence(llm, LONG + " again", SamplingParams(max_tokens=2))
    new.request_id = old.request_id
    engine.add_request(new)
    engine.abort(old)  # a stale handle: it finished already
    decode(engine, [])
    assert old.finish_reason == "length" and new.finish_reason == "length" and new.stats.cached_tokens > 0


def test_touching_the_pool_writes_only_its_free_blocks():
    """A server writes its whole pool before it is ready (LLM.warm_up): runs that move on through the pool as
    prompts stay cached then find their pages in; a request's rows and a cached prompt's stay as they are."""
    kv = pool(6)
    kv.k.fill_(float("nan"))
    kv.v.fill_(float("nan"))
    owned = written(kv, "a", 16, 1.0)
    written(kv, "p", 16, 2.0)
    keep(kv, "p", list(range(16)))
    kv.touch()
    assert (owned.k == 1).all() and (kv.k[:, :, :, BLOCK_SIZE : 2 * BLOCK_SIZE] == 2).all()
    assert (kv.k[:, :, :, 2 * BLOCK_SIZE :] == 0).all() and (kv.v[:, :, :, 2 * BLOCK_SIZE :] == 0).all()
    assert kv.free_runs == [(2, 4)] and len(kv.prefixes) == 1
