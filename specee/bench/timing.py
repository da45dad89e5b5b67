"""One generation, timed: the `Run` record, the configuration a run is of (`ConfigSpec`), and
the runners for specee's own `generate` and transformers' `generate` (see speed.py for how the
runs are scheduled and aggregated); `in_turns`, the order every timing loop runs its candidates in;
`count_host_reads` for what a step reads back."""
from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

from ..clock import device_time
from .common import BenchError

T = TypeVar("T")


def in_turns(items: Sequence[T], passes: int) -> Iterator[tuple[int, T]]:
    """(pass, item) for every item once a pass, forward and backward in turn: a drift of the machine
    over the passes (the development VMs' speed moves by a quarter within minutes) falls on every
    item alike, not on whichever ran its passes then."""
    for p in range(passes):
        for item in items if p % 2 == 0 else items[::-1]:
            yield p, item


@dataclass
class Run:
    tokens: int
    prefill_seconds: float
    decode_seconds: float
    decode_tokens: int
    token_ids: list[int] = field(default_factory=list)
    early_exit: dict[str, Any] | None = None
    speculative: dict[str, Any] | None = None


@dataclass
class ConfigSpec:
    name: str
    label: str
    kind: str  # "hf" | "full" | "early_exit" | "speculative" | "hf_assisted" (bench/speculative.py) | "llama_cpp"
    config: Any = None  # EarlyExitConfig for kind == "early_exit"


def specee_run(llm, ids: list[int], max_new_tokens: int) -> Run:
    from ..sampling import SamplingParams

    params = SamplingParams(max_tokens=max_new_tokens, ignore_eos=True)
    out = llm.generate(ids, params)[0]
    s = out.stats
    return Run(len(out.token_ids), s.prefill_seconds, s.decode_seconds, s.decode_tokens, list(out.token_ids),
               s.early_exit, s.speculative)


def load_hf_model(model_dir, device, dtype):
    """transformers' AutoModelForCausalLM in the same dtype, on the same device."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError as e:  # pragma: no cover - transformers is a test dependency
        raise BenchError("the transformers baseline needs `pip install transformers` (or pass --no-hf)") from e
    path = Path(model_dir)
    if path.suffix.lower() == ".gguf":  # transformers dequantizes the same file
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    # Decode exactly N tokens the way specee's ignore_eos does: EOS may be chosen and decoding
    # goes on. (min_new_tokens would instead forbid EOS, changing the greedy stream wherever EOS
    # is the top token; transformers refills an unset eos_token_id from these two configs.)
    model.generation_config.eos_token_id = None
    model.config.eos_token_id = None
    return model.to(device).eval()


def hf_run(model, ids: list[int], max_new_tokens: int, eos_ids: Sequence[int] = (),
           extra: dict[str, Any] | None = None) -> Run:
    """extra: more `generate` arguments (assisted generation: prompt_lookup_num_tokens, assistant_model)."""
    import torch
    from transformers import GenerationConfig
    from transformers.generation.streamers import BaseStreamer

    device = model.device

    class Clock(BaseStreamer):
        def __init__(self):
            self.times: list[float] = []

        def put(self, value):  # first call: the prompt; then one call per generated token
            self.times.append(time.perf_counter())

        def end(self):
            pass

    clock = Clock()
    eos = list(eos_ids)
    gen = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, num_beams=1, use_cache=True,
                           eos_token_id=None, pad_token_id=(eos[0] if eos else 0))
    input_ids = torch.tensor([ids], device=device)
    with torch.inference_mode():
        t0 = device_time(device)
        out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                             generation_config=gen, streamer=clock, **(extra or {}))
        t1 = device_time(device)
    new = out[0, len(ids):].tolist()
    first = clock.times[1] if len(clock.times) > 1 else t1
    return Run(len(new), first - t0, t1 - first, max(len(new) - 1, 0), new, None)


@contextmanager
def count_host_reads():
    """Counts every Python-level read of a tensor's value on the host (each is a device sync on CUDA)."""
    counts = Counter()
    names = ("item", "tolist", "__int__", "__float__", "__bool__", "__index__")
    saved = {n: torch.Tensor.__dict__.get(n) for n in names}

    def wrap(name):
        base = getattr(torch._C.TensorBase, name)

        def read(self, *a, **kw):
            counts[name] += 1
            return base(self, *a, **kw)
        return read

    for n in names:
        setattr(torch.Tensor, n, wrap(n))
    try:
        yield counts
    finally:
        for n, f in saved.items():
            if f is None:
                delattr(torch.Tensor, n)
            else:
                setattr(torch.Tensor, n, f)
