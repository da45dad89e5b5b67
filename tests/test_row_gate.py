"""The row gate (specee/speculative/row_gate.py): which requests draft their n-gram chains, from the
measured acceptance per match length and the measured cost of a row."""
import pytest
from checkpoints import make_checkpoint
from engine_helpers import SMALL

from specee import LLM, SamplingParams
from specee.drafters.ngram import NGramDrafter
from specee.engine.engine import Engine
from specee.engine.sequence import Sequence
from specee.engine import scheduler
from specee.engine.decoding import FullDepth
from specee.engine.kv_manager import BLOCK_SIZE
from specee.speculative.row_gate import EXPLORE, PROBE, Acceptance, RowGate, Shadow, StepCost
from specee.speculative.speculative import SpeculativeDecoding


def test_acceptance_counts_the_positions_a_chain_reached():
    acc = Acceptance(max_match=3, positions=3, decay=1.0)
    assert acc.chances(3, 3) == [0.5, 0.25, 0.125]  # the prior: each position accepted half the time
    for _ in range(8):
        acc.record(3, drafted=3, accepted=1)  # first accepted, second rejected, third never verified
    first, second, third = acc.chances(3, 3)
    assert first == pytest.approx(9 / 10)
    assert second == pytest.approx(first * 1 / 10)
    assert third == pytest.approx(second * 1 / 2)  # unchanged: no chain reached it
    assert acc.chances(2, 3) == [0.5, 0.25, 0.125]  # another match length has its own counts
    assert acc.best_first(1) == pytest.approx(0.9) and acc.best_first(3) == pytest.approx(0.9)


def test_step_cost_fits_a_line_and_keeps_its_slope_while_the_rows_do_not_vary():
    cost = StepCost(decay=1.0)
    cost.add(8, 0.011)
    assert not cost.known  # one size of step: no slope yet
    for rows, seconds in [(8, 0.011), (12, 0.015), (16, 0.019), (8, 0.011)]:
        cost.add(rows, seconds)
    assert cost.known and cost.b == pytest.approx(0.001) and cost.a == pytest.approx(0.003)
    for _ in range(50):
        cost.add(8, 0.012)  # the machine slowed; every step has 8 rows
    assert cost.b == pytest.approx(0.001, rel=0.2) and cost.a + 8 * cost.b == pytest.approx(0.012, rel=0.05)


def gate_with(a: float, b: float, first: float, matches: int = 3) -> RowGate:
    """A gate whose row costs b (steps a + b * rows) and whose 3-token chains' drafts are each
    accepted with chance `first` given the ones before."""
    gate = RowGate(min_match=1, max_match=3, positions=3)
    gate.cost.a, gate.cost.b, gate.cost.known = a, b, True
    gate.acceptance.decay = 1.0
    gate.acceptance.accepted[matches] = [first * 1000] * 3
    gate.acceptance.seen[matches] = [1000.0] * 3
    return gate


def chains(found: dict[int, list[int]]):
    looked = []

    def look(i):
        looked.append(i)
        ids = found.get(i, [])
        return (3 if ids else 0), ids

    return look, looked


def test_one_request_drafts_what_is_likely_enough_and_a_busy_batch_does_not():
    look, looked = chains({0: [5, 6, 7]})
    assert gate_with(a=0.004, b=0.0005, first=0.8).choose([10], False, look) == [[5, 6, 7]]  # 0.51 * 4.5 > 0.5
    look, _ = chains({0: [5, 6, 7]})
    assert gate_with(a=0.004, b=0.0005, first=0.3).choose([10], False, look) == [[5]]  # 0.09 * 4.5 < 0.5
    look, _ = chains({0: [5, 6, 7]})
    assert gate_with(a=0.004, b=0.0005, first=0.05).choose([10], False, look) == [[]]
    # requests waiting: a token saves b + a / 8 = 1.5 ms, a row costs 1 ms: only a chance above 2/3 pays
    gate = gate_with(a=0.004, b=0.001, first=0.8)
    look, looked = chains({i: [5, 6, 7] for i in range(8)})
    assert gate.choose([100] * 8, True, look) == [[5]] * 8 and looked == list(range(8))
    assert gate.rows == 16


def test_with_nobody_waiting_only_the_requests_the_batch_waits_for_draft():
    gate = gate_with(a=0.004, b=0.001, first=0.9)
    look, looked = chains({i: [5, 6, 7] for i in range(4)})
    drafts = gate.choose([50, 80, 30, 80], False, look)  # requests 1 and 3 have the most left
    assert looked == [1, 3]
    assert drafts[0] == drafts[2] == [] and drafts[1] and drafts[3]
    look, looked = chains({i: [5, 6, 7] for i in range(4)})
    assert gate.choose([50, 80, 30, 79], False, look) == [[], [5, 6, 7], [], []] and looked == [1]
    # tied requests move the batch's end only together: one without a chain stops the search
    look, looked = chains({0: [5, 6, 7], 2: [5, 6, 7], 3: [5, 6, 7]})
    assert gate.choose([80] * 4, False, look) == [[]] * 4 and looked == [0, 1]
    # eight tied that each move with chance 0.7: together 0.08 of a step, not worth a row
    gate = gate_with(a=0.004, b=0.001, first=0.7)
    look, looked = chains({i: [5, 6, 7] for i in range(8)})
    assert gate.choose([80] * 8, False, look) == [[]] * 8 and looked == []  # not even looked up


def test_an_unknown_row_cost_drafts_every_chain():
    gate = RowGate(min_match=1, max_match=3, positions=3)
    look, _ = chains({0: [5, 6], 1: [7, 8, 9]})
    assert gate.choose([5, 5], False, look) == [[5, 6], [7, 8, 9]] and gate.rows == 7


def test_a_shadow_chain_counts_what_the_request_then_emitted():
    gate = RowGate(min_match=1, max_match=3, positions=3)
    gate.acceptance.decay = 1.0
    shadow = gate.follow(Shadow(3, [5, 6, 7]), [5])
    assert shadow is not None and shadow.checked == 1
    assert gate.follow(shadow, [6, 9]) is None  # the third was not what came
    assert gate.acceptance.accepted[3] == [1.0, 1.0, 0.0] and gate.acceptance.seen[3] == [1.0, 1.0, 1.0]
    assert gate.follow(Shadow(2, [4]), [4, 1]) is None  # the whole chain came
    assert gate.acceptance.accepted[2][0] == 1.0 and gate.acceptance.chances(2, 1) == [2 / 3]


def sure_chains_engine(llm, max_num_seqs: int, drafter: NGramDrafter | None = None) -> Engine:
    """An engine of n-gram speculation whose row gate knows a row's cost (steps of 4 ms + 0.5 ms a
    row) and takes chains as nearly sure (95% each draft)."""
    drafter = drafter or NGramDrafter(3, llm.model.cfg.vocab_size)
    decoding = SpeculativeDecoding(llm.model, drafter, 3)
    decoding.row_gate.cost.a, decoding.row_gate.cost.b, decoding.row_gate.cost.known = 0.004, 0.0005, True
    decoding.row_gate.end_step = lambda seconds: None  # keep the cost the test set
    acceptance = decoding.row_gate.acceptance
    acceptance.decay = 1.0
    acceptance.accepted, acceptance.seen = [[950.0] * 3 for _ in range(4)], [[1000.0] * 3 for _ in range(4)]
    return Engine(llm.model, decoding, max_num_seqs=max_num_seqs)


@pytest.fixture(scope="module", params=[None, "int4"], ids=["float", "int4"])
def small_llm(request, tmp_path_factory):
    llm = LLM(make_checkpoint(tmp_path_factory.mktemp("row_gate"), SMALL, seed=2), dtype="float32",
              quantization=request.param)
    assert request.param is None or llm.model.fast_layers is not None  # int4 runs the C++ layer
    return llm


PROMPT = "one two three four five six " * 6  # the random model's output repeats a token from its 8th on


@pytest.mark.usefixtures("single_thread")
@pytest.mark.parametrize("waiting", [False, True], ids=["closed", "queue"])
def test_drafts_go_to_the_requests_the_batch_waits_for_unless_others_wait(small_llm, waiting):
    """Eight greedy requests (ten with a queue of two behind them), one with twice the tokens to go.
    A token saving b + a / 8 would pay for every chain: with requests waiting (a slot frees sooner)
    every request drafts; in a closed batch only the one the batch waits for does, and the seven
    others never. Every request gets the tokens it gets alone at full depth."""
    llm = small_llm
    ids = llm.tokenizer.encode(PROMPT)
    short, long = SamplingParams(max_tokens=12, ignore_eos=True), SamplingParams(max_tokens=24, ignore_eos=True)
    want = {p.max_tokens: llm.generate([ids], p)[0].token_ids for p in (short, long)}
    engine = sure_chains_engine(llm, max_num_seqs=8)
    seqs = [Sequence(ids, list(ids), long if i == 3 else short, llm.tokenizer, frozenset())
            for i in range(10 if waiting else 8)]
    for seq in seqs:
        engine.add_request(seq)
    while engine.has_unfinished():
        engine.step()
    for i, seq in enumerate(seqs):
        assert seq.output_ids == want[seq.params.max_tokens], i
    acceptance = engine.decoding.row_gate.acceptance  # verified chains counted under their match length
    assert acceptance.seen[0] == [1000.0] * 3 and sum(map(sum, acceptance.seen[1:])) > 3 * 3 * 1000
    drafts = [seq.stats.speculative["drafts"] for seq in seqs]
    if waiting:
        assert all(d > 0 for d in drafts[:8]), drafts
    else:
        assert drafts[3] > 0 and drafts[:3] + drafts[4:] == [0] * 7, drafts


class RightChains(NGramDrafter):
    """Chains of the target's own greedy continuation of one prompt (every draft accepted), as if
    matched on 3 tokens."""

    def __init__(self, vocab_size: int, prompt_len: int, continuation: list[int]):
        super().__init__(3, vocab_size)
        self.prompt_len, self.continuation = prompt_len, continuation

    def chain(self, n: int) -> list[int]:
        done = len(self.history) - self.prompt_len
        self.match = 3
        return self.continuation[done : done + n]


def test_a_low_acceptance_reading_recovers_through_shadows(small_llm):
    """Every chain looks hopeless (1 in 22), so none is looked up where a draft may pay; but one
    request's chain is looked up every EXPLORE steps and checked against what it emits (a shadow):
    its chains are right, the reading recovers within a few, and drafts resume. Without the shadows
    nothing would ever be looked up again."""
    llm = small_llm
    ids = llm.tokenizer.encode(PROMPT)
    params = SamplingParams(max_tokens=llm.model.cfg.max_position_embeddings - len(ids) - 4, ignore_eos=True)
    want = llm.generate([ids], params)[0].token_ids
    engine = sure_chains_engine(llm, max_num_seqs=8, drafter=RightChains(llm.model.cfg.vocab_size, len(ids), want))
    acceptance = engine.decoding.row_gate.acceptance
    acceptance.accepted, acceptance.seen = [[0.0] * 3 for _ in range(4)], [[20.0] * 3 for _ in range(4)]
    seq = Sequence(ids, list(ids), params, llm.tokenizer, frozenset())
    engine.add_request(seq)
    while engine.has_unfinished():
        engine.step()
    assert seq.output_ids == want
    assert acceptance.accepted[3][0] >= 2  # shadows' accepted first drafts, then the drafts'
    assert seq.stats.speculative["drafts"] > 0


def test_with_nothing_paying_a_probe_drafts_one_token_now_and_then():
    """Eight tied requests whose drafts do not pay: one chain is looked up every EXPLORE steps, and
    after PROBE steps without a draft one of them drafts one token, so that a row's cost is measured
    again where the batch is (one slow step had made it too steep for good)."""
    gate = gate_with(a=0.004, b=0.001, first=0.7)
    looked_at, drafted_at = [], []
    for step in range(4 * PROBE):
        look, looked = chains({i: [5, 6, 7] for i in range(8)})
        drafts = gate.choose([80] * 8, False, look)
        looked_at += [step] * len(looked)
        drafted_at += [step] * sum(map(len, drafts))
        assert sum(map(len, drafts)) <= 1
    assert len(looked_at) in range(4 * PROBE // (EXPLORE + 1) - 1, 4 * PROBE // EXPLORE + 1)
    assert len(drafted_at) >= 2 and all(b - a > PROBE for a, b in zip(drafted_at, drafted_at[1:]))


def test_step_cost_recovers_from_one_slow_step_once_rows_vary_again():
    cost = StepCost()
    for step in range(300):
        rows = 1 + (step % 64 == 0)  # a probe now and then
        cost.add(rows, 0.010 + 0.0001 * rows + (0.040 if step == 2 else 0.0))
    assert cost.known and cost.b == pytest.approx(0.0001, abs=0.0005)


@pytest.mark.usefixtures("single_thread")
def test_requests_parked_out_of_the_pool_count_as_waiting(small_llm, monkeypatch):
    """A request parked until blocks come free waits as a queued one does: drafts that free a slot
    sooner pay for it too."""
    monkeypatch.setattr(scheduler, "FIRST_ROOM", 2)
    decoding = FullDepth(small_llm.model)
    seen = []
    engine = Engine(small_llm.model, decoding, kv_cache_memory=5 * BLOCK_SIZE)
    monkeypatch.setattr(decoding, "begin_step", lambda batch, waiting: seen.append(
        (waiting, bool(engine.scheduler.parked), bool(engine.scheduler.waiting))))
    for prompt in ("one two three", "four five six seven", "eight nine"):
        engine.add_request(Sequence(prompt, small_llm.encode(prompt), SamplingParams(max_tokens=40, ignore_eos=True),
                                    small_llm.tokenizer, frozenset()))
    while engine.has_unfinished():
        engine.step()
    assert any(parked and not queued for _, parked, queued in seen)
    assert all(waiting == (parked or queued) for waiting, parked, queued in seen)
