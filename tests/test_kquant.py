"""GGUF Q4_K / Q6_K blocks run as stored (model/quant_gguf.py, model/kernels/kquant.cpp), against an
integer reference written here from gguf's own dequantization.

The reference: activations quantized per block of 32 as the int4 kernel's int8 path (d = max|x| /
127, x_q = round(x * (1 / d)) to nearest even); weight codes recovered from gguf's dequantized
weights of blocks whose d (and dmin) are powers of two, where d sc (q - 32) and d sc q - dmin m are
exact in float32, so q = (W + dmin m) / (d sc) exactly (nothing of the repack's bit layout is used);
integer sums per block, then the kernel's float32 FMAs in its order (emulated in float64, exact up to
a double rounding no case here meets). Checked bit for bit at every level this CPU reaches, for 1 to
9 rows; rows bit for bit whatever rows share the call; fused parts of both types; greedy decoding of
a GGUF model against its dequantized float twin behind the same activation rounding.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specee.model import kernels
from specee.model.gguf_blocks import GGUFWeight
from specee.model.quant import RefinedHead, kernel_spec, linear_from_parts
from specee.model.quant_gguf import KQuantLinear

from kquant_layout import repack
from gguf_checkpoints import TinyGGUF, write_gguf
from conftest import greedy_with_margins
from test_quant_int8 import assert_same_greedy, fake_quantized_twin, int8, level, quantize_activations  # noqa: F401

pytestmark = pytest.mark.usefixtures("single_thread")
gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType
SIZE = {T.Q4_K: 144, T.Q6_K: 210}


def random_blocks(qtype, N: int, K: int, seed: int) -> GGUFWeight:
    """Random blocks whose scale fields are powers of two (d, dmin) and nonzero (sc): every weight
    exact in float32. Extremes included: Q6_K scales -128 and 127, all codes 63 in one row."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (N, K // 256, SIZE[qtype]), dtype=np.uint8)
    pow2 = lambda n: (2.0 ** -rng.integers(8, 13, n)).astype(np.float16).view(np.uint8).reshape(N, K // 256, -1)  # noqa: E731
    if qtype == T.Q4_K:
        raw[..., 0:4] = pow2(N * K // 256 * 2)
        raw[..., 4:8] |= 1  # sc_0..3 odd
        raw[..., 12:16] |= 1  # sc_4..7 odd
        raw[0, :, 16:] = 255  # codes 15
    else:
        raw[..., 208:210] = pow2(N * K // 256)
        sc = raw[..., 192:208].view(np.int8)
        sc[sc == 0] = 1
        sc[0, :, 0], sc[1, :, 0] = -128, 127
        raw[0, :, :192] = 255  # codes 63
    return GGUFWeight(qtype, raw.reshape(N, -1))


def codes_and_scales(w: GGUFWeight):
    """(q int64 [N, K], per-block integer scale, min [N, K/16 or K/32], d, dmin float32 [N, K/256]) from
    gguf's dequantization and the blocks' scale fields."""
    N, K = w.shape
    W = w.dequantize().double().numpy()
    blocks = w.data.reshape(N, K // 256, -1)
    if w.qtype == T.Q6_K:
        d = blocks[..., 208:210].copy().view(np.float16).astype(np.float64)[..., 0]
        sc = blocks[..., 192:208].copy().view(np.int8).astype(np.int64).reshape(N, K // 16)
        step = np.repeat(d, 16, 1) * sc  # per 16
        q = W / np.repeat(step, 16, 1) + 32
        return q, sc, None, d, None
    from gguf.quants import Q4_K

    d, dmin = (blocks[..., i:i + 2].copy().view(np.float16).astype(np.float64)[..., 0] for i in (0, 2))
    sc, m = (a.astype(np.int64).reshape(N, K // 32) for a in Q4_K.get_scale_min(blocks[..., 4:16].reshape(-1, 12)))
    q = (W + np.repeat(np.repeat(dmin, 8, 1) * m, 32, 1)) / np.repeat(np.repeat(d, 8, 1) * sc, 32, 1)
    return q, sc, m, d, dmin


def fma(a, b, c):
    return (np.float64(a) * np.float64(b) + np.float64(c)).astype(np.float32)


def reference(w: GGUFWeight, x: torch.Tensor) -> np.ndarray:
    """kquant.cpp's arithmetic: integer block sums, then its float32 FMAs in its order."""
    q, sc, m, d, dmin = codes_and_scales(w)
    assert np.array_equal(q, np.round(q)) and q.min() >= 0 and q.max() <= (63 if m is None else 15)
    q = q.astype(np.int64)
    xq, dx = (t.numpy() for t in quantize_activations(x))
    M, (N, K) = x.shape[0], w.shape
    dx = dx.astype(np.float32)
    out = np.zeros((M, N), np.float32)
    for sb in range(K // 256):
        fa, fb = np.zeros((M, N), np.float32), np.zeros((M, N), np.float32)
        for b in range(8 * sb, 8 * sb + 8):
            k = slice(32 * b, 32 * b + 32)
            if m is None:  # Q6_K: two halves of 16, each (q - 32) . x_q times its scale
                halves = [np.einsum("nk,mk->mn", q[:, 32 * b + 16 * h:32 * b + 16 * h + 16] - 32,
                                    xq[:, 32 * b + 16 * h:32 * b + 16 * h + 16]) * sc[:, 2 * b + h] for h in (0, 1)]
                fa = fma((halves[0] + halves[1]).astype(np.float32), dx[:, b:b + 1], fa)
            else:
                dot = np.einsum("nk,mk->mn", q[:, k], xq[:, k]) * sc[:, b]
                ds = (dx[:, b] * xq[:, k].sum(1).astype(np.float32)).astype(np.float32)
                fa = fma(dot.astype(np.float32), dx[:, b:b + 1], fa)
                fb = fma(m[:, b].astype(np.float32), ds[:, None], fb)
        out = fma(d[:, sb].astype(np.float32), fa, out)
        if m is not None:
            out = fma(-dmin[:, sb].astype(np.float32), fb, out)
    return out


def activations(rows: int, K: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, K, generator=g) * torch.exp(torch.randn(rows, K // 32, 1, generator=g)).repeat_interleave(32, 1).view(rows, K)
    x[0, :32] = 0  # a zero block: d = 0
    x[-1, 40] = 300.0  # an outlier
    return x


def kernel():
    k = kernels.int4_kernel()
    if k is None:
        pytest.skip("the CPU kernels are not built here")
    return k


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K], ids=["Q4_K", "Q6_K"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 37])
@torch.inference_mode()
def test_kernel_equals_the_integer_reference_bit_for_bit(qtype, rows, level):
    w = random_blocks(qtype, 80, 512, seed=rows)  # a group of 4 tiles side by side and one alone
    x = activations(rows, 512, seed=rows)
    y = KQuantLinear([w], None, kernel())(x)
    np.testing.assert_array_equal(y.numpy(), reference(w, x))


def check_fused_rows(parts: list[GGUFWeight], reference_of) -> tuple[KQuantLinear, torch.Tensor, torch.Tensor]:
    """Fused parts with a bias over 8 rows: each row alone gives what it gives among the 8, and the
    output is each part's reference side by side. Returns (the linear, x, y) for further checks."""
    lin = KQuantLinear(parts, torch.randn(sum(p.shape[0] for p in parts)), kernel())
    x = activations(8, parts[0].shape[1], seed=7)
    y = lin(x)
    for r in range(8):
        assert torch.equal(lin(x[r:r + 1])[0], y[r])
    want = np.concatenate([reference_of(p, x) for p in parts], 1) + lin.bias.numpy()
    np.testing.assert_array_equal(y.numpy(), want)
    return lin, x, y


@torch.inference_mode()
def test_rows_are_the_same_whatever_rows_share_the_call_and_fused_types_split(level):
    parts = [random_blocks(T.Q4_K, 80, 768, 1), random_blocks(T.Q6_K, 16, 768, 2), random_blocks(T.Q4_K, 32, 768, 3)]
    lin, x, y = check_fused_rows(parts, reference)
    plain = KQuantLinear(parts, None, kernel())
    assert torch.equal(plain(x.bfloat16()), plain(x.bfloat16().float()).bfloat16())  # bf16 widens exactly
    kv = lin.take_rows(slice(80, None))
    assert torch.equal(kv(x), y[:, 80:]) and torch.equal(kv.dequantize(), lin.dequantize()[80:])
    ids = torch.tensor([[0, 90], [127, 33]])
    assert torch.equal(lin.rows(ids), lin.dequantize()[ids])


def test_the_repack_adds_no_byte_and_refuses_other_types():
    for qtype in (T.Q4_K, T.Q6_K):
        w = random_blocks(qtype, 32, 512, 0)
        assert repack(w).nbytes == w.data.nbytes == KQuantLinear([w], None, kernel()).packed.numel()
    q5k = GGUFWeight(T.Q5_K, np.zeros((16, 176), np.uint8))
    with pytest.raises(ValueError, match="K-quant kernel: Q4_K / Q6_K / Q5_0 / Q8_0 parts"):
        KQuantLinear([q5k], None, kernel())
    with pytest.raises(RuntimeError, match="GGML type 13 has no kquant.cpp layout"):
        out = torch.empty(q5k.data.size, dtype=torch.uint8)
        kernel().kquant_repack(torch.from_numpy(q5k.data), int(T.Q5_K), 256, out, 0)


def test_auto_runs_k_quant_parts_as_stored_and_other_parts_as_before(int8):
    kernel()
    q4, q6 = random_blocks(T.Q4_K, 32, 256, 0), random_blocks(T.Q6_K, 16, 256, 1)
    lin = linear_from_parts([q4, q6], None, "auto", torch.device("cpu"), torch.float32)
    assert isinstance(lin, KQuantLinear) and kernel_spec(lin)[0] == 4
    q5 = GGUFWeight(T.Q5_K, np.zeros((16, 176), np.uint8))
    assert not isinstance(linear_from_parts([q4, q5], None, "auto", torch.device("cpu"), torch.float32), KQuantLinear)
    assert not isinstance(linear_from_parts([q4], None, "int4", torch.device("cpu"), torch.float32), KQuantLinear)
    head = RefinedHead.around(lin)
    assert head.ranker is not None  # an int4 ranker reads fewer bytes than Q6_K rows
    before = kernels.use_activations("bf16")  # the K-quant kernel has no bf16 path
    try:
        assert not isinstance(linear_from_parts([q4], None, "auto", torch.device("cpu"), torch.float32), KQuantLinear)
    finally:
        kernels.use_activations(before)


@torch.inference_mode()
def test_greedy_k_quant_gguf_model_equals_its_fake_quantized_twin(tmp_path, level):
    from specee.model.llama import Transformer

    path = write_gguf(tmp_path / "m.gguf", TinyGGUF("qwen2", ("Q4_K", "Q6_K"), False, layers=3, vocab=512))
    model = Transformer.load(path, "cpu", torch.float32, quantization="auto")
    linears = [getattr(w, n) for w in model.layers for n in ("qkv", "kv", "o", "gate_up", "down")]
    assert all(isinstance(x, KQuantLinear) for x in linears) and model.fast_layers is not None
    prompt = [1, 45, 200, 7, 88, 13, 250, 9]
    first, want = (greedy_with_margins(m, prompt, 1)[1][0] for m in (model, fake_quantized_twin(model)))
    best = want.topk(8).indices  # those the quantized head recomputes exactly (the rest: its int4 ranker's)
    assert float((first[best] - want[best]).abs().max()) <= 0.02 * float(want.abs().max())  # before tokens can part
    assert_same_greedy(model, prompt, 24, rtol=0.02)


def test_a_tile_entry_outside_the_packed_bytes_is_refused(monkeypatch):
    """The tiles are checked once, when the linear is built (not in every product of the decode loop)."""
    w = random_blocks(T.Q4_K, 32, 256, seed=0)
    assert KQuantLinear([w], None, kernel()).tiles.shape == (2, 4)
    real = kernel().kquant_repack

    def past_the_end(blocks, qtype, K, out, at):  # the repack's tile entries moved past the packed bytes
        return real(blocks, qtype, K, out, at + out.numel())
    monkeypatch.setattr(kernel(), "kquant_repack", past_the_end)
    with pytest.raises(RuntimeError, match="tile 0 is not a Q4_K, Q6_K, Q5_0 or Q8_0 tile of K = 256 inside the packed bytes"):
        KQuantLinear([w], None, kernel())
