"""benchmarks/gpu_cost.py on the CPU with a small shape: the code a lent GPU runs works, and the
engine reads the host once per step."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import gpu_cost  # noqa: E402


def test_gpu_cost_runs_on_a_small_shape(capsys):
    report = gpu_cost.main(["--device", "cpu", "--shape", "tiny", "--dtype", "float32", "--tokens", "4",
                            "--repeats", "1"])
    assert [d["requests"] for d in report["decode"]] == [1, 8]
    assert all(d["host_reads_per_step"] == 1.0 and d["tokens_per_second"] > 0 for d in report["decode"])
    assert sorted(report["verification"]["ratio_to_one_row"]) == [1, 2, 4, 8]
    assert report["predictors"]["seconds_per_check"] > 0
    assert '"shape": "tiny"' in capsys.readouterr().out
