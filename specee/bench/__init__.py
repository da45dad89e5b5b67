"""Benchmarks for specee: `specee bench speed | quality | oracle | sweep | serve`.

Each benchmark is a library function taking a loaded `LLM` (so tests and notebooks can call
it directly) plus a CLI command (`specee.bench.cli.add_bench_parser`) that loads the models,
runs it, prints a Markdown summary and writes `report.json`, `report.md` and PNG figures to
`--out DIR` (figures need matplotlib: `pip install 'specee[plots]'`). Every report carries an
`environment` record (models and their fingerprints, dtype, device, torch/transformers versions,
threads, date, git commit). See BENCHMARKS.md.
"""
from .common import BenchError, find_shared
from .report import environment
from .tasks import Prompt, load_prompts

__all__ = ["BenchError", "Prompt", "environment", "find_shared", "load_prompts"]
