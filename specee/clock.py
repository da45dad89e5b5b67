"""Timing that is right on CUDA too: kernels run asynchronously, so a host timer read right
after launching work measures the launch, not the work."""
from __future__ import annotations

import time
from collections import defaultdict

import torch


def device_time(device: torch.device) -> float:
    """perf_counter once the device has finished the work queued so far. A sync on CUDA: the engine
    reads it at each step's start and end, where the host reads of the step before and of this one
    have already waited for the device, and around a drafter's work; never between a step's layers."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class StageTimer:
    """Sums the time spent in decode-loop stages (drafter, predictors, ...). On CUDA each stage is a
    pair of events read once at the end, so timing adds no sync to the loop; on CPU, perf_counter."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._seconds: dict[str, float] = defaultdict(float)
        self._events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    def start(self) -> float | torch.cuda.Event:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def stop(self, stage: str, started: float | torch.cuda.Event) -> None:
        if not self.cuda:
            self._seconds[stage] += time.perf_counter() - started
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._events.append((stage, started, end))

    def seconds(self, stage: str) -> float:
        """Total time in `stage` so far (on CUDA: waits for the recorded events)."""
        if self._events:
            self._events[-1][2].synchronize()
            for name, a, b in self._events:
                self._seconds[name] += a.elapsed_time(b) / 1000.0
            self._events.clear()
        return self._seconds[stage]
