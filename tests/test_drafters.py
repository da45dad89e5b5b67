"""Drafters: the draft model's proposals equal a plain full forward; the n-gram drafter's rules."""
import random
from pathlib import Path

import pytest
import torch

from specee.drafters import DraftModelDrafter, DrafterMismatchError, NGramDrafter, check_same_tokenizer
from specee.drafters.base import Draft
from specee.engine.full_depth import prefill
from specee.sampling import SamplingParams
from specee.tokenizer import Tokenizer

SHARED = Path(__file__).resolve().parents[2] / "shared"
MODELS = SHARED / "models"
TARGET, DRAFT, STORIES = MODELS / "ref-target-24L", MODELS / "ref-draft-4L", MODELS / "stories260K"
needs_models = pytest.mark.skipif(not (DRAFT.exists() and TARGET.exists() and STORIES.exists()),
                                  reason=f"shared models not found under {MODELS} (../shared is absent)")

# tiny models: one torch thread (see conftest.single_thread; two stall each other on a busy 2-core box)
pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def target_tok():
    return Tokenizer(TARGET)


@pytest.fixture(scope="module")
def drafter(target_tok):
    # max_len 8: the cache must grow on demand
    return DraftModelDrafter(DRAFT, target_tok, k=4, device="cpu", dtype=torch.float32, max_len=8)


@torch.inference_mode()
def reference_logits(model, history: list[int]) -> torch.Tensor:
    """A plain full forward of the draft model over the whole history, fresh cache."""
    cache = model.new_cache(1, len(history))
    return model.logits(prefill(model, cache, [history]))[0]


def assert_same_top_k(got: torch.Tensor, ref_logits: torch.Tensor, k: int) -> None:
    ref = ref_logits.topk(k).indices
    assert got.dtype == torch.long and got.shape == (k,) and len(set(got.tolist())) == k
    if not torch.equal(got, ref):  # only a float near-tie may reorder: the logits must match
        torch.testing.assert_close(ref_logits[got], ref_logits[ref], atol=1e-4, rtol=0)


@needs_models
def test_draft_model_matches_full_forward_each_step_and_after_truncate(drafter, target_tok):
    prompt = target_tok.encode("The cat sat on the mat and looked at")
    d = drafter
    d.reset(prompt)
    history = list(prompt)
    for _ in range(6):  # greedy: follow the drafter's own first choice
        top = d.propose()
        assert_same_top_k(top, reference_logits(d.model, history), d.k)
        tok = int(top[0])
        d.advance(tok)
        history.append(tok)
    # several tokens consumed before one propose (one multi-token forward at an offset)
    for tok in (11, 42, 7):
        d.advance(tok)
        history.append(tok)
    assert_same_top_k(d.propose(), reference_logits(d.model, history), d.k)
    assert d.history == history
    # rollback inside the generated part, then continue differently
    d.truncate(len(history) - 4)
    history = history[:-4]
    assert_same_top_k(d.propose(), reference_logits(d.model, history), d.k)
    d.advance(99)
    history.append(99)
    assert_same_top_k(d.propose(), reference_logits(d.model, history), d.k)
    # rollback into the prompt, and a truncate right after an advance (no forward wasted)
    d.truncate(3)
    history = history[:3]
    d.advance(5)
    d.truncate(3)
    assert_same_top_k(d.propose(), reference_logits(d.model, history), d.k)
    assert d._cache.max_len >= len(prompt) + 6  # grew from max_len=8


@needs_models
def test_teacher_forced_top_k_equals_step_by_step(drafter, target_tok):
    ids = target_tok.encode("Once upon a time there was a little robot who wanted to learn how to paint.")
    start = 5
    tf = drafter.teacher_forced_top_k(ids, start)
    assert tf.shape == (len(ids) - start, drafter.k)
    drafter.reset(ids[:start])
    for j, p in enumerate(range(start, len(ids))):
        step = drafter.propose()
        if not torch.equal(step, tf[j]):
            ref = reference_logits(drafter.model, ids[:p])
            torch.testing.assert_close(ref[step], ref[tf[j]], atol=1e-4, rtol=0)
        drafter.advance(ids[p])
    assert drafter.teacher_forced_top_k(ids, len(ids)).shape == (0, drafter.k)


@needs_models
def test_draft_model_slides_past_its_context(drafter, target_tok):
    ids = target_tok.encode("one two three four five six seven eight nine ten " * 4)[:40]
    d = drafter
    d.context = 24  # pretend the draft's context is short
    try:
        d.reset(ids[:10], max_new_tokens=4)
        for t in ids[10:]:
            d.advance(t)
            top = d.propose()
        assert d._offset > 0  # the window moved: the proposal is the draft's view of the last tokens
        assert_same_top_k(top, reference_logits(d.model, ids[d._offset:]), d.k)
        d.truncate(5)  # before the window: rebuilt from the history
        assert_same_top_k(d.propose(), reference_logits(d.model, ids[:5]), d.k)
    finally:
        d.context = d.model.cfg.max_position_embeddings


@needs_models
def test_tokenizer_mismatch_refused(target_tok):
    with pytest.raises(DrafterMismatchError) as e:
        DraftModelDrafter(STORIES, target_tok, k=4)
    msg = str(e.value)
    assert "8192" in msg and "512" in msg and "stories260K" in msg
    check_same_tokenizer(target_tok, Tokenizer(DRAFT), TARGET, DRAFT)  # the reference pair is fine


@needs_models
def test_draft_model_fingerprint_and_identity(drafter):
    from specee.model.weights import fingerprint_weights

    assert drafter.fingerprint == fingerprint_weights(DRAFT)
    assert drafter.k == 4 and "ref-draft-4L" in drafter.name


# ---- n-gram drafter ---------------------------------------------------------------------------
def test_ngram_longest_suffix_then_frequency_fill():
    d = NGramDrafter(k=3, vocab_size=100, max_ngram=3)
    assert d.fingerprint == "ngram-n3"
    d.reset([1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3, 4, 9, 1, 2])
    d.advance(3)
    # [1,2,3] was followed by 4 (twice) and 5 (once); then the most frequent tokens: 1, 2, 3
    # (4 times each, 3 the most recent)
    assert d.propose().tolist() == [4, 5, 3]


def test_ngram_recency_breaks_ties_and_shorter_suffixes_fill():
    d = NGramDrafter(k=3, vocab_size=100, max_ngram=2)
    d.reset([7, 8, 6, 7, 9, 5, 7])
    # [5,7] never seen before; [7] was followed by 8 and 9 once each: 9 is more recent
    # then the most frequent token (7, three times)
    assert d.propose().tolist() == [9, 8, 7]
    d.advance(9)
    # [7,9] -> 5; [9] -> 5; then frequency: 7 (3x), then 9 (2x)
    assert d.propose().tolist() == [5, 7, 9]


def test_ngram_fills_with_distinct_ids_when_history_is_short():
    d = NGramDrafter(k=4, vocab_size=10)
    d.reset([5])
    assert d.propose().tolist() == [5, 0, 1, 2]
    d.reset([0, 0, 0])
    top = d.propose().tolist()
    assert top[0] == 0 and len(set(top)) == 4


def test_ngram_truncate_and_teacher_forcing():
    hist = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4]
    d = NGramDrafter(k=4, vocab_size=16, max_ngram=3)
    d.reset(hist[:12])
    for t in hist[12:]:
        d.advance(t)
    d.truncate(14)
    fresh = NGramDrafter(k=4, vocab_size=16, max_ngram=3)
    fresh.reset(hist[:14])
    assert d.propose().tolist() == fresh.propose().tolist()
    assert d.history == hist[:14]
    tf = d.teacher_forced_top_k(hist, 6)
    assert tf.shape == (len(hist) - 6, 4)
    fresh.reset(hist[:6])
    for j, p in enumerate(range(6, len(hist))):
        assert fresh.propose().tolist() == tf[j].tolist()
        fresh.advance(hist[p])
    assert d.history == hist[:14]  # teacher forcing did not touch the request state


def test_frequency_shortlist_ranks_by_count_then_lowest_id():
    from specee.drafters import frequency_shortlist

    seqs = [[5, 5, 5, 2, 9], [9, 9, 7, 42, 2]]  # counts: 5:3, 9:3, 2:2, 7:1; 42 is out of range
    assert frequency_shortlist(seqs, 10, 3).tolist() == [2, 5, 9]
    assert frequency_shortlist(seqs, 10, 5).tolist() == [0, 2, 5, 7, 9]  # then unseen ids, lowest first
    assert frequency_shortlist([], 4, 4).tolist() == [0, 1, 2, 3]
    for bad in (0, 11):
        with pytest.raises(ValueError, match="shortlist size"):
            frequency_shortlist(seqs, 10, bad)


@needs_models
def test_restricted_draft_proposes_the_best_of_its_shortlist(drafter, target_tok):
    d = drafter
    prompt = target_tok.encode("The little dog ran to the park and saw")
    d.reset(prompt)
    full_top = d.propose().tolist()
    # a shortlist without the draft's favourite: the proposal must be the best k of the rest
    short = torch.tensor(sorted(set(range(0, 8192, 3)) - {full_top[0]} | {full_top[1]}))
    try:
        d.restrict_vocab(short)  # after a proposal: the pending one is redone under the new head
        assert d.shortlist is not None and torch.equal(d.shortlist, short)
        history = list(prompt)
        for _ in range(3):
            top = d.propose()
            ref = reference_logits(d.model, history)
            best = short[ref[short].topk(d.k).indices]
            assert set(top.tolist()) <= set(short.tolist()) and full_top[0] not in top.tolist()
            torch.testing.assert_close(ref[top], ref[best], atol=1e-4, rtol=0)  # equal up to near-ties
            d.advance(int(top[0]))
            history.append(int(top[0]))
        tf = d.teacher_forced_top_k(history, len(prompt))
        assert set(tf.flatten().tolist()) <= set(short.tolist())
        for bad, match in ((torch.tensor([1, 2]), ">= k=4"), (torch.tensor([1, 1, 2, 3]), "distinct"),
                           (torch.tensor([1, 2, 3, 9000]), r"\[0, 8192\)")):
            with pytest.raises(ValueError, match=match):
                d.restrict_vocab(bad)
    finally:
        d.restrict_vocab(None)
    assert d.shortlist is None
    from specee.calibration.exit_data import record_calibration

    with pytest.raises(ValueError, match="exceeds the draft's vocabulary"):  # refused before any work
        record_calibration(d.model, target_tok, d, ["hello"], draft_vocab=9000, progress=False)
    d.reset(prompt)
    assert d.propose().tolist() == full_top


@needs_models
def test_draft_model_cache_is_sized_to_the_request_not_the_targets_context(real_llm):
    """A draft model for early exit starts small and is sized per request (prompt + max tokens), never
    to the target's whole context (2048 here; 128k-context targets would cost gigabytes up front)."""
    llm = real_llm("ref-target-24L")
    drafter = llm.make_drafter(str(MODELS / "ref-draft-4L"), 4)
    context = llm.model.cfg.max_position_embeddings
    assert drafter._cache.max_len < context
    prompt = llm.encode("Tell me about the sea.", chat=True)
    drafter.reset(prompt, 900)
    assert len(prompt) + 900 <= drafter._cache.max_len < context


@needs_models
@pytest.mark.parametrize("quantization", [None, "int4"])
def test_drafting_several_forks_at_once_equals_each_alone(target_tok, quantization):
    """`draft_all` batches the draft model's forwards across forks (different histories, pending
    tokens and lengths, one with nothing to draft): each fork's draft, its cache and what it proposes
    after committing equal drafting it alone; sampled drafts draw from the fork's own generator."""
    proto = DraftModelDrafter(DRAFT, target_tok, k=4, device="cpu", dtype=torch.float32, quantization=quantization)
    texts = ["Once upon a time there was", "The little dog", "Tom and his friend went to the park and"]
    greedy, hot = SamplingParams(max_tokens=8), SamplingParams(max_tokens=8, temperature=0.9, seed=4)
    params = [greedy, hot, greedy]
    ns = [3, 4, 0]

    def forks():
        out = []
        for t in texts:
            d = proto.fork()
            d.begin(target_tok.encode(t))
            out.append(d)
        return out

    def gens():
        return [None if p.greedy else p.make_generator(torch.device("cpu")) for p in params]

    together, alone = forks(), forks()
    for step in range(3):  # drafts, then commits of a token each (pending tokens for the next catch-up)
        a = proto.draft_all(together, ns, params, gens(), proto.vocab_limit)
        b = [d.draft(n, p, g, proto.vocab_limit) for d, n, p, g in zip(alone, ns, params, gens())]
        for x, y in zip(a, b):
            assert x.tokens.tolist() == y.tokens.tolist()
            assert (x.probs is None) == (y.probs is None)
            if x.probs is not None:
                torch.testing.assert_close(x.probs, y.probs)
        for d, e, draft in zip(together, alone, a):
            assert d._n == e._n and d._drafted == e._drafted
            n = d._n + d._drafted
            torch.testing.assert_close(d._cache.k[:, :, :, :n], e._cache.k[:, :, :, :n], atol=1e-5, rtol=1e-5)
            emitted = draft.tokens.tolist()[:1] + [7 + step]
            d.commit(emitted, min(1, len(emitted) - 1))
            e.commit(emitted, min(1, len(emitted) - 1))
    for d, e in zip(together, alone):
        assert d.propose().tolist() == e.propose().tolist()


def _latest_longest_match(hist: list[int], max_ngram: int, n: int, min_ngram: int = 1) -> tuple[int, list[int]]:
    """Prompt lookup spelled out: for the longest suffix (max_ngram tokens, then fewer, down to
    min_ngram) with an earlier occurrence, its size and the n tokens after its latest one."""
    for size in range(min(max_ngram, len(hist) - 1), min_ngram - 1, -1):
        suffix = hist[len(hist) - size:]
        for start in range(len(hist) - 1, size - 1, -1):  # the follower's position
            if hist[start - size : start] == suffix:
                return size, hist[start : start + n]
    return 0, []


@pytest.mark.parametrize("max_ngram,min_ngram", [(1, 1), (2, 1), (3, 1), (4, 1), (3, 2), (3, 3)])
def test_ngram_chain_is_the_latest_longest_match_through_steps_and_rollbacks(max_ngram, min_ngram):
    """`chain` (and the size of the suffix it matched) against the plain search after every step,
    rollback and draft's candidate rows (its table of latest occurrences is indexed lazily and built
    again after a rollback), with a small vocabulary so matches of every length occur."""
    rng = random.Random(max_ngram)
    d = NGramDrafter(k=3, vocab_size=6, max_ngram=max_ngram, min_ngram=min_ngram)
    hist = [rng.randrange(6) for _ in range(rng.randrange(0, 5))]
    d.reset(list(hist))
    lengths = set()
    for step in range(400):
        n = rng.randrange(1, 5)
        chain = d.chain(n)
        assert (d.match, chain) == _latest_longest_match(hist, max_ngram, n, min_ngram), (step, hist)
        lengths.add(len(chain))
        action = rng.random()
        if action < 0.15 and hist:  # a rollback
            keep = rng.randrange(len(hist) + 1)
            d.truncate(keep)
            del hist[keep:]
        elif action < 0.25:  # SpecEE's candidate rows push and undo a draft
            d.row_candidates(Draft(torch.tensor(chain or [0]), ids=chain or [0]))
        else:
            emitted = [rng.randrange(6) for _ in range(rng.randrange(1, 4))]
            d.commit(emitted, 0)
            hist += emitted
        assert d.history == hist
    assert len(lengths) >= 3  # chains of several lengths, none among them, were drafted


def test_ngram_lazy_tables_equal_tables_built_from_scratch():
    """The follow tables index only when `candidates` asks (and drop what a rollback cut): after
    mixed appends, rollbacks and candidate rows, the proposal equals a fresh drafter's on the same history."""
    rng = random.Random(7)
    d = NGramDrafter(k=4, vocab_size=12, max_ngram=3)
    d.reset([rng.randrange(12) for _ in range(10)])
    for step in range(300):
        action = rng.random()
        if action < 0.2:
            d.truncate(rng.randrange(len(d.history) + 1))
        elif action < 0.3:
            d.row_candidates(Draft(torch.tensor([rng.randrange(12)]), ids=None))
        elif action < 0.6:
            d.propose()
        else:
            d.extend([rng.randrange(12) for _ in range(rng.randrange(1, 4))])
        fresh = NGramDrafter(k=4, vocab_size=12, max_ngram=3)
        fresh.reset(list(d.history))
        assert d.propose().tolist() == fresh.propose().tolist(), step
