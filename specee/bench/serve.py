"""`specee bench serve`: load on OpenAI-compatible servers (specee serve, llama-cpp-python's,
vLLM's), as their users see it: streamed chat completions at several concurrency levels, with
aggregate tokens/s, time to first token and inter-token latency (gaps between streamed chunks,
as vLLM's benchmark_serving measures them), and errors. Each server is started by the user
(benchmarks/serve_peers.py starts specee's and its peers' in turn). Each level records the load
average around it: on a shared machine the figures mean little without it."""
from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Mapping, Sequence
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


# how a server is told to ignore end-of-sequence: vLLM's and specee's field, or a minimum length
# (llama-cpp-python's server has no ignore_eos and drops fields it does not know)
EOS_FIELDS = ("ignore_eos", "min_tokens")


def eos_body(name: str | None, max_tokens: int) -> dict[str, Any] | None:
    if name is None:
        return None
    if name not in EOS_FIELDS:
        raise BenchError(f"unknown end-of-sequence field {name!r}; choose {', '.join(EOS_FIELDS)}")
    return {"ignore_eos": True} if name == "ignore_eos" else {"min_tokens": max_tokens}


async def one_request(client, model: str, prompt: str, max_tokens: int, extra_body: dict | None) -> Result:
    out, start, last = Result(), time.perf_counter(), None
    try:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0,
            stream=True, stream_options={"include_usage": True}, extra_body=extra_body)
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
                    max_tokens: int, extra_body: dict | None, api_key: str | None) -> dict[str, Any]:
    """`requests` requests, at most `concurrency` in flight at once."""
    import openai

    gate = asyncio.Semaphore(concurrency)
    async with openai.AsyncOpenAI(base_url=url.rstrip("/") + "/v1", api_key=api_key or "none", max_retries=0,
                                  timeout=600) as client:
        async def gated(i: int) -> Result:
            async with gate:
                return await one_request(client, model, prompts[i % len(prompts)].text, max_tokens, extra_body)

        load_before, start = os.getloadavg()[0], time.perf_counter()
        results = await asyncio.gather(*(gated(i) for i in range(requests)))
        wall = time.perf_counter() - start
    ok = [r for r in results if r.error is None]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    gaps = [g for r in ok for g in r.gaps]
    tokens = sum(r.tokens for r in ok)
    return {"concurrency": concurrency, "requests": requests, "errors": len(results) - len(ok),
            "first_error": next((r.error for r in results if r.error), None), "seconds": round(wall, 3),
            "tokens": tokens, "tokens_per_second": round(tokens / wall, 2) if wall > 0 else 0.0,
            "short_answers": sum(r.tokens < max_tokens for r in ok),
            "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],
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


def default_requests(concurrency: int) -> int:
    return max(2 * concurrency, 8)


def run_serve_bench(servers: dict[str, str], prompts: Sequence[Prompt], *, concurrency: Sequence[int],
                    max_tokens: int = 128, requests: int | None = None, ignore_eos: bool = True,
                    eos_fields: Mapping[str, str] | None = None, api_key: str | None = None,
                    model: str | None = None) -> dict[str, Any]:
    """Every server at every concurrency level, in turn (one level's load at a time). With ignore_eos,
    each server gets `ignore_eos` unless eos_fields names another field for it (EOS_FIELDS)."""
    from .report import cpu_name

    rows = []
    for name, url in servers.items():
        served = model or asyncio.run(served_model(url, api_key))
        extra = eos_body((eos_fields or {}).get(name, "ignore_eos") if ignore_eos else None, max_tokens)
        for c in concurrency:
            level = asyncio.run(run_level(url, served, prompts, c, requests or default_requests(c), max_tokens,
                                          extra, api_key))
            rows.append({"server": name, "url": url, "model": served, "eos_field": next(iter(extra or {}), None),
                         **level})
    return {"benchmark": "serve", "max_tokens": max_tokens, "ignore_eos": ignore_eos, "prompts": len(prompts),
            "cpu": cpu_name(), "cpu_count": os.cpu_count(), "rows": rows}


def serve_markdown(report: dict[str, Any]) -> str:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{1000 * v:.1f}"

    rows = report["rows"]
    memory = any("rss_peak_mib" in r for r in rows)  # benchmarks/serve_peers.py samples the server's processes
    lines = [f"# specee bench serve: streamed chat completions, {report['max_tokens']} new tokens", "",
             f"CPU: {report.get('cpu', '?')} ({report.get('cpu_count', '?')} cores); load average: 1-minute, "
             "before and after each level.", "",
             "| server | concurrency | requests | errors | tokens/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms "
             "| ITL p99 ms | load avg |" + (" peak RSS MiB |" if memory else ""),
             "|---|---|---|---|---|---|---|---|---|---|" + ("---|" if memory else "")]
    for r in rows:
        load = "/".join(f"{v:.1f}" for v in r.get("load_average", []))
        lines.append(f"| {r['server']} | {r['concurrency']} | {r['requests']} | {r['errors']} | "
                     f"{r['tokens_per_second']:.1f} | {ms(r['ttft_p50'])} | {ms(r['ttft_p99'])} | "
                     f"{ms(r['itl_p50'])} | {ms(r['itl_p99'])} | {load} |"
                     + (f" {r.get('rss_peak_mib', '-')} |" if memory else ""))
    notes = [f"- {r['server']} at {r['concurrency']}: {r['first_error']}" for r in rows if r["errors"]]
    notes += [f"- {r['server']} at {r['concurrency']}: {r['short_answers']} answers shorter than "
              f"{report['max_tokens']} tokens (end of sequence via {r['eos_field']})"
              for r in rows if report["ignore_eos"] and r.get("short_answers")]
    return "\n".join(lines + (["", "Errors and short answers:", *notes] if notes else [])) + "\n"


def plot_serve(report: dict[str, Any], path) -> Any:
    """Aggregate tokens/s, TTFT and ITL (p50 solid, p99 dashed) against concurrency, one colour per server."""
    from .plots import _figure, _save

    fig = _figure(12, 3.6)
    axes = fig.subplots(1, 3)
    for n, name in enumerate(dict.fromkeys(r["server"] for r in report["rows"])):
        rows = [r for r in report["rows"] if r["server"] == name]
        xs, colour = [r["concurrency"] for r in rows], f"C{n}"
        axes[0].plot(xs, [r["tokens_per_second"] for r in rows], marker="o", color=colour, label=name)
        for ax, key in zip(axes[1:], ("ttft", "itl")):
            for q, style in (("p50", "-"), ("p99", "--")):
                ys = [None if r[f"{key}_{q}"] is None else 1000 * r[f"{key}_{q}"] for r in rows]
                ax.plot(xs, ys, style, marker="o", color=colour, label=f"{name} {q}")
    for ax, label in zip(axes, ("aggregate tokens/s", "time to first token (ms)", "inter-token latency (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel(label)
        ax.legend(fontsize=7)
    for ax in axes[1:]:
        ax.set_yscale("log")
    fig.suptitle(f"Streamed chat completions, {report['max_tokens']} new tokens ({report.get('cpu', '?')})",
                 fontsize=10)
    return _save(fig, path)
