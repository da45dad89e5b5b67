"""What a command writes, and where: output destinations (`-o`, `--out`) checked as the flags are parsed
(a command that cannot write its result fails in one line before it loads a model or runs, not after
minutes of work), generated text as it comes, and the stats line after it."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..files import writable_destination


def _flag_type(directory: bool):
    def check(value: str) -> Path:
        try:
            return writable_destination(Path(value).expanduser(), directory)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    check.__name__ = "directory" if directory else "file"
    return check


output_dir = _flag_type(directory=True)  # argparse type= of an output directory flag
output_file = _flag_type(directory=False)  # argparse type= of an output file flag


# Below this share of layers saved, early exit has not paid on any model measured (BENCHMARKS.md: the
# reference pair saves 14% and runs at 0.86x of full depth, SmolLM2 3% at 0.98x, Qwen 1.5B 2% at 0.94x).
EXIT_PAYS_FROM = 0.20


def exit_room_note(summary: dict) -> str | None:
    """What calibration predicts early exit saves, when that is too little to pay for its drafter and predictors."""
    layers = summary.get("num_layers")
    mean = (summary.get("cross_validated") or {}).get("mean_exit_layer", summary.get("mean_exit_layer"))
    if not layers or mean is None:
        return None
    saved = 1.0 - mean / layers
    if saved >= EXIT_PAYS_FROM:
        return None
    return (f"early exit is expected to skip {saved:.0%} of the layers on this model (calibration: {mean:.1f} of "
            f"{layers} run); below {EXIT_PAYS_FROM:.0%} it has been slower than full depth on every model measured, "
            f"because the drafter and predictors cost more. `specee bench speed` measures it here")


def stats_line(stats) -> str:
    """A request's one-line summary on stderr: speed, prompt, threads, and what early exit or speculation did."""
    line = (f"{stats.generated_tokens} tokens in {stats.seconds:.2f} s ({stats.tokens_per_second:.1f} tokens/s; "
            f"decode {stats.decode_tokens_per_second:.1f} tokens/s; prompt {stats.prompt_tokens} tokens; "
            f"{threads_text(stats)})")
    ee = stats.early_exit
    if ee:
        line += (f"; early exit {ee['mode']}/{ee['kv_policy']}: mean {ee['mean_exit_layer']:.1f} of "
                 f"{ee['num_layers']} layers, {ee['exits_accepted']} exits")
        if "lossless" in ee:
            line += f", {ee['lossless']['rollbacks']} rollbacks"
    sp = stats.speculative
    if sp:
        line += (f"; speculative {sp['method']}: mean accepted length {sp['mean_accepted_length']:.2f}, "
                 f"acceptance rate {sp['acceptance_rate']:.2f}")
    return line


def threads_text(stats) -> str:
    """'2 threads', or '1 of 2 threads (the fastest measured)' where the load-time timing chose fewer."""
    n, most = stats.threads, max(stats.thread_probe_ms or {}, default=stats.threads)
    if n < most:
        return f"{n} of {most} threads (the fastest measured)"
    return f"{n} thread{'s' if n != 1 else ''}"


def print_stats(stats, detailed: bool) -> None:
    """`--stats`: every field, one a line; else the one-line summary."""
    if not detailed:
        print(f"[{stats_line(stats)}]", file=sys.stderr)
        return
    for key, value in stats.as_dict().items():
        if isinstance(value, dict):
            value = json.dumps(value, sort_keys=True)
        print(f"{key:>26}: {value}", file=sys.stderr)


def write_out(text: str) -> None:
    """Generated text as it comes (flushed: a stream's reader sees each piece at once)."""
    sys.stdout.write(text)
    sys.stdout.flush()
