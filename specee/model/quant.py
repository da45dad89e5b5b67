"""Weight-only quantized linear layers: int4 (grouped, asymmetric) and int8 (per output channel).

Decoding on a CPU is bound by reading weights; these layers keep 4 or 8 bits per weight and
multiply through PyTorch's own kernels (`_weight_int4pack_mm[_for_cpu]`, `_weight_int8pack_mm`),
which take bfloat16 activations (float32 activations are several times slower: see
benchmarks/bench_kernels.py), except int4 on a CPU where specee's kernels build: its own
(model/kernels/int4_matmul.cpp: AVX-512 BF16, AVX2 or portable) does the same arithmetic 2-3x
faster, or by default llama.cpp's, with activations quantized per block of 32 to int8 (int4_q8.cpp;
kernels.use_activations, SPECEE_ACTIVATIONS=bf16|int8); GGUF Q4_K / Q6_K / Q5_0 / Q8_0 tensors run as stored
(quant_gguf.py). Every layer has `dequantize()`, the float weight the kernel effectively uses: the
reference the tests check the kernels against.

All linears share one small interface (`__call__`, `rows`, `take_rows`, `dequantize`, `tensors`)
so the runtime calls them without knowing the format.
"""
from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from ..sampling import top_k
from .gguf_blocks import GGUFWeight, gguf_int4_codes
from .kernels import loaded_cpu_kernels

MODES = ("int4", "int8", "auto")  # auto: each GGUF tensor's nearest native format, float stays float
INT4_GROUP = 32  # GGUF's Q4_0/Q4_1/Q4_K groups are 32 weights: one repack for both sources
KERNEL_DTYPE = torch.bfloat16  # the dtype the integer kernels run in (activations, scales)


class QuantizationError(ValueError):
    """A weight whose shape the chosen integer format cannot hold."""


class Linear(Protocol):
    out_features: int
    in_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...
    def rows(self, ids: torch.Tensor) -> torch.Tensor: ...
    def take_rows(self, ids: torch.Tensor | slice) -> "Linear": ...
    def dequantize(self) -> torch.Tensor: ...
    def tensors(self) -> list[torch.Tensor]: ...
    def release_rows(self) -> None: ...


def _bias_slice(bias: torch.Tensor | None, ids) -> torch.Tensor | None:
    return None if bias is None else bias[ids]


class FloatLinear:
    """y = x W^T (+ b) with a float weight: F.linear, the reference and the default."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight, self.bias = weight, bias
        self.out_features, self.in_features = weight.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight[ids]

    def take_rows(self, ids: torch.Tensor | slice) -> "FloatLinear":
        return FloatLinear(self.weight[ids], _bias_slice(self.bias, ids))  # a slice stays a view

    def dequantize(self) -> torch.Tensor:
        return self.weight

    def tensors(self) -> list[torch.Tensor]:
        return _present(self.weight, self.bias)

    def release_rows(self) -> None:
        """Nothing to drop: a float weight's rows are always at hand."""


def _present(*tensors: torch.Tensor | None) -> list[torch.Tensor]:
    return [t for t in tensors if t is not None]


class _KernelLinear:
    """What the two integer formats share: bf16 kernel activations, output in the caller's dtype."""

    bias: torch.Tensor | None
    out_features: int
    in_features: int

    def _matmul(self, x2d: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _kernel_input(self, x2d: torch.Tensor) -> torch.Tensor:
        return x2d.to(KERNEL_DTYPE)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = self._matmul(self._kernel_input(x.reshape(-1, self.in_features))).view(*shape[:-1], self.out_features)
        y = y.to(x.dtype)
        return y if self.bias is None else y + self.bias

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def release_rows(self) -> None:
        """Drop what only row gathers need (int4's plain nibbles; int8 rows are gathered from its weight)."""


class Int8Linear(_KernelLinear):
    """int8 weights, one scale per output channel (symmetric): W = q * scale[:, None]."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None):
        if qweight.shape[1] % 16:  # measured: other K give inf/nan for one row and crash for several
            raise QuantizationError(f"int8 needs the input dim ({qweight.shape[1]}) to be a multiple of 16")
        self.qweight = qweight  # int8 [N, K]
        self.scales = scales.to(KERNEL_DTYPE)  # [N]; the kernel reads them in the activations' dtype
        self.bias = bias
        self.out_features, self.in_features = qweight.shape

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> "Int8Linear":
        w = weight.float()
        scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-12).to(KERNEL_DTYPE).float()  # round first: q uses it
        q = torch.round(w / scales[:, None]).clamp(-128, 127).to(torch.int8)
        return cls(q, scales, bias)

    def _matmul(self, x2d: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x2d, self.qweight, self.scales)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        out_dtype = torch.float32 if self.bias is None else self.bias.dtype
        return (self.qweight[ids].float() * self.scales[ids].float().unsqueeze(-1)).to(out_dtype)

    def take_rows(self, ids: torch.Tensor | slice) -> "Int8Linear":
        return Int8Linear(self.qweight[ids], self.scales[ids], _bias_slice(self.bias, ids))

    def dequantize(self) -> torch.Tensor:
        return self.qweight.float() * self.scales.float()[:, None]

    def tensors(self) -> list[torch.Tensor]:
        return _present(self.qweight, self.scales, self.bias)


def _bf16_pack(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] (0..15) in the layout of model/kernels/int4_matmul.cpp: uint8 [N/64, K/4, 4, 32],
    output n = 64 b + 16 t + lane, input k = 4 c + 2 half + e; byte 2 lane + e holds half 0 in its
    low nibble and half 1 in its high one."""
    N, K = q.shape
    v = q.view(N // 64, 4, 16, K // 4, 2, 2).permute(0, 3, 1, 2, 5, 4)  # b, c, t, lane, e, half
    return (v[..., 0] | v[..., 1] << 4).reshape(N // 64, K // 4, 4, 32).contiguous()


def _bf16_unpack(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of _bf16_pack: q [N, K]."""
    B, C = packed.shape[:2]
    p = packed.view(B, C, 4, 16, 2)  # b, c, t, lane, e
    v = torch.stack([p & 15, p >> 4], dim=-1)  # b, c, t, lane, e, half
    return v.permute(0, 2, 3, 1, 5, 4).reshape(B * 64, C * 4)


class Int4Linear(_KernelLinear):
    """4-bit weights in groups of `group` along the input dim, a scale and zero per group:
    W = (q - 8) * scale + zero, q in 0..15 (the form of PyTorch's int4 kernels).

    The kernel wants its own tiled packing, which rows cannot be gathered from; `keep_rows=True`
    (the LM head, whose spec-token rows early exit reads) also keeps the plain nibbles, 1/2 byte a
    weight more. `take_rows` needs them too; the q/k/v split for `project_kv` is made at load.
    """

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int,
                 bias: torch.Tensor | None = None, keep_rows: bool = False):
        """q: uint8 [N, K] values 0..15; scales, zeros: [N, K // group] (rounded to bf16 here)."""
        N, K = q.shape
        if K % group or group not in (32, 64, 128, 256) or N % 16:
            raise QuantizationError(f"int4 needs the output dim ({N}) to be a multiple of 16 and the input dim ({K}) "
                             f"a multiple of the group size ({group}, one of 32/64/128/256)")
        self.out_features, self.in_features, self.group = N, K, group
        self.scales, self.zeros = scales.to(KERNEL_DTYPE), zeros.to(KERNEL_DTYPE)  # [N, G]
        self.bias = bias
        # specee's kernel (model/kernels/int4_matmul.cpp) where it is built and the shape fits
        self.kernel = None
        if q.device.type == "cpu" and group == 32 and N % 64 == 0:
            from .kernels import int4_kernel

            self.kernel = int4_kernel()
        if self.kernel is not None:
            self.packed = _bf16_pack(q)
            self.scales_and_zeros = (  # bf16 [N/64, G, (scale, zero), 64]
                torch.stack([self.scales, self.zeros]).view(2, N // 64, 64, K // group).permute(1, 3, 0, 2).contiguous())
        else:
            if q.device.type == "cuda":
                self.packed = torch.ops.aten._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).contiguous(), 8)
            else:
                self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
            self.scales_and_zeros = torch.stack([self.scales, self.zeros], dim=-1).transpose(0, 1).contiguous()  # [G, N, 2]
        self.nibbles = (q[:, 0::2] | q[:, 1::2] << 4).contiguous() if keep_rows else None  # [N, K/2]

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, group: int = INT4_GROUP,
                   keep_rows: bool = False) -> "Int4Linear":
        return cls(*int4_codes_from_float(weight, group), group, bias, keep_rows)

    def _kernel_input(self, x2d: torch.Tensor) -> torch.Tensor:
        """specee's kernel rounds float32 itself (to bf16, or per block to int8 from float32, as the
        C++ layer passes it): the same numbers from either layer."""
        if self.kernel is None or x2d.dtype not in (torch.float32, torch.bfloat16):
            return super()._kernel_input(x2d)
        return x2d

    def _matmul(self, x2d: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel.int4_mm(x2d, self.packed, self.scales_and_zeros)
        if x2d.device.type == "cuda":
            return torch.ops.aten._weight_int4pack_mm(x2d, self.packed, self.group, self.scales_and_zeros)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x2d, self.packed, self.group, self.scales_and_zeros)

    def _ints(self, ids) -> torch.Tensor:
        """q (0..15) of rows ids: from the plain nibbles if kept, else read back through the kernel."""
        if self.nibbles is None:
            return self._kernel_ints()[ids]
        b = self.nibbles[ids]
        return torch.stack([b & 15, b >> 4], dim=-1).flatten(-2)  # [..., K]

    def _kernel_ints(self) -> torch.Tensor:
        """All of q, recovered from the packed weight: unpacked from specee's own layout, or by
        multiplying the identity through PyTorch's kernel (float32 on CPU: each output is one
        product, exact), so nothing here trusts that kernel's private packing."""
        if self.kernel is not None:
            return _bf16_unpack(self.packed)
        dtype = torch.float32 if self.packed.device.type == "cpu" else KERNEL_DTYPE
        eye = torch.eye(self.in_features, dtype=dtype, device=self.packed.device)
        op = torch.ops.aten._weight_int4pack_mm if self.packed.device.type == "cuda" else torch.ops.aten._weight_int4pack_mm_for_cpu
        w = op(eye, self.packed, self.group, self.scales_and_zeros.to(dtype)).float().t()
        s = self.scales.float().repeat_interleave(self.group, dim=-1)
        z = self.zeros.float().repeat_interleave(self.group, dim=-1)
        return torch.round((w - z) / s + 8).clamp(0, 15).to(torch.uint8)

    def _dequant(self, q: torch.Tensor, ids) -> torch.Tensor:
        s = self.scales[ids].float().repeat_interleave(self.group, dim=-1)
        z = self.zeros[ids].float().repeat_interleave(self.group, dim=-1)
        return (q.float() - 8) * s + z

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self._dequant(self._ints(ids), ids)

    def take_rows(self, ids: torch.Tensor | slice, keep_rows: bool = False) -> "Int4Linear":
        return Int4Linear(self._ints(ids), self.scales[ids], self.zeros[ids], self.group,
                          _bias_slice(self.bias, ids), keep_rows)

    def dequantize(self) -> torch.Tensor:
        """The kernel's effective weight W = (q - 8) * scale + zero, in float32."""
        return self.rows(slice(None))

    def release_rows(self) -> None:
        self.nibbles = None

    def tensors(self) -> list[torch.Tensor]:
        """What it holds resident (scales/zeros [N, G] are kept for rows and dequantize)."""
        return _present(self.packed, self.scales_and_zeros, self.scales, self.zeros, self.nibbles, self.bias)


class RefinedHead:
    """A quantized LM head whose best logits are exact. The integer kernels return bfloat16 (8 bits:
    0.125 apart near 25), so the best tokens can tie or swap (SmolLM2's first answer token: 'The'
    25.33 and 'L' 25.24 in float32 both became 25.25); each row's top `refined` logits are
    recomputed in float32 from the head's dequantized rows, so the argmax is the quantized weights'
    own. `ranker`, an int4 copy of an int8 head, ranks instead of the head's own kernel (a third
    of the time; the head was a fifth of a SmolLM2 token): the argmax equalled the int8 head's at
    1,024 of 1,024 text positions with 16 rows (1,023 with 8); the other logits carry int4's error."""

    def __init__(self, head: Linear, ranker: Linear | None = None, refined: int = 16):
        self.head, self.ranker, self.refined = head, ranker, refined
        self.out_features, self.in_features, self.bias = head.out_features, head.in_features, head.bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        logits = (self.ranker or self.head)(x)
        ids = top_k(logits, self.refined)  # [..., refined]
        rows = self.head.rows(ids)
        if self.bias is None and x.dtype == logits.dtype == rows.dtype == torch.float32 and x.device.type == "cpu" and (
                kernels := loaded_cpu_kernels()) is not None:  # one call (greedy.cpp); the kernel's output is ours to change
            flat = logits.view(-1, self.out_features)
            kernels.rescore_rows(flat, ids.reshape(len(flat), -1), rows.reshape(len(flat), self.refined, -1),
                                 x.reshape(len(flat), -1).contiguous())
            return logits
        exact = (rows.float() * x.float().unsqueeze(-2)).sum(-1)
        if self.bias is not None:
            exact += self.bias[ids].float()
        return logits.scatter_(-1, ids, exact.to(logits.dtype))

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head.rows(ids)

    def take_rows(self, ids: torch.Tensor | slice) -> Linear:
        return self.head.take_rows(ids)

    def dequantize(self) -> torch.Tensor:
        return self.head.dequantize()

    def tensors(self) -> list[torch.Tensor]:
        return self.head.tensors() + ([] if self.ranker is None else self.ranker.tensors())

    def release_rows(self) -> None:
        """Nothing to drop: rescoring gathers the head's rows every call."""

    @classmethod
    def around(cls, head: Linear) -> Linear:
        """`head` itself when float; else refined, ranked by int4 where it is an int8 or GGUF K-quant
        head on the CPU whose shape the int4 kernel takes (Qwen's Q6_K head: 146 MB read a token
        by the int4 ranker against 191 MB as stored)."""
        if isinstance(head, FloatLinear):
            return head
        from .quant_gguf import KQuantLinear  # a module that builds on this one

        ranker = None
        wider = isinstance(head, Int8Linear) and head.qweight.device.type == "cpu" or isinstance(head, KQuantLinear)
        if wider and head.in_features % 32 == 0 and head.out_features % 16 == 0:
            ranker = Int4Linear(*int4_codes_of(head), INT4_GROUP)
        return cls(head, ranker)


def kernel_spec(lin: Linear) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """How the C++ decode layer (model/kernels/decode_layer.cpp) calls `lin`, through the kernel
    `lin` itself uses: (kind 0 float / 1 int8 / 2 int4 through PyTorch / 3 int4 through
    int4_matmul.cpp / 4 GGUF K-quant blocks through kquant.cpp, weight, scales (K-quants: tiles),
    bias, int4 group); absent parts are empty tensors."""
    from .quant_gguf import KQuantLinear  # a module that builds on this one

    empty = torch.empty(0)
    bias = empty if lin.bias is None else lin.bias
    if isinstance(lin, Int4Linear):
        return 3 if lin.kernel is not None else 2, lin.packed, lin.scales_and_zeros, bias, lin.group
    if isinstance(lin, Int8Linear):
        return 1, lin.qweight, lin.scales, bias, 0
    if isinstance(lin, KQuantLinear):
        return 4, lin.packed, lin.tiles, bias, 0
    return 0, lin.dequantize(), empty, bias, 0


def int4_codes_from_float(weight: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, ...]:
    """Min/max asymmetric quantization per group: (q uint8 [N, K], scales, zeros [N, K // group]).
    Scale and zero are rounded to bf16 before the weights are rounded against them, so q is
    chosen on the grid the kernel uses."""
    N, K = weight.shape
    w = weight.float().view(N, K // group, group)
    lo, hi = w.amin(-1), w.amax(-1)
    scales = ((hi - lo) / 15).clamp(min=1e-8).to(KERNEL_DTYPE).float()
    zeros = (lo + 8 * scales).to(KERNEL_DTYPE).float()
    q = torch.round((w - zeros.unsqueeze(-1)) / scales.unsqueeze(-1) + 8).clamp(0, 15)
    return q.to(torch.uint8).view(N, K), scales, zeros


def int4_codes_of(lin: Linear, weights_at_a_time: int = 1 << 20) -> tuple[torch.Tensor, ...]:
    """int4_codes_from_float of lin's dequantized weight, a few rows at a time (each row's groups are
    its own, so the codes are the same): Qwen2.5-Coder-1.5B's head as a whole, 0.9 GB of float32,
    took 3.4 s of its load on an Intel Xeon."""
    N, K = lin.out_features, lin.in_features
    step = max(1, weights_at_a_time // K)
    chunks = [int4_codes_from_float(lin.rows(torch.arange(r, min(r + step, N)))) for r in range(0, N, step)]
    return tuple(torch.cat([c[i] for c in chunks]) for i in range(3))


# ---- building a linear from a checkpoint's parts ----------------------------------------------
PRECISION = ("int4", "int8", None)  # lowest to highest


def linear_from_parts(parts: list[torch.Tensor | GGUFWeight], bias: torch.Tensor | None, mode: str | None,
                      device: torch.device, dtype: torch.dtype, keep_rows: bool = False) -> Linear:
    """One linear from row blocks fused along the output dim (q/k/v, gate/up): float tensors or
    GGUF raw blocks. mode None: float in `dtype`; "int4"/"int8": that format, from GGUF Q4 blocks
    natively where it is int4, else quantized from the float weight; "auto": each GGUF part's
    native format (float for float parts); parts of different formats fuse in the most precise one."""
    if mode == "auto":
        from .quant_gguf import KQuantLinear, kernel_for

        kernel = kernel_for(parts, device)
        if kernel is not None:  # Q4_K / Q6_K / Q5_0 / Q8_0 blocks as stored
            return KQuantLinear(parts, None if bias is None else bias.to(device=device, dtype=dtype), kernel)
        formats = [p.native_format() if isinstance(p, GGUFWeight) else None for p in parts]
        mode = max(formats, key=PRECISION.index)
    elif mode not in PRECISION:
        raise ValueError(f"unknown quantization {mode!r}; choose one of {', '.join(MODES)} or None")
    bias = None if bias is None else bias.to(device=device, dtype=dtype)
    if mode == "int4":
        codes = [gguf_int4_codes(p) if isinstance(p, GGUFWeight) and p.native_format() == "int4"
                 else int4_codes_from_float(p.to(device, torch.float32)) for p in parts]
        q, scales, zeros = (torch.cat([c[i] for c in codes]).to(device) for i in range(3))
        return Int4Linear(q, scales, zeros, INT4_GROUP, bias, keep_rows)
    weight = torch.cat([p.to(device, torch.float32 if mode else dtype) for p in parts])
    if mode == "int8":
        return Int8Linear.from_float(weight, bias)
    return FloatLinear(weight, bias)
