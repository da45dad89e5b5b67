"""`specee bench serve`: load on OpenAI-compatible servers (specee serve, llama-cpp-python's,
vLLM's), as their users see it: streamed chat completions at several concurrency levels, with
aggregate tokens/s, time to first token and inter-token latency (gaps between streamed chunks,
as vLLM's benchmark_serving measures them), and errors. Each server is started by the user."""
from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .common import BenchError
from .tasks import Prompt


@dataclass
class Result:
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str | None = None


def percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


async def one_request(client, model: str, prompt: str, max_tokens: int, ignore_eos: bool) -> Result:
    out, start, last = Result(), time.perf_counter(), None
    try:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0,
            stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True} if ignore_eos else None)
        chunks = 0
        async for chunk in stream:
            if chunk.usage is not None:
                out.tokens = chunk.usage.completion_tokens
            if not (chunk.choices and chunk.choices[0].delta.content):
                continue
            now = time.perf_counter()
            chunks += 1
            if last is None:
                out.ttft = now - start
            else:
                out.gaps.append(now - last)
            last = now
        out.tokens = out.tokens or chunks  # a server without usage in streams: one token per chunk
    except Exception as e:  # noqa: BLE001 -- counted as the level's errors, not the end of the run
        out.error = f"{type(e).__name__}: {e}"
    return out


async def run_level(url: str, model: str, prompts: Sequence[Prompt], concurrency: int, requests: int,
                    max_tokens: int, ignore_eos: bool, api_key: str | None) -> dict[str, Any]:
    """`requests` requests, at most `concurrency` in flight at once."""
    import openai

    gate = asyncio.Semaphore(concurrency)
    async with openai.AsyncOpenAI(base_url=url.rstrip("/") + "/v1", api_key=api_key or "none", max_retries=0,
                                  timeout=600) as client:
        async def gated(i: int) -> Result:
            async with gate:
                return await one_request(client, model, prompts[i % len(prompts)].text, max_tokens, ignore_eos)

        start = time.perf_counter()
        results = await asyncio.gather(*(gated(i) for i in range(requests)))
        wall = time.perf_counter() - start
    ok = [r for r in results if r.error is None]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    gaps = [g for r in ok for g in r.gaps]
    tokens = sum(r.tokens for r in ok)
    return {"concurrency": concurrency, "requests": requests, "errors": len(results) - len(ok),
            "first_error": next((r.error for r in results if r.error), None), "seconds": round(wall, 3),
            "tokens": tokens, "tokens_per_second": round(tokens / wall, 2) if wall > 0 else 0.0,
            "ttft_p50": percentile(ttfts, 50), "ttft_p99": percentile(ttfts, 99),
            "itl_p50": percentile(gaps, 50), "itl_p99": percentile(gaps, 99)}


async def served_model(url: str, api_key: str | None) -> str:
    import openai

    async with openai.AsyncOpenAI(base_url=url.rstrip("/") + "/v1", api_key=api_key or "none", max_retries=0,
                                  timeout=30) as client:
        try:
            return (await client.models.list()).data[0].id
        except openai.APIError as e:
            raise BenchError(f"{url}: could not list its models ({e})") from None


def run_serve_bench(servers: dict[str, str], prompts: Sequence[Prompt], *, concurrency: Sequence[int],
                    max_tokens: int = 128, requests: int | None = None, ignore_eos: bool = True,
                    api_key: str | None = None, model: str | None = None) -> dict[str, Any]:
    """Every server at every concurrency level, in turn (one level's load at a time)."""
    rows = []
    for name, url in servers.items():
        served = model or asyncio.run(served_model(url, api_key))
        for c in concurrency:
            n = requests or max(2 * c, 8)
            level = asyncio.run(run_level(url, served, prompts, c, n, max_tokens, ignore_eos, api_key))
            rows.append({"server": name, "url": url, "model": served, **level})
    return {"benchmark": "serve", "max_tokens": max_tokens, "ignore_eos": ignore_eos, "prompts": len(prompts),
            "rows": rows}


def serve_markdown(report: dict[str, Any]) -> str:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{1000 * v:.1f}"

    lines = [f"# specee bench serve: streamed chat completions, {report['max_tokens']} new tokens", "",
             "| server | concurrency | requests | errors | tokens/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms "
             "| ITL p99 ms |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        lines.append(f"| {r['server']} | {r['concurrency']} | {r['requests']} | {r['errors']} | "
                     f"{r['tokens_per_second']:.1f} | {ms(r['ttft_p50'])} | {ms(r['ttft_p99'])} | "
                     f"{ms(r['itl_p50'])} | {ms(r['itl_p99'])} |")
    errors = [f"- {r['server']} at {r['concurrency']}: {r['first_error']}" for r in report["rows"] if r["errors"]]
    return "\n".join(lines + (["", "First error per level:", *errors] if errors else [])) + "\n"


def plot_serve(report: dict[str, Any], path) -> Any:
    """Aggregate tokens/s, TTFT p50 and ITL p50 against concurrency, one line per server."""
    from .plots import _figure, _save

    fig = _figure(11, 3.4)
    axes = fig.subplots(1, 3)
    for name in dict.fromkeys(r["server"] for r in report["rows"]):
        rows = [r for r in report["rows"] if r["server"] == name]
        xs = [r["concurrency"] for r in rows]
        for ax, key, scale in zip(axes, ("tokens_per_second", "ttft_p50", "itl_p50"), (1, 1000, 1000)):
            ax.plot(xs, [None if r[key] is None else r[key] * scale for r in rows], marker="o", label=name)
    for ax, label in zip(axes, ("aggregate tokens/s", "time to first token p50 (ms)", "inter-token latency p50 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    fig.suptitle(f"Streamed chat completions, {report['max_tokens']} new tokens", fontsize=10)
    return _save(fig, path)
