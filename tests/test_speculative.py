"""Speculative decoding: greedy output equals full-depth greedy with every drafter (chains and
trees, drafts always wrong and always right), sampled output has the target's distribution at
every position (and a biased sampler is caught), one host read per step, clear config errors."""
from __future__ import annotations

import json

import pytest
import torch

from specee.drafters.base import Draft, Drafter
from specee.drafters.draft_model import DraftModelDrafter
from specee.drafters.eagle import EagleDrafter
from specee.drafters.eagle_head import EagleHead, EagleHeadConfig
from specee.drafters.ngram import NGramDrafter
from specee.engine.sequence import Sequence
from specee.model.quant import FloatLinear, Int4Linear
from specee.sampling import SamplingParams
from specee.engine.engine import Engine
from specee.speculative import SpeculativeDecoding, TreeShape
from specee.speculative.tree import TreeGrower
from specee.speculative import verify as verify_module
from specee.speculative.config import SpeculativeConfig
from specee.speculative.verify import accept_chain_sampled, accept_tree

pytestmark = pytest.mark.usefixtures("single_thread")

PROMPTS = ["Write a short story about a cat who learns to fly.", "What is 12 plus 30?",
           "def add(a, b):\n    return a + b\n\nprint(add(", "List three colours and say why you like them.",
           "The quick brown fox jumps over the lazy dog. The quick brown fox"]


# ---- test drafters: drafts always right / always wrong ----------------------------------------
class ScriptedDrafter(Drafter):
    """Drafts from a known continuation: the target's own greedy tokens (`shift` 0: every draft is
    accepted) or those tokens + shift (every draft is rejected)."""

    def __init__(self, prompt_len: int, continuation: list[int], vocab: int, shift: int):
        self.k, self.name, self.fingerprint = 1, f"scripted{shift}", "scripted"
        self.prompt_len, self.continuation, self.vocab, self.shift = prompt_len, continuation, vocab, shift

    def reset(self, prompt_ids):
        self._history = list(prompt_ids)

    def advance(self, token):
        self._history.append(token)

    def propose(self):
        raise NotImplementedError

    def truncate(self, length):
        del self._history[length:]

    def teacher_forced_top_k(self, ids, start):
        raise NotImplementedError

    def draft(self, n, params, generator, width):
        done = len(self._history) - self.prompt_len
        ahead = self.continuation[done : done + n]
        return Draft(torch.tensor([(t + self.shift) % self.vocab for t in ahead], dtype=torch.long))


# ---- helpers --------------------------------------------------------------------------------------
def run(model, tokenizer, drafter, ids: list[int], params: SamplingParams, n: int = 4,
        tree: TreeShape | None = None) -> Sequence:
    seq = Sequence(ids, list(ids), params, tokenizer, frozenset())
    SpeculativeDecoding(model, drafter, n, tree, gated=False).generate(seq)  # every step drafts
    return seq


def random_head(model, seed: int = 0, layers: tuple[int, ...] | None = None,
                quantization: str | None = None) -> EagleHead:
    cfg = EagleHeadConfig.for_target(model.cfg, layers, model.cfg.vocab_size // 2)
    shortlist = torch.randperm(model.cfg.vocab_size, generator=torch.Generator().manual_seed(seed))
    head = EagleHead.init_random(model, cfg, shortlist[: cfg.shortlist_size].sort().values, seed=seed)
    if quantization is None:
        return head
    return EagleHead(model, cfg, head.shortlist, head.params, quantization=quantization)


@pytest.fixture(scope="module")
def ref(real_llm):
    """The reference pair, prompts and their full-depth greedy continuations (32 tokens, EOS ignored)."""
    llm = real_llm("ref-target-24L")
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, chat=True)
    return llm, params, [(o.prompt_token_ids, o.token_ids) for o in outs]


@pytest.fixture(scope="module")
def ref_draft(ref):
    from conftest import real_model_dir

    llm = ref[0]
    return DraftModelDrafter(real_model_dir("ref-draft-4L"), llm.tokenizer, 1, target_dir=llm.model_dir,
                             vocab_size=llm.model.cfg.vocab_size)


# ---- greedy: token-identical to full depth -------------------------------------------------------
@pytest.mark.parametrize("drafter_kind,tree", [
    ("draft_model", None), ("draft_model", TreeShape(4, 3, 10)), ("ngram", None),
    ("eagle", None), ("eagle", TreeShape(3, 4, 12))])
def test_greedy_speculation_equals_full_depth(ref, ref_draft, drafter_kind, tree):
    llm, params, cases = ref
    model = llm.model
    drafter = {"draft_model": lambda: ref_draft, "ngram": lambda: NGramDrafter(1, model.cfg.vocab_size),
               "eagle": lambda: EagleDrafter(random_head(model, layers=(1, 11, 23)))}[drafter_kind]()
    accepted = 0
    for ids, expected in cases:
        seq = run(model, llm.tokenizer, drafter, ids, params, tree=tree)
        assert seq.output_ids == expected
        stats = seq.stats.speculative
        assert stats["target_passes"] < len(expected) or drafter_kind == "eagle"  # a random head rarely helps
        accepted += stats["accepted_tokens"]
    if drafter_kind != "eagle":
        assert accepted > 0  # the test exercised accepted drafts, not only rollbacks


def test_always_wrong_and_always_right_drafts(ref):
    llm, params, cases = ref
    model, V = llm.model, llm.model.cfg.vocab_size
    for ids, expected in cases[:3]:
        wrong = run(model, llm.tokenizer, ScriptedDrafter(len(ids), expected, V, shift=1), ids, params)
        assert wrong.output_ids == expected
        s = wrong.stats.speculative
        assert s["accepted_tokens"] == 0 and s["draft_tokens"] > 0 and s["target_passes"] == len(expected) - 1
        right = run(model, llm.tokenizer, ScriptedDrafter(len(ids), expected, V, shift=0), ids, params, n=5)
        assert right.output_ids == expected
        s = right.stats.speculative
        assert s["accepted_tokens"] == s["draft_tokens"]  # the longest chain every step
        assert s["target_passes"] == -(-(len(expected) - 1) // 6)  # 6 tokens per target pass


def test_tree_drafts_agreeing_with_the_target_are_accepted(ref):
    """The target as its own draft model, every candidate verified: the greedy token at depths 1 and
    2 is always in the tree (the root's top-k; the top child of a depth-1 node, all of which are
    expanded), so those positions are always accepted, from whichever branch they sit in."""
    llm, params, cases = ref
    model = llm.model
    same = DraftModelDrafter(llm.model_dir, llm.tokenizer, 1, target_dir=llm.model_dir)
    shape = TreeShape(4, 2, TreeShape(4, 2, 1).candidates)
    for ids, expected in cases[:2]:
        seq = run(model, llm.tokenizer, same, ids, params, n=4, tree=shape)
        assert seq.output_ids == expected
        s = seq.stats.speculative
        assert s["acceptance_rate_per_position"][:2] == [1.0, 1.0]
        assert s["mean_accepted_length"] >= 3.0


@pytest.mark.parametrize("variant", ["llama3", "qwen2", "tied", "gqa_head_dim"])
def test_greedy_speculation_on_architectures(tiny_checkpoint, tiny_llm, tmp_path, variant):
    """Tiny random checkpoints (GQA, q/k/v biases and a padded vocabulary, tied embeddings, head_dim
    != hidden / heads): a draft model (same tokenizer, other weights), n-gram and an EAGLE tree."""
    from checkpoints import make_checkpoint

    llm = tiny_llm(variant)
    model = llm.model
    draft_dir = make_checkpoint(tmp_path / "draft", variant, seed=1)
    drafters = [(DraftModelDrafter(draft_dir, llm.tokenizer, 1, target_dir=llm.model_dir,
                                   vocab_size=model.cfg.vocab_size), None),
                (NGramDrafter(1, model.cfg.vocab_size), None),
                (EagleDrafter(random_head(model)), TreeShape(3, 3, 8))]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    for prompt in PROMPTS[:3]:
        expected = llm.generate(prompt, params)[0]
        for drafter, tree in drafters:
            seq = run(model, llm.tokenizer, drafter, expected.prompt_token_ids, params, tree=tree)
            assert seq.output_ids == expected.token_ids, drafter.name


# ---- sampling: the target's distribution at every position --------------------------------------
def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square goodness of fit; cells with expected count < 5 pooled into one. An
    outcome the distribution cannot produce gives 0."""
    if bool((counts[probs == 0] > 0).any()):
        return 0.0
    n = counts.sum()
    expected = probs * n
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum().view(1)]).double()
    exp = torch.cat([expected[~small], expected[small].sum().view(1)]).double()
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    df = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def biased_accept(draft, draft_probs, target_probs, generator):
    """A wrong verifier: accepts every draft (no ratio test), the bonus from p_k."""
    k = draft.shape[0]
    bonus = torch.multinomial(target_probs[k], 1, generator=generator)
    return torch.cat([torch.tensor([k]), draft, bonus])


def test_rejection_sampling_matches_target_distribution_at_every_position():
    """Synthetic p_j (independent of the prefix) and q_j over 6 tokens, 3 drafts: each emitted
    position's frequency must match p_j; accepting without the ratio test must be caught."""
    g = torch.Generator().manual_seed(0)
    V, k, N = 6, 3, 6000
    p = torch.softmax(torch.randn(k + 1, V, generator=g) * 1.5, dim=-1)
    q = torch.softmax(torch.randn(k, V, generator=g) * 1.5, dim=-1)
    for verifier, ok in ((accept_chain_sampled, True), (biased_accept, False)):
        counts = torch.zeros(k + 1, V)
        seen = torch.zeros(k + 1)
        for _ in range(N):
            draft = torch.multinomial(q, 1, generator=g).view(k)
            a, *tokens = verifier(draft, q, p, g).tolist()
            for j, t in enumerate(tokens[: a + 1]):
                counts[j, t] += 1
                seen[j] += 1
        # position j is emitted only when drafts before it were accepted, but each emitted token is
        # distributed as p_j whatever happened before: test every position's conditional frequency
        pvals = [chi_square_p_value(counts[j], p[j]) for j in range(k + 1) if seen[j] >= 200]
        assert len(pvals) >= 2
        if ok:
            assert min(pvals) > 1e-3, pvals
        else:
            assert min(pvals) < 1e-6, pvals


@torch.inference_mode()
def exact_joint(model, ids: list[int], params: SamplingParams, depth: int) -> dict[tuple[int, ...], float]:
    """The target's exact distribution over its first `depth` sampled tokens (top-k sampling keeps
    the tree of prefixes small): one full forward per prefix."""
    from specee.engine.full_depth import prefill
    from specee.sampling import probabilities

    out = {(): 1.0}
    for _ in range(depth):
        nxt = {}
        for prefix, mass in out.items():
            seq = ids + list(prefix)
            p = probabilities(model.logits(prefill(model, model.new_cache(1, len(seq)), [seq])), params)[0]
            for t in torch.nonzero(p).flatten().tolist():
                nxt[prefix + (t,)] = mass * float(p[t])
        out = nxt
    return out


class GreedyDrafts(DraftModelDrafter):
    """A draft model drafting its argmax whatever the sampling parameters: deterministic drafts
    (point masses, as prompt lookup's), verified by the target's own samples."""

    def __init__(self, inner: DraftModelDrafter):
        self.__dict__.update(inner.__dict__)

    def draft(self, n, params, generator, width):
        return super().draft(n, SamplingParams(), generator, width)


@pytest.mark.parametrize("method", ["draft_model", "point_mass", "tree"])
def test_sampled_speculation_has_the_targets_joint_distribution(tiny_llm, method, monkeypatch):
    """Tiny target, top-3 sampling at temperature 1.5, the first 4 tokens: the joint frequencies of
    speculative sampling match the exact joint distribution (chi-square), with sampled drafts (the
    ratio test), deterministic drafts (point masses) and trees; for sampled drafts, a verifier
    without the ratio test is caught."""
    llm = tiny_llm("llama2")
    model, V = llm.model, llm.model.cfg.vocab_size
    depth, N = 4, 1000
    ids = llm.encode("Once upon a time there was")
    prompt = ids
    base = SamplingParams(max_tokens=depth, temperature=1.5, top_k=3, ignore_eos=True)
    joint = exact_joint(model, prompt, base, depth)
    keys = sorted(joint)
    index = {key: i for i, key in enumerate(keys)}
    probs = torch.tensor([joint[key] for key in keys])
    tree = TreeShape(3, 2, 5) if method == "tree" else None

    def drafter():
        d = DraftModelDrafter(llm.model_dir, llm.tokenizer, 1, target_dir=llm.model_dir)
        # the target's own weights scoring half the vocabulary: a draft that differs from p but overlaps it
        d.restrict_vocab(torch.arange(0, V, 2))
        return GreedyDrafts(d) if method == "point_mass" else d

    probs = torch.cat([probs, torch.zeros(1)])  # last cell: sequences the target cannot sample

    def frequencies(d) -> tuple[torch.Tensor, int]:
        counts = torch.zeros(len(keys) + 1)
        accepted = 0
        for seed in range(N):
            params = SamplingParams(max_tokens=depth, temperature=1.5, top_k=3, seed=seed, ignore_eos=True)
            seq = run(model, llm.tokenizer, d, prompt, params, n=3, tree=tree)
            counts[index.get(tuple(seq.output_ids), len(keys))] += 1
            accepted += seq.stats.speculative["accepted_tokens"]
        return counts, accepted

    d = drafter()
    counts, accepted = frequencies(d)
    assert accepted > N // 4  # drafts were accepted (and, below, rejected) often enough to matter
    assert chi_square_p_value(counts, probs) > 1e-3
    if method == "draft_model":
        monkeypatch.setattr(verify_module, "accept_chain_sampled", biased_accept)
        biased, _ = frequencies(d)
        assert chi_square_p_value(biased, probs) < 1e-6


# ---- trees -----------------------------------------------------------------------------------------
def test_accept_tree_follows_the_matching_path():
    """root -> {a:5, b:6}; a -> {c:7}; b -> {d:8}; c -> {e:9}. choices after root 6, after b 8, after d 3."""
    from specee.speculative.tree import Tree

    tokens = torch.tensor([1, 5, 6, 7, 8, 9])
    parents = torch.tensor([0, 0, 0, 1, 2, 3])
    depths = torch.tensor([0, 1, 1, 2, 2, 3])
    tree = Tree(tokens, parents, depths, torch.ones(6, 6, dtype=torch.bool), depth=3)
    choices = torch.tensor([6, 0, 8, 0, 3, 0])
    a, *rest = accept_tree(tree, choices).tolist()
    assert a == 2 and rest[:3] == [0, 2, 4] and rest[4:7] == [6, 8, 3]
    choices = torch.tensor([4, 0, 0, 0, 0, 0])  # nothing matches: the root's choice only
    a, *rest = accept_tree(tree, choices).tolist()
    assert a == 0 and rest[4] == 4


# ---- host syncs --------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["draft_model", "eagle", "eagle_tree"])
def test_one_host_read_per_speculative_step(ref, ref_draft, monkeypatch, kind):
    llm, params, cases = ref
    model = llm.model
    ids, expected = cases[0]
    drafter = ref_draft if kind == "draft_model" else EagleDrafter(random_head(model))
    tree = TreeShape(3, 3, 8) if kind == "eagle_tree" else None
    reads = {"n": 0}
    for name in ("tolist", "item", "__int__", "__float__", "__bool__", "nonzero"):
        original = getattr(torch.Tensor, name)

        def counting(self, *a, _original=original, **kw):
            reads["n"] += 1
            return _original(self, *a, **kw)

        monkeypatch.setattr(torch.Tensor, name, counting)
    steps = {"n": 0}
    original_step = Engine.step

    def counted_step(self):
        steps["n"] += 1
        return original_step(self)

    monkeypatch.setattr(Engine, "step", counted_step)
    seq = Sequence(ids, list(ids), params, llm.tokenizer, frozenset())
    SpeculativeDecoding(model, drafter, 4, tree).generate(seq)
    monkeypatch.undo()
    assert seq.output_ids == expected
    assert reads["n"] == steps["n"]  # one per engine step, the prefill's included


# ---- configuration -----------------------------------------------------------------------------------
# ---- the forks of a step draft together -------------------------------------------------------------
def eagle_target(real_llm, quantization: str | None):
    """ref-target-24L (float, or quantized for the C++ layers), an EAGLE drafter on it (a random head,
    quantized alike), a random token sequence and the target's features over it ([1, 40, W])."""
    from conftest import real_model_dir

    from specee import LLM

    model = (real_llm("ref-target-24L") if quantization is None else
             LLM(real_model_dir("ref-target-24L"), dtype="float32", quantization=quantization)).model
    proto = EagleDrafter(random_head(model, layers=(1, 11, 23), quantization=quantization))
    assert quantization is None or proto.head.runtime.fast_layers is not None
    ids = torch.randint(0, model.cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    hs = model.hidden_states(ids)
    return model, proto, ids, torch.cat([hs[i + 1] for i in proto.feature_layers], -1)[None]


def forks_at(proto: Drafter, ids: list[int], lengths: list[int], feats: torch.Tensor | None) -> list[Drafter]:
    """Forks of `proto` with the histories ids[:m] (an EAGLE fork starts from the target's features)."""
    out = []
    for m in lengths:
        d = proto.fork()
        d.begin(ids[:m], None if feats is None else feats[:, : m - 1])
        out.append(d)
    return out


def commit_next(drafter: Drafter, ids: list[int], count: int, feats: torch.Tensor | None) -> None:
    """The drafter consumes the next `count` tokens of ids (with their features for EAGLE)."""
    m = len(drafter.history)
    drafter.commit(ids[m : m + count], 0, None if feats is None else feats[:, m - 1 : m - 1 + count])


@pytest.mark.parametrize("quantization", [None, "int4"])
def test_eagle_drafting_several_forks_at_once_equals_each_alone(real_llm, quantization):
    """`EagleDrafter.draft_all` runs the pending pairs (prompt, commits) of forks at different history
    lengths in one ragged head forward, then advances their chains together (one per depth; forks
    wanting fewer tokens, or none, drop out): each fork's draft (tokens, sampling probabilities), the
    head cache it wrote and its drafts after committing equal drafting it alone, greedy and seeded
    sampling (each from its own generator); and its state equals one head pass over its history.
    int4: the quantized head on a quantized target, through the C++ ragged layer."""
    model, proto, ids, feats = eagle_target(real_llm, quantization)
    lengths = [9, 17, 4, 12]  # each fork's history: ids[:m]
    greedy, hot = SamplingParams(max_tokens=8), SamplingParams(max_tokens=8, temperature=0.9, seed=4)
    params, ns = [greedy, hot, greedy, hot], [4, 3, 0, 1]
    V = model.cfg.vocab_size

    def gens():
        return [None if p.greedy else p.make_generator(torch.device("cpu")) for p in params]

    together, alone = forks_at(proto, ids, lengths, feats), forks_at(proto, ids, lengths, feats)
    for step in range(3):  # drafts (the forks' pending pairs run first), then commits of the next tokens of ids
        a = proto.draft_all(together, ns, params, gens(), V)
        b = [d.draft(n, p, g, V) for d, n, p, g in zip(alone, ns, params, gens())]
        for x, y, n in zip(a, b, ns):
            assert x.tokens.tolist() == y.tokens.tolist() and len(x.tokens) == n
            assert (x.probs is None) == (y.probs is None)
            if x.probs is not None:
                torch.testing.assert_close(x.probs, y.probs)
        for d, e, n in zip(together, alone, ns):
            assert d._n == e._n
            end = d._n + max(n - 1, 0)  # the committed pairs and the fed-back draft rows
            torch.testing.assert_close(d._cache.k[:, :, :, :end], e._cache.k[:, :, :, :end], atol=1e-5, rtol=1e-5)
            for f in (d, e):
                for c in (2, 1) if step == 1 else (step + 1,):  # step 1: two commits, the first runs alone
                    commit_next(f, ids, c, feats)
    for d, e in zip(together, alone):
        assert d.propose().tolist() == e.propose().tolist()
        m = d._n  # the history is ids[:m], its pairs at slots 1..m-1
        cache = proto.head.new_cache(1, m)
        h = proto.head.forward(feats[:, : m - 1], torch.tensor([ids[1:m]]), model.range_inputs(1, m - 1), cache)
        torch.testing.assert_close(d._last, h[:, -1:], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(d._cache.k[:, :, :, :m], cache.k, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["eagle", "eagle_int4", "draft_model"])
def test_trees_of_several_forks_grow_together_as_each_alone(real_llm, ref_draft, kind):
    """`TreeGrower.grow` over forks at different history lengths (each depth's beam rows of all forks
    in one ragged forward; one fork without room for the candidates gets no tree) gives each fork the
    tree, and the drafter cache rows, it gets grown alone."""
    model, proto, ids, feats = eagle_target(real_llm, "int4" if kind == "eagle_int4" else None)
    if kind == "draft_model":
        proto, feats = ref_draft, None
    shape = TreeShape(3, 3, 8)
    grower, lengths = TreeGrower(shape, model.device), [9, 17, 4, 12]
    together, alone = forks_at(proto, ids, lengths, feats), forks_at(proto, ids, lengths, feats)
    for forks in (together, alone):
        forks[3].context = lengths[3] + shape.candidates - 1  # no room for the candidates
    for step in range(2):
        roots = torch.tensor([d.history[-1] for d in together])
        a = grower.grow(roots, proto, together)
        b = [grower.grow(root[None], d, [d])[0] for root, d in zip(roots, alone)]
        assert a[3] is None and b[3] is None
        for x, y in zip(a[:3], b[:3]):
            for field in ("tokens", "parents", "depths", "ancestors"):
                assert torch.equal(getattr(x, field), getattr(y, field)), field
        for d, e in zip(together[:3], alone[:3]):
            end = d._n + shape.candidates
            torch.testing.assert_close(d._cache.k[:, :, :, :end], e._cache.k[:, :, :, :end], atol=1e-5, rtol=1e-5)
            for f in (d, e):
                commit_next(f, ids, step + 1, feats)


@pytest.mark.parametrize("raw,message", [
    ({"method": "medusa"}, "method must be one of"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer from 1 to 64"),
    ({"method": "draft_model"}, "needs 'model'"),
    ({"method": "draft_model", "model": "/no/such/draft"}, "not found"),
    ({"method": "eagle", "model": "/no/such/head"}, "model directory not found"),
    ({"method": "ngram", "tree": {"topk": 2, "size": 4}}, "ngram drafts a chain"),
    ({"method": "ngram", "speculative_tokens": 3}, "unknown keys"),
    ({"method": "draft_model", "model": ".", "tree": {"topk": 2, "size": 99}}, "tree size must be in"),
    ({"method": "ngram", "quantization": "int4"}, "'quantization' sets the draft model's weights"),
    ({"method": "draft_model", "model": ".", "quantization": "int3"}, "quantization must be one of"),
    ({"method": "ngram", "prompt_lookup_max": 2, "prompt_lookup_min": 3}, "prompt_lookup_min must be an integer from 1 to"),
    ({"method": "draft_model", "model": ".", "prompt_lookup_min": 2}, "'prompt_lookup_min' is for method 'ngram'"),
    ({"method": "eagle", "model": ".", "prompt_lookup_max": 2}, "'prompt_lookup_max' is for method 'ngram'"),
    ({"method": "draft_model", "model": 5}, "needs 'model': a draft model directory, .gguf file or hub id, got 5"),
    ({"method": "eagle", "model": ["a"]}, "needs 'model': an EAGLE head directory, got"),
    ({"method": "draft_model", "model": " "}, "needs 'model'"),
])
def test_nonsense_configs_are_refused_in_one_line(raw, message):
    with pytest.raises(ValueError, match=message) as e:
        SpeculativeConfig.parse(raw)
    assert "\n" not in str(e.value)


def test_ngram_chains_need_a_match_of_prompt_lookup_min_tokens(tiny_llm):
    """By default a chain is copied from a match of 2 tokens or more (a 1-token match's drafts were
    accepted at 0.10 a row on SmolLM2); the config's prompt_lookup_min sets it."""
    from specee.speculative.config import make_decoder

    llm = tiny_llm("llama2")
    for raw, shortest in (({}, 2), ({"prompt_lookup_min": 1}, 1), ({"prompt_lookup_min": 3}, 3), ({"prompt_lookup_max": 1}, 1)):
        decoding = make_decoder(llm, {"method": "ngram", **raw})
        assert decoding.drafter.min_ngram == shortest, raw
        drafter = decoding.drafter.fork()
        drafter.begin([5, 6, 7, 9, 6, 7])  # the suffix [6, 7] was followed by 9; [7] alone too
        assert drafter.chain(2) == ([9, 6] if shortest <= 2 else []), raw


def test_a_quantized_targets_draft_model_runs_int4_unless_the_config_says(ref):
    """The draft's own precision moves acceptance, never the output: greedy speculation with an int4 or a
    float draft equals the int4 target's full-depth greedy output."""
    from conftest import real_model_dir

    from specee import LLM
    from specee.speculative.config import make_decoder

    draft = str(real_model_dir("ref-draft-4L"))
    assert SpeculativeConfig.parse({"method": "draft_model", "model": draft}).draft_quantization("auto") == "int4"
    assert SpeculativeConfig.parse({"method": "draft_model", "model": draft}).draft_quantization(None) is None
    llm = LLM(ref[0].model_dir, dtype="float32", quantization="int4")
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    ids = llm.tokenizer.encode_chat([{"role": "user", "content": PROMPTS[0]}])
    expected = llm.generate([ids], params)[0].token_ids
    for quantization, kind in (("default", Int4Linear), (None, FloatLinear)):
        raw = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3}
        if quantization != "default":
            raw["quantization"] = quantization
        decoder = make_decoder(llm, raw)
        assert isinstance(decoder.drafter.model.layers[0].gate_up, kind)
        seq = Sequence(ids, list(ids), params, llm.tokenizer, frozenset())
        decoder.generate(seq)
        assert seq.output_ids == expected, quantization


def test_a_float_target_loaded_with_auto_gets_a_float_draft_model():
    """quantization "auto" keeps a float checkpoint float; its draft model was made int4 (and a draft whose
    shapes int4 cannot take failed to load)."""
    from conftest import real_model_dir

    from specee import LLM

    llm = LLM(real_model_dir("ref-target-24L"), dtype="float32")  # quantization "auto"
    assert llm.quantization == "auto" and not llm.model.quantized
    llm.enable_speculative({"method": "draft_model", "model": str(real_model_dir("ref-draft-4L")), "num_speculative_tokens": 2})
    assert isinstance(llm.speculative.drafter.model.layers[0].gate_up, FloatLinear)


def test_a_head_for_another_target_is_refused(tiny_llm, tmp_path):
    llm = tiny_llm("llama2")
    random_head(llm.model).save(tmp_path / "head")  # saved with another target's fingerprint ("")
    with pytest.raises(ValueError, match="trained for the target"):
        llm.enable_speculative({"method": "eagle", "model": str(tmp_path / "head")})


def test_llm_and_cli_speculative_config(tiny_checkpoint, tiny_llm, capsys):
    from specee import LLM
    from specee.cli import main

    path = tiny_checkpoint("llama2")
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    expected = tiny_llm("llama2").generate("Once upon a time", params)[0].token_ids
    llm = LLM(path, dtype="float32", speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    out = llm.generate("Once upon a time", params)[0]
    assert out.token_ids == expected and out.stats.speculative["method"] == "ngram"
    code = main(["generate", "--model", str(path), "--prompt", "Once upon a time", "--no-chat", "--json",
                 "--max-new-tokens", "12", "--speculative-config", json.dumps({"method": "ngram"})])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["token_ids"][: len(expected)] == expected[: len(report["token_ids"])]
    assert "speculative" in report["stats"]
    code = main(["generate", "--model", str(path), "--prompt", "x", "--speculative-config", '{"method": "x"}'])
    assert code == 2 and "specee: error: --speculative-config: method must be one of" in capsys.readouterr().err


# ---- a real pretrained model: SmolLM2-135M-Instruct (GGUF) ------------------------------------------
def test_greedy_speculation_on_smollm2():
    """Lossless on SmolLM2 (dequantized Q4_1 GGUF): prompt lookup chains, an EAGLE tree (random head,
    EAGLE-3 feature layers) and drafts that are always wrong, against full-depth greedy."""
    from conftest import MODELS

    path = MODELS / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.exists():
        pytest.skip(f"SmolLM2 GGUF not available: {path} is absent")
    from specee import LLM

    llm = LLM(path, dtype="float32", quantization=None)
    model, V = llm.model, llm.model.cfg.vocab_size
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    prompts = ["Repeat after me: the cat sat on the mat, the cat sat on the mat.", "What is the capital of France?"]
    for out in llm.generate(prompts, params, chat=True):
        ids, expected = out.prompt_token_ids, out.token_ids
        for drafter, tree in ((NGramDrafter(1, V), None),
                              (EagleDrafter(random_head(model, layers=(2, 15, 29))), TreeShape(3, 3, 8)),
                              (ScriptedDrafter(len(ids), expected, V, shift=1), None)):
            assert run(model, llm.tokenizer, drafter, ids, params, tree=tree).output_ids == expected, drafter.name


# ---- quantized weights: speculation is lossless against the same quantized model -------------------
@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_greedy_speculation_on_quantized_weights(ref, mode):
    """The int4/int8 kernels verify several rows at once; greedy output still equals the quantized
    model's own one-token greedy decoding (prompt lookup and an EAGLE tree over a random head), up
    to a first difference where the one-token logits tie within one bfloat16 step: the kernels
    return bfloat16 logits, and a pass's other rows and mask change the attention kernel's rounding
    (seen: 5.906 vs 5.875, one step apart). The reference is decoded one request at a time."""
    from specee import LLM

    llm = LLM(ref[0].model_dir, dtype="float32", quantization=mode)
    model, V = llm.model, llm.model.cfg.vocab_size
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    for prompt in PROMPTS:
        ids = llm.tokenizer.encode_chat([{"role": "user", "content": prompt}])
        from conftest import greedy_with_margins

        expected, logits = greedy_with_margins(model, ids, params.max_tokens)
        for drafter, tree in ((NGramDrafter(1, V), None), (EagleDrafter(random_head(model)), TreeShape(3, 3, 8)),
                              (EagleDrafter(random_head(model, quantization=mode)), None),
                              (ScriptedDrafter(len(ids), expected, V, shift=0), None)):
            got = run(model, llm.tokenizer, drafter, ids, params, tree=tree).output_ids
            assert len(got) == len(expected), drafter.name
            differ = [i for i, (a, b) in enumerate(zip(got, expected)) if a != b]
            if differ:
                i = differ[0]
                margin = float(logits[i][expected[i]] - logits[i][got[i]])
                assert margin <= 2 ** -7 * abs(float(logits[i][expected[i]])), (drafter.name, i, margin)


def play(gate, batch: int, steps: int, step) -> list[bool]:
    """`steps` of the gate at `batch`, each costing step(drafts, drafted_before) -> (tokens, seconds)."""
    choices = []
    for _ in range(steps):
        on = gate.begin_step(batch)
        gate.end_step(*step(on, gate.drafted_last))
        choices.append(on)
    return choices


def tries(choices: list[bool], best: bool) -> list[tuple[int, int]]:
    """(start, length) of each run of the losing arm."""
    runs, i = [], 0
    while i < len(choices):
        if choices[i] != best:
            j = i
            while j < len(choices) and choices[j] != best:
                j += 1
            runs.append((i, j - i))
            i = j
        else:
            i += 1
    return runs


def test_the_gate_plays_the_faster_arm_per_batch_size_and_keeps_trying_the_other():
    """Drafts pay alone and cost at batch 8 (simulated timings): the gate speculates at batch 1, stops
    at batch 8, and still tries the other arm, ever more rarely while it keeps losing; a try of drafts
    lasts until one step after the switch is measured, and is rare enough that its excess time stays
    within 5% of the steps between tries."""
    from specee.speculative.gate import SpeculationGate

    gate = SpeculationGate(explore=8, max_gap=32, warmup=(4, 2))
    tokens_per_second = {(1, True): 200.0, (1, False): 100.0, (8, True): 300.0, (8, False): 600.0}
    for batch in (1, 8):
        choices = play(gate, batch, 160, lambda on, _: (int(tokens_per_second[(batch, on)]), 1.0))
        warm = choices.index(False)  # a fresh gate: drafts first; batch 8 after batch 1 was measured: plain first
        assert warm == (4 if batch == 1 else 0) and choices[warm:warm + 2] == [False, False]
        best = batch == 1
        runs = tries(choices[warm + 2:], best)
        assert runs[0][0] == 7, (batch, choices)  # the first try after 8 steps
        assert [n for _, n in runs] == [1 if best else 2] * len(runs)  # drafts: the switch, then a measured step
        gaps = [b - a for (a, _), (b, _) in zip(runs, runs[1:])]
        if best:
            assert gaps[:2] == [16, 32] and all(g == 32 for g in gaps[2:]), gaps  # doubling up to max_gap
        else:  # a try costs 2 s for 600 tokens against 1 s plain: 1 s excess, 5% of >= 20 steps
            assert len(runs) >= 3 and all(g >= 21 for g in gaps), gaps


@pytest.mark.parametrize("drafts_rate", [300.0, 560.0])
def test_tries_of_drafts_that_lose_widely_grow_rarer_past_max_gap(drafts_rate):
    """At batch 8, drafts at half of plain steps' rate (a wide loss, beyond the margin of 1.25) are
    tried ever more rarely, the gap doubling past max_gap (32); drafts that lose narrowly (560 against
    600 tokens/s) may turn soon, so their tries keep coming every max_gap steps. (8 SmolLM2 requests:
    n-gram drafts at 0.6-0.7x of plain steps, tried every 64 steps, cost 3.5% of decode speed.)"""
    from specee.speculative.gate import SpeculationGate

    gate = SpeculationGate(explore=8, max_gap=32, warmup=(4, 2))
    play(gate, 1, 40, lambda on, _: (200 if on else 100, 1.0))  # batch 1 measured first: batch 8 starts plain
    choices = play(gate, 8, 400, lambda on, _: (int(drafts_rate) if on else 600, 1.0))
    runs = tries(choices, False)
    gaps = [b - a for (a, _), (b, _) in zip(runs, runs[1:])]
    if drafts_rate < 600 / 1.25:
        assert len(runs) <= 5 and gaps == sorted(gaps) and gaps[-1] > 2 * 32, gaps  # 21, 41, 81, 161
    else:
        assert len(runs) >= 10 and max(gaps) <= 32 + 2, gaps


def test_one_lucky_try_does_not_set_off_a_cluster_of_tries():
    """At batch 8 drafts lose (500 against 600 tokens/s) but one try's measured step is lucky (1,200,
    a repetitive stretch): drafts play until they lose again, then plain steps come back with the gap
    they had earned (32), not `explore` (8). With 8 SmolLM2 requests such lucky n-gram tries set off
    tries every 8-16 steps (drafting 23 of 640 steps, 0.94-0.96x of full depth)."""
    from specee.speculative.gate import SpeculationGate

    gate = SpeculationGate(explore=8, max_gap=32, warmup=(4, 2))
    play(gate, 1, 40, lambda on, _: (110 if on else 100, 1.0))  # batch 1 measured first: batch 8 starts plain
    drafted = []

    def step(on, _):
        if on:
            drafted.append(len(drafted) + 1)
        return (1200 if drafted and drafted[-1] == 6 else 500, 1.0) if on else (600, 1.0)
    choices = play(gate, 8, 400, step)
    runs = tries(choices, False)
    assert runs[2][1] > 2, runs  # the third try (drafts 5 and 6) was lucky: drafts went on playing
    spell_end = runs[2][0] + runs[2][1]
    assert runs[3][0] - spell_end >= 32 - 1, runs  # the gap plain steps had earned, counting the switch back
    assert len(runs) <= 4 + (400 - spell_end) // 32, runs


@pytest.mark.parametrize("spell", [3, 20])
def test_only_a_short_spell_after_a_try_counts_as_luck(spell):
    """Drafts that a try made best lose again after `spell` steps: within `explore` (8) that try was
    lucky and plain steps come back with the gap they had earned (32); after a longer spell drafts had
    turned for a while and are tried again after `explore` steps. (Taking every switch back within the
    earned gap for luck cost Qwen's n-gram alone 1.06x -> 1.01x of full depth.)"""
    from specee.speculative.gate import Arm, SpeculationGate

    gate = SpeculationGate(explore=8, max_gap=32, warmup=(4, 2))
    play(gate, 1, 10, lambda on, _: (100, 1.0))  # past the warm-up
    b = gate.buckets[1]
    b.best, b.gap, b.earned_gap, b.spell, b.since = True, 8, 32, spell - 1, 3  # drafts best since a try's switch
    b.spec, b.plain = Arm(90.0, 1.0, 1.0, 9), Arm(100.0, 1.0, 1.0, 9)  # and now losing
    assert gate.begin_step(1) is False  # plain steps are best again
    assert (b.gap, b.earned_gap) == ((32, 0) if spell <= 8 else (8, 0)), (b.gap, b.earned_gap)


def steps_the_gate_measures(llm, drafter, num_tokens: int, prompts: list[list[int]], params: SamplingParams):
    """Decode `prompts` together with drafting forced on every step; returns the outputs, whether each
    step drafted a token (`drafted_any`) and the tokens of each step the gate measured."""
    decoding = SpeculativeDecoding(llm.model, drafter, num_tokens)
    decoding.gate.begin_step = lambda batch_size, pending=0: True  # always drafting
    measured, drafted = [], []
    decoding.gate.end_step = lambda tokens, seconds: measured.append(tokens)
    engine = Engine(llm.model, decoding)
    seqs = [Sequence(ids, list(ids), params, llm.tokenizer, frozenset()) for ids in prompts]
    for seq in seqs:
        engine.add_request(seq)
    while engine.has_unfinished():
        engine.step()
        drafted.append(decoding.drafted_any)
    return [seq.output_ids for seq in seqs], drafted, measured


def test_a_step_whose_chains_are_all_empty_is_not_measured_as_drafting(tiny_llm):
    """A drafter with nothing to propose (an n-gram drafter without a match) drafts an empty chain:
    the step runs full depth's row and says nothing about drafts. Counted as drafting's, such steps
    diluted what drafts pay at one request (SmolLM2's n-gram alone, paired, BENCHMARKS session 36)."""
    class Gappy(ScriptedDrafter):  # the continuation's tokens at even history lengths, nothing at odd ones
        def draft(self, n, params, generator, width):
            return super().draft(n if len(self._history) % 2 == 0 else 0, params, generator, width)

    llm = tiny_llm("llama2")
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    ids = llm.tokenizer.encode("a b c d e f g h")
    greedy = llm.generate([ids], params)[0].token_ids
    drafter = Gappy(len(ids), greedy, llm.model.cfg.vocab_size, shift=1)
    outputs, drafted, measured = steps_the_gate_measures(llm, drafter, 1, [ids], params)
    assert outputs == [greedy]
    decode_steps = drafted[1:]
    assert 0 < sum(decode_steps) < len(decode_steps), decode_steps  # steps with and without a chain
    assert len(measured) == sum(decode_steps)  # the gate measured only the steps that drafted


def test_a_step_where_no_request_has_room_to_draft_is_not_measured_as_drafting(tiny_llm):
    """Requests at their last token cannot draft: such a step costs what a plain one does. Counted
    as drafting's, 8 SmolLM2 requests ending together made drafts look cheap, and the next batch
    drafted at a loss for 12 steps before the measurement decayed."""
    llm = tiny_llm("llama2")
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    ids = llm.tokenizer.encode("a b a b a b a b")
    greedy = llm.generate([ids], params)[0].token_ids
    # every draft rejected, so each step emits one token and the last one has no room left
    drafter = ScriptedDrafter(len(ids), greedy, llm.model.cfg.vocab_size, shift=1)
    outputs, drafted, measured = steps_the_gate_measures(llm, drafter, 3, [ids, ids], params)  # drafted together
    assert outputs == [greedy, greedy]
    assert drafted == [False] + [True] * 4 + [False]  # the prefill, 4 decode steps that drafted, the last token's
    assert measured == [2] * 4  # the gate measured the 4, not the last


@pytest.mark.parametrize("gate", ["speculation", "row"])
def test_the_gates_see_only_steps_with_decoding_requests(tiny_llm, gate):
    """A step of prefills alone (a new request's prompt, or the parts of a long one) drafts nothing and
    is not one of the gates' steps: counted as batch 1's, it moved that batch's next try (the
    speculation gate, a draft model's) or its row cost (the row gate, n-gram's)."""
    llm = tiny_llm("llama2")
    model, params = llm.model, SamplingParams(max_tokens=5, ignore_eos=True)
    ids = llm.tokenizer.encode("a b c d " * 20)
    assert len(ids) > 64  # prefilled in parts over two steps or more
    seen = []
    if gate == "speculation":
        greedy = llm.generate([ids], params)[0].token_ids
        decoding = SpeculativeDecoding(model, ScriptedDrafter(len(ids), greedy, model.cfg.vocab_size, shift=1), 3)
        begin_step = decoding.gate.begin_step
        decoding.gate.begin_step = lambda batch_size, pending=0: seen.append(batch_size) or begin_step(batch_size, pending)
    else:
        decoding = SpeculativeDecoding(model, NGramDrafter(3, model.cfg.vocab_size), 3)
        assert decoding.gate is None
        end_step = decoding.row_gate.end_step
        decoding.row_gate.end_step = lambda seconds: seen.append(decoding.row_gate.rows) or end_step(seconds)
    engine = Engine(model, decoding, prefill_chunk=32)
    engine.add_request(Sequence(ids, list(ids), params, llm.tokenizer, frozenset()))
    while engine.has_unfinished():
        engine.step()
    if gate == "speculation":
        assert seen == [1] * 4, seen  # the 4 decode steps after the prefill's first token
    else:  # the 4 decode steps, each of the request's row and its drafts
        assert len(seen) == 4 and all(1 <= rows <= 4 for rows in seen), seen
        assert decoding.row_gate.cost.n == pytest.approx(sum(0.99 ** k for k in range(4)))


def test_a_drafting_step_after_plain_ones_is_not_what_drafting_costs():
    """A draft model first catches up on the tokens it skipped: that step costs 10 s here, the next
    ones 1 s for 200 tokens against plain steps' 150. The gate measures the step after the switch,
    so drafts win once tried; charging the switch to them kept plain steps forever."""
    from specee.speculative.gate import SpeculationGate

    gate = SpeculationGate(explore=8, max_gap=32, warmup=(4, 2))
    choices = play(gate, 1, 40, lambda on, before: (200, 1.0 if before else 10.0) if on else (150, 1.0))
    assert choices[:6] == [True] * 4 + [False] * 2
    assert choices[6:13] == [True] * 7 and choices[6:].count(False) <= 2, choices  # only the tries of plain


def test_a_new_requests_catch_up_is_not_what_drafting_costs():
    """Requests of 12 steps one after another: a draft model's first drafting step of each runs the
    request's prompt first (pending 60 tokens, 10 s here), the others 1 s for 200 tokens against plain
    steps' 150. Charging each prompt's catch-up to drafting made them lose after every new request
    (the Qwen pair on an Intel Xeon: 1-token steps of 105-190 ms beside plain ones of 45 ms)."""
    from specee.speculative.gate import SpeculationGate

    gate = SpeculationGate(explore=8, max_gap=32, warmup=(4, 2))
    choices = []
    for _ in range(8):
        pending = 60
        for _ in range(12):
            on = gate.begin_step(1, pending)
            gate.end_step(*((200, 10.0 if pending > 1 else 1.0) if on else (150, 1.0)))
            pending = 1 if on else pending + 1
            choices.append(on)
    assert choices[:7] == [True] * 5 + [False] * 2, choices  # the warm-up measures 4 steps after the catch-up
    assert choices[7:].count(False) <= 4, choices  # only the tries of plain steps


def test_a_try_whose_steps_all_catch_up_ends_at_its_third_drafting_step():
    """After a fully accepted chain a draft model runs 2 tokens a request before drafting, which the
    gate counts as a catch-up. 4 requests whose chains are all accepted (12 tokens in 0.27 s against
    plain steps' 4 in 0.06): the try that batch 1's win sets off is measured at its third drafting
    step and ends, and drafts stay off. Before, no step of the try was measured and 4 Qwen requests
    drafted for 20 steps at 0.66x of plain steps' rate (an Intel Xeon)."""
    from specee.speculative.gate import TRY_STEPS, SpeculationGate

    gate = SpeculationGate(explore=8, max_gap=32, warmup=(4, 2))
    for _ in range(20):  # batch 1: drafts win by 50%
        on = gate.begin_step(1, 1)
        gate.end_step(3 if on else 1, 0.5 if on else 0.25)
    choices = []
    for _ in range(60):
        on = gate.begin_step(4, 8)
        choices.append(on)
        gate.end_step(*((12, 0.27) if on else (4, 0.06)))
    assert sum(choices) == TRY_STEPS == 3 and choices.count(True) == sum(choices[choices.index(True):][:3]), choices


def test_a_try_replaces_a_stale_slow_measurement():
    """One plain warm-up step slowed by something else (10 s): the first try of plain steps measures
    them again and the gate switches to them, instead of carrying that step for the rest of the run."""
    from specee.speculative.gate import SpeculationGate

    gate = SpeculationGate(explore=8, max_gap=32, warmup=(4, 2))
    slow = iter([10.0])
    choices = play(gate, 1, 40, lambda on, _: (100, 1.0) if on else (150, next(slow, 1.0)))
    assert choices[:6] == [True] * 4 + [False] * 2 and choices[6:14] == [True] * 7 + [False]
    assert choices[14:21] == [False] * 7 and choices[14:].count(True) <= 4, choices  # then only tries of drafts


def test_a_warmup_cut_short_does_not_resume_with_drafts_after_plain_steps():
    """A 2-request warm-up call ends after 2 drafting steps; batch 1 is then measured (drafts win by
    less than the margin) and a batch of 4 plays plain steps. When that batch shrinks to 2, the
    unfinished warm-up there must not switch drafts on at once (a draft model's catch-up of every
    request): it starts plain, as a new batch size does, and tries drafts only after max_gap."""
    from specee.speculative.gate import SpeculationGate

    gate = SpeculationGate(explore=8, max_gap=32, warmup=(4, 2))
    for _ in range(2):
        assert gate.begin_step(2)
        gate.end_step(300, 1.0)
    for _ in range(40):
        on = gate.begin_step(1)
        gate.end_step(115 if on else 100, 1.0)
    four = []
    for _ in range(20):
        four.append(gate.begin_step(4))
        gate.end_step(150 if four[-1] else 380, 1.0)
    assert not any(four)
    two = []
    for _ in range(12):
        two.append(gate.begin_step(2))
        gate.end_step(200 if two[-1] else 250, 1.0)
    assert not any(two), two


@pytest.mark.parametrize("per_token", [0.0, 0.1])
def test_a_try_of_drafts_waits_until_its_catch_up_fits_the_exploration_share(per_token):
    """Drafts paid alone by 50%, so a first batch of 4 tries them 8 steps in. A draft model that skipped
    those steps first runs every pending token (4 prompts of 100, then 4 a step) at 0.1 s each: a 40 s
    catch-up against 1 s plain steps, which the gate learnt from batch 1's first drafting steps
    (a prompt, then one token each). It does not try drafts while that catch-up exceeds 5% of the
    plain steps since the last try (it never fits: it grows faster than they do); a drafter that
    pends nothing tries after 8 steps as before."""
    from specee.speculative.gate import SpeculationGate

    gate = SpeculationGate(explore=8, max_gap=32, warmup=(4, 2))
    pending = 100
    for _ in range(40):  # batch 1: the first drafting step runs the prompt
        on = gate.begin_step(1, pending)
        if on:
            gate.drafted(pending, 0.01 + per_token * pending)
        gate.end_step(150 if on else 100, 1.0)
        pending = 1
    pending, choices = 400, []
    for _ in range(60):
        on = gate.begin_step(4, pending)
        choices.append(on)
        if on:
            gate.drafted(pending, 0.01 + per_token * pending)
            pending = 4
        else:
            pending += 4
        gate.end_step(300 if on else 380, 1.0)
    if per_token:
        assert not any(choices), choices
    else:
        assert choices.index(True) == 9, choices  # 2 plain warm-up steps, then 8 steps


@pytest.mark.parametrize("alone", [90.0, 115.0, 200.0])
def test_a_larger_batch_starts_without_drafts_and_tries_them_soon_only_where_they_paid_alone(alone):
    """A first batch of 4 after batch 1 was measured plays plain steps first (a draft model's first
    step there also prefills the prompts): where drafts paid alone (by 25% or more) it tries them
    after 8 steps, else only after max_gap."""
    from specee.speculative.gate import SpeculationGate

    gate = SpeculationGate(explore=8, max_gap=32, warmup=(4, 2))
    pays_alone = alone >= 125.0  # against 100 tokens/s without drafts
    for _ in range(40):
        on = gate.begin_step(1)
        gate.end_step(int(alone if on else 100.0), 1.0)
    choices = []
    for _ in range(24):
        on = gate.begin_step(4)
        choices.append(on)
        gate.end_step(int({True: 150.0, False: 380.0}[on]), 1.0)
    first_try = choices.index(True) if any(choices) else len(choices)
    assert not any(choices[:first_try]) and choices[first_try:first_try + 2] in ([True, True], [True], [])  # switch + measured
    if pays_alone:  # tried after 8 steps
        assert first_try == 2 + 7, choices
    else:  # not within max_gap (32) steps
        assert not any(choices), choices
