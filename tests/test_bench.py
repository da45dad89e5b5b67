"""Benchmarks (specee.bench): the quality metrics on cases with known answers, the statistics,
prompt selection, the oracle, and every `specee bench` subcommand end to end (stories260K,
n-gram drafter, hand-built predictor banks; SPECEE_CACHE in a temporary directory)."""
from __future__ import annotations

import argparse
import json
import math
import sys
from datetime import datetime
from pathlib import Path

import pytest
import torch

from conftest import real_model_dir

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# ---- fixtures ------------------------------------------------------------------------------------
@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECEE_CACHE", str(tmp_path / "specee-cache"))


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny-model decode steps are dominated by thread hand-offs; one thread is ~10x faster on a
    busy machine. Restored after this module."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def llm():
    """A private stories260K LLM (not the session one: the benchmarks switch its early-exit config)."""
    from specee import LLM

    return LLM(real_model_dir("stories260K"), dtype="float32", progress=False)


def save_bank(llm, path: Path, k: int, thresholds: list[float], offline: list[int], seed: int | None = None) -> str:
    """A predictor bank for this target + the n-gram drafter. seed=None: all-zero predictors
    (probability 0.5 everywhere, so a layer fires iff its threshold is below 0.5); else random ones."""
    from specee.exit.bank import PredictorBank

    L, hidden = llm.model.cfg.num_layers, 4
    if seed is None:
        w1, w2 = torch.zeros(L, 3 * k, hidden), torch.zeros(L, hidden)
    else:
        g = torch.Generator().manual_seed(seed)
        w1, w2 = torch.randn(L, 3 * k, hidden, generator=g), torch.randn(L, hidden, generator=g)
    drafter = llm.make_drafter("ngram", k)
    PredictorBank(w1, torch.zeros(L, hidden), w2, torch.zeros(L), thresholds, offline, k,
                  llm.fingerprint, drafter.fingerprint).save(path)
    return str(path)


@pytest.fixture(scope="module")
def banks(llm, tmp_path_factory):
    L = llm.model.cfg.num_layers
    V = llm.model.cfg.vocab_size
    root = tmp_path_factory.mktemp("banks")
    return {
        # every threshold inf: no predictor ever runs, every token at full depth
        "never": (save_bank(llm, root / "never", 4, [math.inf] * L, []), 4),
        # layer 0 always fires (threshold below any probability), the rest disabled; with k = the
        # vocabulary the layer-0 argmax is always a speculative token, so every token exits at layer 0
        "layer0_all": (save_bank(llm, root / "layer0_all", V, [-1.0] + [math.inf] * (L - 1), [0]), V),
        # layer 0 always fires, k = 4 n-gram proposals: exits exactly where layer 0's argmax is proposed
        "layer0_k4": (save_bank(llm, root / "layer0_k4", 4, [-1.0] + [math.inf] * (L - 1), [0]), 4),
        # random predictors with threshold 0.5 on the first layers: some exits, some rejections
        "random": (save_bank(llm, root / "random", 4, [0.5] * (L - 1) + [math.inf], [0, 1, 2], seed=0), 4),
    }


def config(bank, policy="recompute", **kw):
    from specee.bench.common import make_config

    path, k = bank
    return make_config("ngram", path, k, kv_policy=policy, max_pending=10**6, **kw)


@pytest.fixture(scope="module")
def cases(llm):
    """Two prompts with their full-depth greedy continuations (EOS included if reached)."""
    from specee.bench.quality import full_depth_continuations

    ids = [llm.encode("Once upon a time, there was a little dog."), llm.encode("Lily and Tom went to the park.")]
    return ids, full_depth_continuations(llm, ids, 24)


@torch.inference_mode()
def layer_lens(llm, prompt: list[int], cont: list[int], layer: int) -> torch.Tensor:
    """Independent reference: log-softmax of layer `layer`'s logit lens at the positions that
    predict `cont` (one teacher-forced pass over all layers)."""
    h = llm.model.hidden_states(prompt + cont[:-1])[layer + 1, len(prompt) - 1:]
    return torch.log_softmax(llm.model.logits(h).float(), dim=-1)


# ---- statistics & prompt selection ---------------------------------------------------------------
def test_wilson_and_mcnemar_known_values():
    from specee.bench.common import mcnemar, wilson

    lo, hi = wilson(5, 10)
    assert lo == pytest.approx(0.2366, abs=1e-4) and hi == pytest.approx(0.7634, abs=1e-4)
    assert wilson(0, 10)[0] == 0.0 and wilson(0, 10)[1] == pytest.approx(0.2775, abs=1e-4)
    assert wilson(10, 10)[1] == pytest.approx(1.0)
    assert wilson(0, 0) == (0.0, 1.0)
    assert mcnemar(0, 0) == 1.0
    assert mcnemar(0, 5) == pytest.approx(0.0625)  # 2 * 0.5**5
    assert mcnemar(9, 1) == pytest.approx(2 * 11 / 1024)
    assert mcnemar(3, 3) == 1.0


def test_paired_accuracy_hand_built_case():
    """Seven items, gold / full / early-exit answers chosen by hand: full 5 right, early exit 3; items
    0-2 right -> wrong (b = 3), item 6 wrong -> right (c = 1), four answers changed."""
    from specee.bench.common import wilson
    from specee.bench.quality import paired_accuracy

    gold = [0, 0, 0, 0, 0, 1, 1]
    full = [0, 0, 0, 0, 1, 1, 2]
    ee = [1, 2, 1, 0, 1, 1, 1]
    f, e = paired_accuracy(gold, full, ee)
    assert f == {"accuracy": 5 / 7, "correct": 5, "ci95": list(wilson(5, 7))}
    assert e == {"accuracy": 3 / 7, "correct": 3, "ci95": list(wilson(3, 7)), "delta": -2 / 7,
                 "answers_changed": 4, "full_right_ee_wrong": 3, "full_wrong_ee_right": 1,
                 "mcnemar_p": 0.625}  # 2 * P(X <= 1), X ~ Binomial(4, 1/2) = 2 * 5/16
    f, e = paired_accuracy([], [], [])
    assert (f["accuracy"], f["ci95"], e["delta"], e["mcnemar_p"]) == (None, [0.0, 1.0], None, 1.0)


def test_prompt_selection(tmp_path):
    from specee.bench.common import BenchError
    from specee.bench.tasks import load_prompts

    f = tmp_path / "p.jsonl"
    rows = [{"question_id": i, "category": c, "turns": [f"{c} {i}", "second turn"]}
            for i, c in enumerate(["a", "a", "a", "b", "b", "c"])]
    f.write_text("\n".join(json.dumps(r) for r in rows))
    assert [p.id for p in load_prompts(f, count=2)] == ["0", "1", "3", "4", "5"]
    assert [p.text for p in load_prompts(f, categories=["b"])] == ["b 3", "b 4"]
    picked = load_prompts(f, total=4)
    assert sorted(p.category for p in picked) == ["a", "a", "b", "c"]  # round-robin keeps every category
    with pytest.raises(BenchError, match="unknown categories"):
        load_prompts(f, categories=["zzz"])
    txt = tmp_path / "p.txt"
    txt.write_text("hello\nworld\n")
    assert [p.text for p in load_prompts(txt)] == ["hello", "world"]


def test_spec_bench_default_set():
    from specee.bench.tasks import load_prompts

    real_model_dir("stories260K")  # skips without ../shared
    ps = load_prompts(count=1)
    assert len(ps) == 13 and len({p.category for p in ps}) == 13


# ---- quality metrics on known cases --------------------------------------------------------------
@pytest.mark.parametrize("policy", ["skip", "propagate", "recompute"])
def test_exit_disabled_gives_full_model(llm, banks, cases, policy):
    """A bank whose thresholds are all inf: agreement 1.0 and the full model's perplexity."""
    from specee.bench.common import use_config
    from specee.bench.quality import agreement, perplexity_early_exit, perplexity_full, perplexity_windows

    ids, conts = cases
    windows = perplexity_windows(llm, conts[0] + conts[1], 40, 16)
    full = perplexity_full(llm, windows)
    use_config(llm, config(banks["never"], policy))
    try:
        a = agreement(llm, ids, conts, ["x", "y"])
        ee = perplexity_early_exit(llm, windows)
    finally:
        use_config(llm, None)
    assert a["agreement"] == 1.0 and a["positions"] == sum(map(len, conts))
    assert a["exit_rate"] == 0.0 and a["mean_exit_layer"] == llm.model.cfg.num_layers
    assert a["per_category"] == {"x": {"agreement": 1.0, "positions": len(conts[0])},
                                 "y": {"agreement": 1.0, "positions": len(conts[1])}}
    assert ee["tokens"] == full["tokens"] == 40
    assert ee["perplexity"] == pytest.approx(full["perplexity"], rel=1e-4)
    assert ee["next_token_accuracy"] == full["next_token_accuracy"]


@pytest.mark.parametrize("policy", ["skip", "propagate", "recompute"])
def test_always_layer0_equals_layer0_logit_lens(llm, banks, cases, policy):
    """Every token exits at layer 0: agreement and perplexity are exactly the layer-0 head's."""
    from specee.bench.common import use_config
    from specee.bench.quality import agreement, perplexity_early_exit, perplexity_windows

    ids, conts = cases
    windows = perplexity_windows(llm, conts[0] + conts[1], 30, 16)
    use_config(llm, config(banks["layer0_all"], policy))
    try:
        a = agreement(llm, ids, conts)
        ee = perplexity_early_exit(llm, windows)
    finally:
        use_config(llm, None)
    right = n = 0
    for p, c in zip(ids, conts):
        lens = layer_lens(llm, p, c, 0)
        right += int((lens.argmax(-1) == torch.tensor(c)).sum())
        n += len(c)
    assert a["mean_exit_layer"] == 1.0 and a["exit_rate"] == 1.0
    assert a["agreement"] == pytest.approx(right / n)
    assert a["agreement"] < 1.0  # layer 0 alone is not the full model
    total = sum(float(layer_lens(llm, ctx, cont, 0).gather(1, torch.tensor(cont)[:, None]).sum())
                for ctx, cont in windows)
    assert ee["perplexity"] == pytest.approx(math.exp(-total / ee["tokens"]), rel=1e-4)
    assert ee["mean_exit_layer"] == 1.0


def test_layer0_with_drafter_restriction(llm, banks, cases):
    """k = 4 n-gram proposals, layer 0 always fires (recompute: exact KV). Each position exits at
    layer 0 iff layer 0's argmax is proposed, else runs to full depth; checked against hidden_states
    and the drafter's teacher-forced top-k computed independently."""
    from specee.bench.common import use_config

    ids, conts = cases
    L = llm.model.cfg.num_layers
    use_config(llm, config(banks["layer0_k4"], "recompute"))
    try:
        drafter = llm.early_exit.drafter
        exits = 0
        for p, c in zip(ids, conts):
            steps = llm.teacher_forced(p, c)
            lens0, lensL = layer_lens(llm, p, c, 0), layer_lens(llm, p, c, L - 1)
            top = drafter.teacher_forced_top_k(p + c, len(p)).cpu()
            for j, s in enumerate(steps):
                a0 = int(lens0[j].argmax())
                if a0 in top[j].tolist():
                    exits += 1
                    assert (s.exit_layer, s.predicted) == (0, a0)
                    assert s.logprob == pytest.approx(float(lens0[j, c[j]]), abs=1e-4)
                else:
                    assert (s.exit_layer, s.predicted) == (L - 1, int(lensL[j].argmax()))
                    assert s.logprob == pytest.approx(float(lensL[j, c[j]]), abs=1e-4)
        assert exits > 0
    finally:
        use_config(llm, None)


def _mc_items(llm):
    from specee.bench.tasks import MCItem

    shot = MCItem("t", "s0", "Is the sky blue?", ["no", "yes"], 1)
    qs = [("What does a dog say?", ["moo", "woof", "meow"], 1), ("Where do fish live?", ["water", "tree", "sky"], 0),
          ("What color is grass?", ["red", "blue", "green"], 2), ("Who is happy?", ["Lily", "nobody", "the rock"], 0)]
    return [MCItem("t", str(i), q, o, a, shots=[shot]) for i, (q, o, a) in enumerate(qs)]


def test_multiple_choice_known_cases(llm, banks):
    from specee.bench.common import mcnemar, use_config, wilson
    from specee.bench.quality import score_mc
    from specee.bench.tasks import encode_mc

    items = _mc_items(llm)
    use_config(llm, config(banks["never"]))
    try:
        r = score_mc(llm, items)
    finally:
        use_config(llm, None)
    assert r["items"] == 4 and r["skipped_too_long"] == 0
    assert r["early_exit"]["accuracy"] == r["full"]["accuracy"]
    assert r["early_exit"]["answers_changed"] == 0 and r["early_exit"]["mcnemar_p"] == 1.0
    assert r["early_exit"]["mean_exit_layer"] == llm.model.cfg.num_layers
    correct = sum(x["full"] == x["gold"] for x in r["per_item"])
    assert r["full"]["correct"] == r["early_exit"]["correct"] == correct
    assert r["full"]["accuracy"] == correct / 4 and r["full"]["ci95"] == list(wilson(correct, 4))

    # always layer 0: early exit answers with the layer-0 logit lens at the answer position
    use_config(llm, config(banks["layer0_all"]))
    try:
        r0 = score_mc(llm, items)
        expect_full, expect_l0 = [], []
        for it in items:
            ids, cands, _ = encode_mc(llm, it, r0["answer_format"][len("Answer:"):-1])
            hs = llm.model.hidden_states(ids)
            expect_full.append("ABC"[int(llm.model.logits(hs[-1, -1])[cands].argmax())])
            expect_l0.append("ABC"[int(llm.model.logits(hs[1, -1])[cands].argmax())])
    finally:
        use_config(llm, None)
    assert [x["full"] for x in r0["per_item"]] == expect_full
    assert [x["early_exit"] for x in r0["per_item"]] == expect_l0
    assert r0["early_exit"]["mean_exit_layer"] == 1.0
    assert r0["early_exit"]["max_logprob_deviation"] < 1e-4
    changed = sum(a != b for a, b in zip(expect_full, expect_l0))
    assert r0["early_exit"]["answers_changed"] == changed
    gold = [x["gold"] for x in r0["per_item"]]
    b = sum(f == g != e for f, e, g in zip(expect_full, expect_l0, gold))  # full right, early exit wrong
    c = sum(e == g != f for f, e, g in zip(expect_full, expect_l0, gold))
    ee_right = sum(e == g for e, g in zip(expect_l0, gold))
    assert (r0["early_exit"]["full_right_ee_wrong"], r0["early_exit"]["full_wrong_ee_right"]) == (b, c)
    assert r0["early_exit"]["mcnemar_p"] == mcnemar(b, c)
    assert r0["early_exit"]["correct"] == ee_right and r0["early_exit"]["ci95"] == list(wilson(ee_right, 4))
    assert r0["early_exit"]["delta"] == pytest.approx((ee_right - r0["full"]["correct"]) / 4)


def test_oracle_matches_bruteforce(llm, cases):
    from specee.bench.oracle import oracle_exit_layers

    ids, conts = cases
    L = llm.model.cfg.num_layers
    drafter = llm.make_drafter("ngram", 4)
    for p, c in zip(ids, conts):
        r = oracle_exit_layers(llm, drafter, p, c)
        preds = [layer_lens(llm, p, c, i).argmax(-1).tolist() for i in range(L)]
        top = drafter.teacher_forced_top_k(p + c, len(p)).tolist()
        for j, tok in enumerate(c):
            free = L
            for e in range(L):
                if all(preds[i][j] == tok for i in range(e, L)):
                    free = e + 1
                    break
            assert int(r["free"][j]) == free
            assert bool(r["hit"][j]) == (tok in top[j])
            assert int(r["drafter"][j]) == (free if tok in top[j] else L)


# ---- the CLI end to end ----------------------------------------------------------------------------
def run_cli(argv: list[str], capsys):
    """Run `specee <argv>` in process (recording argv as the command line, as `main` does); returns
    the captured (out, err)."""
    from specee.bench.cli import add_bench_parser

    parser = argparse.ArgumentParser(prog="specee")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    args._argv = ["specee", *argv]
    assert args.func(args) == 0
    return capsys.readouterr()


def common_args(out: Path) -> list[str]:
    return ["--model", str(real_model_dir("stories260K")), "--draft", "ngram", "--count", "1", "--threads", "1",
            "--categories", "writing,qa", "--out", str(out), "--no-progress"]


def check_outputs(out: Path, llm, argv: list[str]) -> dict:
    """report.json's environment record describes this run exactly; report.md is this benchmark's."""
    report = json.loads((out / "report.json").read_text())
    assert report["benchmark"] == argv[1]
    env = report["environment"]
    cfg = llm.model.cfg
    assert env["target"] == {"path": str(real_model_dir("stories260K").resolve()), "fingerprint": llm.fingerprint,
                             "layers": 5, "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size}
    assert (env["dtype"], env["device"], env["torch"], env["torch_threads"]) == ("float32", "cpu", torch.__version__, 1)
    assert env["command"] == ["specee", *argv]
    assert datetime.fromisoformat(env["date"]).tzinfo is not None
    assert env["drafter"]["source"] == "ngram" and env["drafter"]["name"].startswith("ngram")
    md = (out / "report.md").read_text()
    assert md.startswith(f"# specee bench {argv[1]}\n") and "| date |" in md
    return report


def check_figures(out: Path, pngs: list[str]) -> None:
    """Exactly these PNG figures were written and report.md links them. Called last in a test: it
    skips where matplotlib (the optional specee[plots] extra) is not installed."""
    pytest.importorskip("matplotlib", reason="the benchmark figures need matplotlib: pip install 'specee[plots]'")
    md = (out / "report.md").read_text()
    assert sorted(p.name for p in out.glob("*.png")) == sorted(pngs)
    for name in pngs:
        data = (out / name).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 5000, name
        assert f"![{Path(name).stem}]({name})" in md


def md_rows(md: str, header_start: str) -> dict[str, list[str]]:
    """The body of the Markdown table whose header line starts with `header_start`: first cell -> the others."""
    lines = md.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    rows = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rows[cells[0]] = cells[1:]
    return rows


def mean_layers(hist: list[int]) -> float:
    """Mean layers run from an exit histogram (entry i: steps that left after layer i + 1), by hand."""
    return sum((i + 1) * h for i, h in enumerate(hist)) / sum(hist)


def test_cli_speed(tmp_path, llm, banks, capsys):
    out = tmp_path / "speed"
    argv = ["bench", "speed", *common_args(out), "--bank", banks["random"][0], "--max-new-tokens", "8",
            "--repeats", "1", "--warmup", "0", "--policies", "skip,recompute", "--oracle-layers", "3"]
    stdout = run_cli(argv, capsys).out
    assert "| configuration | tokens/s |" in stdout and "lossless vs full depth" in stdout
    assert "Where the time goes" in stdout and "ceiling at oracle depth 3.00" in stdout
    r = check_outputs(out, llm, argv)
    assert r["order"] == ["transformers", "full", "ee-skip", "ee-recompute", "lossless"]
    assert [p["category"] for p in r["prompts"]] == ["writing", "qa"]
    full, hf = r["configs"]["full"], r["configs"]["transformers"]
    for name, c in r["configs"].items():
        # EOS ignored: every configuration decodes exactly --max-new-tokens tokens per prompt
        assert [p["tokens"] for p in c["per_prompt"]] == [8, 8] and c["tokens"] == 16
        assert c["seconds"] == pytest.approx(sum(p["seconds"] for p in c["per_prompt"]))
        assert c["tokens_per_second"] == pytest.approx(16 / c["seconds"])
        assert c["speedup_vs_full"] == pytest.approx(c["tokens_per_second"] / full["tokens_per_second"])
        assert c["speedup_vs_hf"] == pytest.approx(c["tokens_per_second"] / hf["tokens_per_second"])
        assert c["decode_speedup_vs_full"] == pytest.approx(c["decode_tokens_per_second"]
                                                            / full["decode_tokens_per_second"])
        assert list(c["per_category"]) == ["writing", "qa"]
        for p in c["per_prompt"]:  # one prompt per category: the category's figures are the prompt's
            cat = c["per_category"][p["category"]]
            assert (cat["prompts"], cat["tokens"]) == (1, 8)
            assert cat["tokens_per_second"] == pytest.approx(8 / p["seconds"])
            assert cat["speedup_vs_full"] == pytest.approx(
                cat["tokens_per_second"] / full["per_category"][p["category"]]["tokens_per_second"])
        if c["kind"] == "early_exit":
            hist = c["exit_histogram"]
            assert len(hist) == 5 and sum(hist) == c["decode_steps"]
            assert c["mean_exit_layer"] == pytest.approx(mean_layers(hist))
            # lossy: one decode step per token; lossless also redoes the steps a rollback discards
            assert c["decode_steps"] == 16 if c["mode"] == "lossy" else c["decode_steps"] >= 16
    assert r["configs"]["full"]["speedup_vs_full"] == pytest.approx(1.0)
    # the speedups printed are the ratios of the tokens/s printed in the same table (up to rounding)
    table = md_rows(stdout, "| configuration | tokens/s |")
    assert list(table) == [c["label"] for c in r["configs"].values()]
    base = {"full": table[full["label"]], "hf": table[hf["label"]]}
    for c in r["configs"].values():
        tps, dtps, _, sp_full, sp_hf, dsp_full = table[c["label"]]
        assert (tps, sp_full) == (f"{c['tokens_per_second']:.2f}", f"{c['speedup_vs_full']:.2f}")
        for shown, num, den in ((sp_full, tps, base["full"][0]), (sp_hf, tps, base["hf"][0]),
                                (dsp_full, dtps, base["full"][1])):
            num, den = float(num), float(den)
            assert float(shown) == pytest.approx(num / den, abs=0.0051 + 0.0051 * (num / den) * (1 / num + 1 / den))
    # lossless is exact: token-identical to full depth on every prompt (and transformers agrees here)
    assert r["identity"]["lossless"]["all_identical"] is True
    assert [x["identical"] for x in r["identity"]["lossless"]["per_prompt"]] == [True, True]
    assert r["identity"]["transformers"]["all_identical"] is True
    ll = r["configs"]["lossless"]["lossless"]
    assert ll["verified_per_deep_pass"] == (pytest.approx(ll["verified_positions"] / ll["deep_passes"])
                                            if ll["deep_passes"] else None)
    cost = r["cost"]
    assert (cost["oracle_layers"], cost["num_layers"]) == (3.0, 5)
    assert set(cost["configs"]) == {"full", "ee-skip", "ee-recompute", "lossless"}  # specee's own configs
    assert cost["configs"]["full"]["layers_ms"] == pytest.approx(5 * cost["layer_ms"])
    for name, c in cost["configs"].items():
        assert c["total_ms"] == pytest.approx(1e3 / r["configs"][name]["decode_tokens_per_second"])
        parts = [c["layers_ms"], c["other_ms"]] + [c.get(f"{p}_ms", 0.0) for p in ("drafter", "predictors", "verification")]
        assert sum(parts) == pytest.approx(c["total_ms"])
        if name != "full":
            assert c["layers_ms"] == pytest.approx(r["configs"][name]["mean_exit_layer"] * cost["layer_ms"])
    check_figures(out, ["exit_histogram.png", "throughput.png"])


@torch.inference_mode()
def test_layer_ms_times_the_engines_layer_call_of_decode_steps(tmp_path, monkeypatch):
    """A layer's cost is a decode step's layers in the one call the engine makes (the stack), median
    over steps, over the layer count; steps through all layers against half, one call a layer, put
    SmolLM2's 30 layers above its whole token (an Intel Xeon: 5.05 of 4.49 ms)."""
    from checkpoints import VARIANTS, make_checkpoint

    import specee.bench.cost as cost
    from specee.model.llama import Transformer

    model = Transformer.load(make_checkpoint(tmp_path / "m", VARIANTS["llama3"], seed=1), "cpu", torch.float32)
    L, calls = model.cfg.num_layers, []
    durations = [3.0, 1.0, 7.0, 2.0, 5.0]  # seconds each step's layer call takes on the scripted clock
    clock = {"now": 0.0}

    def fake_time(device):
        return clock["now"]

    layers = model.ragged_layers

    def timed_layers(first, last, h, batch):
        calls.append((first, last, h.shape[1], batch.rows))
        clock["now"] += durations[len(calls) - 1]
        return layers(first, last, h, batch)

    monkeypatch.setattr(cost, "device_time", fake_time)
    monkeypatch.setattr(model, "ragged_layers", timed_layers)
    got = cost.layer_ms(model, list(range(3, 40)), steps=len(durations))
    assert calls == [(0, L, 1, [1])] * len(durations)  # every layer in one call, one decode row
    assert got == pytest.approx(3.0 / L * 1e3)  # the median step's layers over L, in ms


def test_cost_breakdown_known_numbers():
    """Full depth 10 ms/token over 10 layers of 0.5 ms (other 5 ms); early exit 8 ms/token at 4 layers
    with a 2 ms drafter: the ceilings and the depths needed follow from those by hand."""
    from specee.bench.cost import cost_breakdown

    configs = {"full": {"kind": "full", "decode_tokens_per_second": 100.0},
               "ee": {"kind": "early_exit", "decode_tokens_per_second": 125.0, "mean_exit_layer": 4.0,
                      "time_share": {"drafter": 0.25, "predictors": 0.125, "verification": 0.0}}}
    cost = cost_breakdown(configs, 0.5, 10, oracle_layers=2.0)
    full, ee = cost["configs"]["full"], cost["configs"]["ee"]
    assert full["total_ms"] == pytest.approx(10) and full["other_ms"] == pytest.approx(5)
    assert (ee["total_ms"], ee["layers_ms"], ee["drafter_ms"], ee["predictors_ms"], ee["other_ms"]) == \
        pytest.approx((8, 2, 2, 1, 3))
    assert ee["ceiling_at_this_depth"] == pytest.approx(10 / 9)  # 2 + 5 + 2 ms
    assert ee["ceiling_at_oracle_depth"] == pytest.approx(10 / 8)  # 1 + 5 + 2 ms
    assert ee["ceiling_without_drafter_at_oracle_depth"] == pytest.approx(10 / 6)
    assert ee["layers_needed"]["1"] == pytest.approx(6) and ee["layers_needed"]["1.2"] == pytest.approx(8 / 3)
    assert ee["layers_needed"]["1.5"] < 0  # 1.5x would need the drafter and the rest to fit in 6.67 ms: no
    assert cost_breakdown({"ee": configs["ee"]}, 0.5, 10)["configs"] == {}  # nothing to compare with
    # exits inside speculation: 100 tokens in 40 passes of mean depth 8 -> 3.2 layers per token;
    # predictors 1 ms per token over 100 tokens and 50 checks -> 2 ms per check = 4 layers
    configs["merged"] = dict(configs["ee"], mean_exit_layer=8.0, decode_steps=100, predictor_calls=50,
                             speculative={"target_passes": 40})
    merged = cost_breakdown(configs, 0.5, 10)["configs"]["merged"]
    assert (merged["passes_per_token"], merged["layers_ms"]) == pytest.approx((0.4, 1.6))
    assert (merged["check_ms"], merged["check_layers"]) == pytest.approx((2.0, 4.0))


def test_cli_quality(tmp_path, llm, banks, capsys):
    from specee.bench.common import mcnemar, wilson

    out = tmp_path / "quality"
    argv = ["bench", "quality", *common_args(out), "--bank", banks["random"][0], "--max-new-tokens", "8",
            "--policies", "skip,recompute", "--ppl-tokens", "24", "--ppl-window", "16",
            "--mc-items", "3", "--shots", "1", "--mmlu-subjects", "astronomy,virology"]
    stdout = run_cli(argv, capsys).out
    assert "## Agreement" in stdout and "## Perplexity" in stdout and "## Multiple choice" in stdout
    r = check_outputs(out, llm, argv)
    for policy in ("skip", "recompute"):
        a = r["agreement"]["policies"][policy]
        n, hist = a["positions"], a["exit_histogram"]
        assert n == r["agreement"]["continuation_tokens"] == sum(p["positions"] for p in a["per_prompt"])
        assert len(hist) == 5 and sum(hist) == n
        assert a["mean_exit_layer"] == pytest.approx(mean_layers(hist))
        assert a["exit_rate"] == pytest.approx((n - hist[-1]) / n)
        assert a["agreement"] == pytest.approx(sum(p["agreement"] * p["positions"] for p in a["per_prompt"]) / n)
        assert a["per_category"] == {p["category"]: {"agreement": pytest.approx(p["agreement"]),
                                                     "positions": p["positions"]} for p in a["per_prompt"]}
        assert list(a["per_category"]) == ["writing", "qa"]
    ppl = r["perplexity"]
    # 24 tokens in windows of 16 whose first two tokens are context: 14 + 10 scored
    assert (ppl["window"], ppl["windows"]) == (16, 2)
    full = ppl["full"]
    assert full["tokens"] == 24 and full["perplexity"] == pytest.approx(math.exp(-full["mean_logprob"]))
    for policy in ("skip", "recompute"):
        p = ppl["early_exit"][policy]
        assert p["tokens"] == sum(p["exit_histogram"]) == 24
        assert p["perplexity"] == pytest.approx(math.exp(-p["mean_logprob"]))
        assert p["ratio_to_full"] == pytest.approx(p["perplexity"] / full["perplexity"])
    assert list(r["multiple_choice"]["tasks"]) == ["csqa", "sst2", "mmlu"]
    for task in r["multiple_choice"]["tasks"].values():
        items = task["per_item"]
        assert task["items"] == len(items) == 3
        right = {who: [x[who] == x["gold"] for x in items] for who in ("full", "early_exit")}
        for who, ok in right.items():
            assert (task[who]["correct"], task[who]["accuracy"]) == (sum(ok), sum(ok) / 3)
            assert task[who]["ci95"] == list(wilson(sum(ok), 3))
        ee = task["early_exit"]
        b = sum(f and not e for f, e in zip(right["full"], right["early_exit"]))
        c = sum(e and not f for f, e in zip(right["full"], right["early_exit"]))
        assert (ee["full_right_ee_wrong"], ee["full_wrong_ee_right"], ee["mcnemar_p"]) == (b, c, mcnemar(b, c))
        assert ee["answers_changed"] == sum(x["full"] != x["early_exit"] for x in items)
        assert sum(ee["exit_histogram"]) == 3 and ee["mean_exit_layer"] == pytest.approx(mean_layers(ee["exit_histogram"]))
    assert {x["id"].split("/")[0] for x in r["multiple_choice"]["tasks"]["mmlu"]["per_item"]} == {"astronomy", "virology"}
    check_figures(out, ["quality.png"])


def test_cli_oracle(tmp_path, llm, capsys):
    out = tmp_path / "oracle"
    argv = ["bench", "oracle", *common_args(out), "--max-new-tokens", "12"]
    stdout = run_cli(argv, capsys).out
    assert "bound (L / mean)" in stdout
    r = check_outputs(out, llm, argv)
    o = r["overall"]
    n = o["drafter"]["positions"]
    assert list(r["per_category"]) == ["writing", "qa"]
    assert n == o["free"]["positions"] == sum(c["drafter"]["positions"] for c in r["per_category"].values())
    for s in (o["free"], o["drafter"]):
        hist = s["histogram"]
        assert len(hist) == 5 and sum(hist) == n
        assert s["mean_layers"] == pytest.approx(mean_layers(hist))
        assert s["bound"] == pytest.approx(5 / s["mean_layers"])
        assert s["share_full_depth"] == pytest.approx(hist[-1] / n)
    assert o["topk_hit_rate"] == pytest.approx(
        sum(c["topk_hit_rate"] * c["drafter"]["positions"] for c in r["per_category"].values()) / n)
    # the drafter restriction only moves positions to full depth: those its top-k misses
    free, drafter = o["free"]["histogram"], o["drafter"]["histogram"]
    assert all(d <= f for d, f in zip(drafter[:-1], free[:-1]))
    misses = round((1 - o["topk_hit_rate"]) * n)
    assert max(misses, free[-1]) <= drafter[-1] <= misses + free[-1]
    assert o["free"]["mean_layers"] <= o["drafter"]["mean_layers"]
    check_figures(out, ["oracle_exit_layers.png"])


def test_cli_sweep(tmp_path, llm, banks, capsys):
    from specee.bench.common import fit_prompt, make_config, resolve_chat, use_config
    from specee.bench.quality import agreement, full_depth_continuations
    from specee.bench.tasks import load_prompts

    out = tmp_path / "sweep"
    argv = ["bench", "sweep", *common_args(out), "--bank", banks["random"][0], "--max-new-tokens", "6",
            "--categories", "qa", "--scales", "0.5,1,4", "--offline-sizes", "bank", "--online-windows", "0,4",
            "--warmup", "0"]
    stdout = run_cli(argv, capsys).out
    assert "| threshold scale |" in stdout
    r = check_outputs(out, llm, argv)
    pts = r["points"]
    assert [(p["threshold_scale"], p["online_window"]) for p in pts] == [(0.5, 4), (1.0, 4), (4.0, 4), (1.0, 0)]
    assert sum(p["default"] for p in pts) == 1 and pts[1]["default"]
    full = r["full_depth"]
    for m in ("tokens_per_second", "decode_tokens_per_second"):
        assert full["baseline"][m] == pytest.approx((full["before"][m] + full["after"][m]) / 2)
    for p in pts:
        assert p["speedup_vs_full"] == pytest.approx(p["tokens_per_second"] / full["baseline"]["tokens_per_second"])
        assert p["decode_speedup_vs_full"] == pytest.approx(p["decode_tokens_per_second"]
                                                            / full["baseline"]["decode_tokens_per_second"])
        assert sum(p["exit_histogram"]) == 6 and p["mean_exit_layer"] == pytest.approx(mean_layers(p["exit_histogram"]))

    def dominated(p):
        return any(q["agreement"] >= p["agreement"] and q["speedup_vs_full"] >= p["speedup_vs_full"]
                   and (q["agreement"], q["speedup_vs_full"]) != (p["agreement"], p["speedup_vs_full"]) for q in pts)

    assert [p["pareto"] for p in pts] == [not dominated(p) for p in pts]
    # each point's agreement is bench quality's teacher-forced agreement under that point's config
    prompt = load_prompts(categories=["qa"], count=1)[0]
    ids = fit_prompt(llm, prompt.text, resolve_chat(llm, "auto"), 6)[0]
    conts = full_depth_continuations(llm, [ids], 6)
    try:
        for p in pts:
            use_config(llm, make_config("ngram", banks["random"][0], 4, kv_policy="recompute", mode="lossy",
                                        threshold_scale=p["threshold_scale"], offline_size=None,
                                        online_window=p["online_window"], online_radius=1, max_pending=8))
            a = agreement(llm, [ids], conts)
            assert (p["agreement"], p["teacher_forced_mean_exit_layer"]) == (a["agreement"], a["mean_exit_layer"])
    finally:
        use_config(llm, None)
    check_figures(out, ["pareto.png"])


def test_pareto_known_case():
    from specee.bench.sweep import pareto

    pts = [{"agreement": 1.0, "speedup_vs_full": 1.0},   # most faithful: optimal
           {"agreement": 0.9, "speedup_vs_full": 1.3},   # fastest: optimal
           {"agreement": 0.9, "speedup_vs_full": 1.2},   # as faithful as the one above, slower: dominated
           {"agreement": 0.8, "speedup_vs_full": 1.25},  # less faithful and slower than 0.9 / 1.3: dominated
           {"agreement": 0.95, "speedup_vs_full": 1.1},  # nothing is both faster and more faithful: optimal
           {"agreement": None, "speedup_vs_full": 2.0},  # a failed point: never optimal, dominates nothing
           {"agreement": 0.9, "speedup_vs_full": 1.3}]   # a tie does not dominate: optimal like its twin
    assert pareto(pts) == [True, True, False, False, True, False, True]


def test_cli_errors(tmp_path, capsys):
    from specee.bench.cli import main

    model = str(real_model_dir("stories260K"))
    assert main(["speed", "--model", model, "--count", "1"]) == 2  # --draft missing
    assert "--draft is required" in capsys.readouterr().err
    assert main(["quality", "--model", model, "--draft", "ngram", "--mc-tasks", "nope"]) == 2
    assert "unknown" in capsys.readouterr().err
    assert main(["oracle", "--model", model, "--draft", "ngram", "--categories", "nope"]) == 2
    assert "unknown categories" in capsys.readouterr().err


def test_cli_speed_speculative(tmp_path, capsys):
    """Speculative configurations and transformers' prompt-lookup peer in one speed run: lossless
    against full depth, vLLM's acceptance metrics, and the target's cost per verified row."""
    out = tmp_path / "speed-spec"
    stdout = run_cli(["bench", "speed", *common_args(out), "--max-new-tokens", "12", "--repeats", "1", "--warmup", "0",
                      "--policies", "", "--no-lossless", "--speculative-config", '{"method": "ngram"}',
                      "--hf-prompt-lookup", "2", "--row-costs"], capsys).out
    r = json.loads((out / "report.json").read_text())
    assert r["order"] == ["transformers", "full", "spec-ngram-n4", "hf-prompt-lookup"]
    for c in r["configs"].values():  # EOS ignored: exactly --max-new-tokens tokens, drafting or not
        assert [p["tokens"] for p in c["per_prompt"]] == [12, 12]
    assert r["identity"]["spec-ngram-n4"]["all_identical"] is True
    spec = r["configs"]["spec-ngram-n4"]["speculative"]
    assert spec["drafts"] > 0 and spec["accepted_tokens"] <= spec["draft_tokens"] <= 4 * spec["drafts"]
    assert spec["mean_accepted_length"] == pytest.approx(1 + spec["accepted_tokens"] / spec["drafts"])
    assert spec["acceptance_rate"] == pytest.approx(spec["accepted_tokens"] / spec["draft_tokens"])
    per_pos = spec["acceptance_rate_per_position"]
    assert len(per_pos) == 4 and all(a >= b for a, b in zip(per_pos, per_pos[1:]))  # j + 1 accepted only after j
    assert sum(per_pos) * spec["drafts"] == pytest.approx(spec["accepted_tokens"], abs=1e-3 * spec["drafts"])
    costs = r["row_costs"]
    assert costs["rows"] == [1, 2, 4, 8]
    assert {name: len(ms) for name, ms in costs["ms"].items()} == {"float32": 4, "bfloat16": 4}
    # stories260K's MLP width (172) is neither a multiple of the int4 group nor of int8's 16
    assert set(costs["unsupported"]) == {"int4", "int8"}
    assert "## Speculative decoding" in stdout and "int4: not measured" in stdout


def test_figures_skipped_without_matplotlib(tmp_path, llm, capsys, monkeypatch):
    """matplotlib is an optional extra: without it a benchmark still runs and writes report.json and
    report.md, and says once on stderr that the figures were skipped and how to install them."""
    from specee.bench.commands import finish

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if matplotlib were not installed

    def never(report, path):
        raise AssertionError(f"drew {path} without matplotlib")

    figures = {"exit_histogram.png": never, "throughput.png": never}  # speed's two figures: one note
    assert finish(argparse.Namespace(out=str(tmp_path / "unit")), {"benchmark": "x"}, "# md\n", figures) == 0
    err = capsys.readouterr().err
    notes = [line for line in err.splitlines() if "figures skipped" in line]
    assert len(notes) == 1 and "exit_histogram.png, throughput.png" in notes[0]
    assert "pip install 'specee[plots]'" in notes[0]
    assert sorted(p.name for p in (tmp_path / "unit").iterdir()) == ["report.json", "report.md"]

    out = tmp_path / "oracle"
    argv = ["bench", "oracle", *common_args(out), "--max-new-tokens", "4", "--categories", "qa"]
    cap = run_cli(argv, capsys)
    assert "bound (L / mean)" in cap.out
    assert cap.err.count("pip install 'specee[plots]'") == 1 and "oracle_exit_layers.png" in cap.err
    assert sorted(p.name for p in out.iterdir()) == ["report.json", "report.md"]
    assert "## Figures" not in (out / "report.md").read_text()
    assert list(check_outputs(out, llm, argv)["per_category"]) == ["qa"]


def test_llama_cpp_peer_refuses_what_it_cannot_run(monkeypatch):
    from specee.bench.common import BenchError
    from specee.bench.llama_cpp import LlamaCppPeer

    with pytest.raises(BenchError, match="needs a .gguf target"):
        LlamaCppPeer(real_model_dir("stories260K"), 1, 64)
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # as if llama-cpp-python were not installed
    with pytest.raises(BenchError, match="pip install 'specee\\[llama-cpp\\]'"):
        LlamaCppPeer(Path("model.gguf"), 1, 64)


def test_llama_cpp_peer_reports_a_file_it_cannot_load(tmp_path):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (optional extra specee[llama-cpp])")
    from specee.bench.common import BenchError
    from specee.bench.llama_cpp import LlamaCppPeer

    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + bytes(60))
    with pytest.raises(BenchError, match="llama.cpp could not load .*broken.gguf"):
        LlamaCppPeer(bad, 1, 64)


@pytest.mark.parametrize("lookup", [0, 2], ids=["plain", "prompt-lookup"])
def test_llama_cpp_peer_decodes_the_same_gguf_greedily(lookup):
    """llama.cpp (plain, and with its own prompt-lookup speculation) runs Q4_1 with int8 activations, not specee's float arithmetic, so greedy tokens may
    part at a near-tie (this prompt: 'L' 25.00 vs 'The' 24.91 in llama.cpp, the other way in
    float32). What must hold: exactly the tokens asked for, each among the top few of the same
    model's float logits when teacher-forced (a wrong file, template or position would fail)."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (optional extra specee[llama-cpp])")
    from conftest import MODELS

    gguf = MODELS / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not gguf.exists():
        pytest.skip(f"real model SmolLM2 not available: {gguf} is absent")
    from specee import LLM
    from specee.bench.llama_cpp import LlamaCppPeer

    llm = LLM(gguf, progress=False, quantization=None)
    ids = llm.encode("What is the capital of France?", chat=True)
    peer = LlamaCppPeer(gguf, 2, len(ids) + 16, lookup)
    try:
        run = peer.run(ids, 12)
    finally:
        peer.close()
    assert run.tokens == 12 and len(run.token_ids) == 12 and run.decode_tokens == 11
    assert_near_greedy(llm, ids, run.token_ids)


def assert_near_greedy(llm, ids: list[int], tokens: list[int]) -> None:
    """Each of `tokens` among the top few of the float model's logits, teacher-forced after `ids`."""
    model, seq = llm.model, ids + tokens
    with torch.inference_mode():
        h = model.forward(torch.tensor([seq]), model.range_inputs(0, len(seq)), model.new_cache(1, len(seq)))
        logits = model.logits(h)[0, len(ids) - 1:-1]
    ranks = (logits > logits.gather(1, torch.tensor(tokens)[:, None])).sum(1)
    assert int(ranks.max()) < 5, (ranks.tolist(), llm.tokenizer.decode(tokens))


def test_llama_cpp_peer_decodes_prompts_together():
    """bench_engine's llama.cpp mode: prompts of different lengths decoded as one batch (a sequence each,
    one llama_decode per step) give each prompt its own continuation (sequences or positions mixed up
    would not), and a later job with more sequences gets a context that fits them."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (optional extra specee[llama-cpp])")
    from conftest import MODELS

    gguf = MODELS / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not gguf.exists():
        pytest.skip(f"real model SmolLM2 not available: {gguf} is absent")
    from specee import LLM
    from specee.bench.llama_cpp import LlamaCppPeer

    llm = LLM(gguf, progress=False, quantization=None)
    prompts = [llm.encode(p, chat=True) for p in ("What is the capital of France?", "Name three colours.",
                                                    "Write a Python function that adds two numbers.")]
    peer = LlamaCppPeer(gguf, 2, 64)
    try:
        two, prefill, decode = peer.run_batch(prompts[:2], 6)
        three, _, _ = peer.run_batch(prompts, 6)
    finally:
        peer.close()
    assert [len(t) for t in two] == [6, 6] and [len(t) for t in three] == [6, 6, 6] and prefill > 0 and decode > 0
    for ids, tokens in zip(prompts + prompts[:2], three + two):
        assert_near_greedy(llm, ids, tokens)


def test_llama_cpp_worker_can_run_without_its_extra_buffers():
    """The prompt-lookup peer falls back to llama.cpp without its extra buffer types where a batch
    crashes with them (an AMX Xeon, llama-cpp-python 0.3.36): the setting must reach llama.cpp's model
    parameters, and leave the defaults of later models in the process as they were."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (optional extra specee[llama-cpp])")
    from conftest import MODELS

    gguf = MODELS / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not gguf.exists():
        pytest.skip(f"real model SmolLM2 not available: {gguf} is absent")
    import llama_cpp.llama_cpp as bindings
    from specee.bench.llama_cpp import _Decoder

    default = bindings.llama_model_default_params().use_extra_bufts
    assert _Decoder(str(gguf), 1, 64, 0, extra_buffers=False).model.model_params.use_extra_bufts is False
    assert _Decoder(str(gguf), 1, 64, 0).model.model_params.use_extra_bufts is True
    assert bindings.llama_model_default_params().use_extra_bufts == default


class ScriptedDrafter:
    """Drafts a known continuation, wrong at positions 1, 4, 7, ... (for the pass oracle)."""

    def __init__(self, continuation: list[int]):
        self.continuation, self.history = continuation, []

    def reset(self, prompt_ids, max_new_tokens=None):
        self.prompt, self.history = len(prompt_ids), list(prompt_ids)

    def draft(self, n, params, generator, width):
        from specee.drafters.base import Draft

        at = len(self.history) - self.prompt
        tokens = [t if (at + j) % 3 != 1 else -1 for j, t in enumerate(self.continuation[at:at + n])]
        return Draft(torch.tensor(tokens, dtype=torch.long))

    def commit(self, tokens, matched, features=None):
        self.history += tokens

    def extend(self, tokens):
        self.history += tokens


def test_pass_depths_by_hand():
    """Passes of 2 drafts over 7 positions where the drafts for positions 1 and 4 are wrong: each
    pass accepts the drafts before a wrong one, emits one more token and stops at its deepest row."""
    from specee.bench.oracle import _passes, pass_depths

    cont = [10, 11, 12, 13, 14, 15, 16]
    layers = torch.tensor([3, 1, 5, 2, 2, 4, 1])
    passes = pass_depths(ScriptedDrafter(cont), [1, 2], cont, layers, draft_tokens=2)
    # p=0: draft for 1 wrong -> [10, 11], max(3, 1); p=2: [12, 13, 14], max(5, 2, 2); p=5: one draft -> [15, 16]
    assert passes == [(2, 3), (3, 5), (2, 4)]
    summary = _passes(passes, 6, 2)
    assert summary["tokens"] == 7 and summary["bound"] == pytest.approx(6 * 3 / 12)


def test_cli_speed_merged(tmp_path, llm, banks, capsys):
    """A speculative config the n-gram exit drafter can draft for also runs with SpecEE's exits in
    its verification passes: lossy exits happen at the only enabled layer, lossless stays identical."""
    out = tmp_path / "speed-merged"
    run_cli(["bench", "speed", *common_args(out), "--bank", banks["layer0_k4"][0], "--max-new-tokens", "12",
             "--repeats", "1", "--warmup", "0", "--policies", "recompute", "--no-hf", "--check-cost", "0",
             "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'], capsys)
    r = json.loads((out / "report.json").read_text())
    assert r["order"] == ["full", "ee-recompute", "lossless", "spec-ngram-n2", "spec-ngram-n2+ee-recompute",
                          "spec-ngram-n2+ee-lossless"]
    lossy, lossless = r["configs"]["spec-ngram-n2+ee-recompute"], r["configs"]["spec-ngram-n2+ee-lossless"]
    assert lossy["exits_accepted"] > 0 and lossy["speculative"]["target_passes"] > 0
    assert set(lossy["exit_histogram"][1:-1]) == {0}  # layer 0 (index 0) or full depth, nothing between
    assert r["identity"]["spec-ngram-n2+ee-lossless"]["all_identical"] is True
    assert lossless["speculative"]["drafts"] > 0


def test_row_costs_time_a_gguf_file_as_stored_before_requantizing_it(tmp_path):
    """--row-costs on a GGUF file times its own blocks first (`--quantization auto`, the path decoding
    runs by default), then the requantized formats; the table once named int4's cost as the default's."""
    from gguf_checkpoints import TinyGGUF, write_gguf
    from specee.bench.speculative import AS_STORED, row_costs

    path = write_gguf(tmp_path / "tiny.gguf", TinyGGUF("llama", ("Q4_K", "Q6_K"), True))
    costs = row_costs(path, torch.device("cpu"), rows=(1, 2), context=8, repeats=1)
    assert list(costs["ms"]) == [AS_STORED[0], "float32", "bfloat16", "int8", "int4"]
    assert all(len(ms) == 2 and min(ms) > 0 for ms in costs["ms"].values())


def test_row_costs_time_the_row_counts_in_turn(tmp_path, monkeypatch):
    """Every repeat passes each row count once, forward and backward in turn, so that a machine's drift
    during the measurement falls on every count alike (one count's repeats in a row once made 2 rows
    cheaper than 1)."""
    from gguf_checkpoints import TinyGGUF, write_gguf
    from specee.bench.speculative import AS_STORED, row_costs
    from specee.model.llama import Transformer

    widths = []
    forward = Transformer.forward

    def recorded(self, tokens, *args, **kwargs):
        widths.append(tokens.shape[1])
        return forward(self, tokens, *args, **kwargs)
    monkeypatch.setattr(Transformer, "forward", recorded)
    path = write_gguf(tmp_path / "tiny.gguf", TinyGGUF("llama", ("Q4_K", "Q6_K"), True))
    row_costs(path, torch.device("cpu"), rows=(1, 2, 4), formats=(AS_STORED,), context=8, repeats=2)
    assert widths == [8, 1, 2, 4, 4, 2, 1, 1, 2, 4]  # the context, then the warm-up round and 2 timed rounds
