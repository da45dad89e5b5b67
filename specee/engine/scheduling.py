"""The engine's scheduling settings (vLLM's SchedulerConfig): their defaults, which `LLM`, the engine
and the command line share, their checks, and how a prompt is cut into prefill parts."""
from __future__ import annotations

import math

DEFAULT_MAX_NUM_SEQS = 64
DEFAULT_MAX_BATCHED_TOKENS = 2048  # vLLM's default with chunked prefill
DEFAULT_PREFILL_CHUNK = 512
DEFAULT_SWAP_SPACE = 4.0  # GiB of host memory for parked requests' rows (vLLM's --swap-space default)
MAX_SWAP_SPACE = 1 << 20  # GiB (1 PiB), as the KV cache's bound
DEFAULT_MAX_QUEUE = 512  # a server's requests that may wait beyond max_num_seqs, then 429 (specee serve --max-queue)

# a prompt part's fewest rows unless the whole prompt is shorter: decode_layer.cpp's kTilePromptRows,
# from which a prompt's rows run on AMX tiles (a shorter last part would not, and would round differently)
MIN_PROMPT_PART = 32
PREFILL_CHUNK_RULE = f"0 (whole prompts) or at least {MIN_PROMPT_PART}"


def prefill_chunk_allowed(n: int) -> bool:
    """Whether a prefill chunk obeys PREFILL_CHUNK_RULE (a shorter part would leave the AMX tiles)."""
    return n == 0 or n >= MIN_PROMPT_PART


def prompt_part_end(done: int, length: int, chunk: int) -> int:
    """Where the part of a `length`-token prefill that starts at `done` ends: `chunk` tokens on (0: no
    chunking), or the end if less than MIN_PROMPT_PART would be left after it."""
    end = min(length, done + chunk) if chunk else length
    return length if length - end < MIN_PROMPT_PART else end


def check_scheduling(max_num_seqs: object, max_num_batched_tokens: object, prefill_chunk: object) -> None:
    """A one-line error naming the setting, before anything loads."""
    for name, value, least in (("max_num_seqs", max_num_seqs, 1), ("max_num_batched_tokens", max_num_batched_tokens, 1),
                               ("prefill_chunk", prefill_chunk, 0)):
        flag = "--" + name.replace("_", "-")
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ValueError(f"{name} ({flag}) must be an integer of at least {least}, got {value!r}")
    if not prefill_chunk_allowed(prefill_chunk):
        raise ValueError(f"prefill_chunk (--prefill-chunk) must be {PREFILL_CHUNK_RULE}, got {prefill_chunk}")


def swap_space_bytes(gib: object) -> int:
    """Bytes of a `swap_space` in GiB (vLLM's unit): the host memory parked requests' rows may take beyond
    the KV pool. Why a bound: on the CPU that is the same memory, and up to max_num_seqs requests of a
    whole context each could otherwise be parked at once (64 x 8,192 SmolLM2 tokens: 12 GiB)."""
    if (not isinstance(gib, (int, float)) or isinstance(gib, bool) or not math.isfinite(gib)
            or not 0 <= gib <= MAX_SWAP_SPACE):
        raise ValueError(f"swap_space (--swap-space) must be GiB of host memory from 0 to {MAX_SWAP_SPACE}, got {gib!r}")
    return int(gib * 2**30)
