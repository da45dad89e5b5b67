"""GGUF Q5_0 / Q8_0 blocks run as stored (model/quant_gguf.py, model/kernels/kquant.cpp), against an
integer reference written here from gguf's own dequantization.

The reference: activations quantized per block of 32 as the int4 kernel's int8 path
(test_quant_int8.quantize_activations); weight codes q = W / d from gguf's dequantized weights
(d (q - 16) and d q are exact in float32, so the division recovers q exactly: nothing of the
repack's bit layout is used); per block the exact integer sum T = sum (q - 16) x_q (Q5_0) or
sum q x_q (Q8_0), then the kernel's float32 steps in its order, y = fma(d, T dx, y) block after block
(the FMA emulated in float64: exact but for a double rounding, which these cases do not meet).
Checked bit for bit at every level this CPU reaches, for 1 to 9 rows and widths that 256 does not
divide (Qwen2.5-0.5B's 896); rows bit for bit whatever rows share the call; fused parts of these and
K-quant types; greedy decoding of a tiny GGUF model and of Qwen2.5-Coder-0.5B (if present) against
their dequantized float twins behind the same activation rounding.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specee.model import kernels
from specee.model.gguf_blocks import GGUFWeight
from specee.model.quant import Int8Linear, RefinedHead, kernel_spec, linear_from_parts
from specee.model.quant_gguf import KQuantLinear

from kquant_layout import repack
from gguf_checkpoints import TinyGGUF, write_gguf
from test_gguf_tokenizer import FILES
from test_kquant import activations, check_fused_rows, fma, kernel, random_blocks as k_blocks, reference as k_reference
from test_quant_int8 import assert_same_greedy, fake_quantized_twin, int8, level, quantize_activations  # noqa: F401

pytestmark = pytest.mark.usefixtures("single_thread")
gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType
SIZE, OFFSET = {T.Q5_0: 22, T.Q8_0: 34}, {T.Q5_0: 16, T.Q8_0: 0}
CPU = torch.device("cpu")
QWEN_05B = FILES["qwen2.5-coder-0.5b"]


def random_blocks(qtype, N: int, K: int, seed: int) -> GGUFWeight:
    """Random blocks (every code pattern) with fp16 d of either sign and of real checkpoints' size
    (1e-4..1e-2); extremes: Q5_0 codes all 31 in row 0 and all 0 in row 1, Q8_0 codes -128 and 127."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (N, K // 32, SIZE[qtype]), dtype=np.uint8)
    d = rng.uniform(1e-4, 1e-2, (N, K // 32)) * rng.choice([-1, 1], (N, K // 32))
    raw[..., 0:2] = d.astype(np.float16)[..., None].view(np.uint8)
    raw[0, :, 2:] = 255  # Q5_0: codes 31; Q8_0: -1
    raw[1, :, 2:] = 0
    if qtype == T.Q8_0:
        raw[0, :, 2:] = 0x80  # -128
        raw[1, :, 2:] = 127
    return GGUFWeight(qtype, raw.reshape(N, -1))


def codes(w: GGUFWeight) -> tuple[np.ndarray, np.ndarray]:
    """(q - offset as int64 [N, K], d float32 [N, K/32]) from gguf's dequantization and the d fields."""
    N, K = w.shape
    d = w.data.reshape(N, K // 32, -1)[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    q = w.dequantize().numpy().astype(np.float64) / np.repeat(d, 32, 1)
    assert np.array_equal(q, np.round(q)), "d (q - offset) must be exact in float32"
    lo = -OFFSET[w.qtype] if w.qtype == T.Q5_0 else -128
    assert q.min() >= lo and q.max() <= (15 if w.qtype == T.Q5_0 else 127)
    return q.astype(np.int64), d


def reference(w: GGUFWeight, x: torch.Tensor) -> np.ndarray:
    """kquant.cpp's arithmetic for Q5_0 / Q8_0: exact integer block sums, then its float32 steps."""
    q, d = codes(w)
    xq, dx = (t.numpy() for t in quantize_activations(x))
    dx = dx.astype(np.float32)
    out = np.zeros((x.shape[0], w.shape[0]), np.float32)
    for b in range(w.shape[1] // 32):
        k = slice(32 * b, 32 * b + 32)
        t = np.einsum("nk,mk->mn", q[:, k], xq[:, k]).astype(np.float32)  # |T| < 2^24: exact
        out = fma(d[:, b], t * dx[:, b:b + 1], out)
    return out


@pytest.mark.parametrize("qtype", [T.Q5_0, T.Q8_0], ids=["Q5_0", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9])
@torch.inference_mode()
def test_kernel_equals_the_integer_reference_bit_for_bit(qtype, rows, level):
    w = random_blocks(qtype, 80, 896, seed=rows)  # a group of 4 tiles side by side and one alone; 28 blocks
    x = activations(rows, 896, seed=rows)
    y = KQuantLinear([w], None, kernel())(x)
    np.testing.assert_array_equal(y.numpy(), reference(w, x))


@pytest.mark.parametrize("N,K", [(16, 32), (48, 64), (64, 4864)])
@torch.inference_mode()
def test_one_block_one_tile_and_long_rows(N, K, level):
    """The shortest row (one block), a lone group of 3 tiles, and Qwen's MLP width."""
    for i, qtype in enumerate((T.Q5_0, T.Q8_0)):
        w = random_blocks(qtype, N, K, seed=N + i)
        x = activations(3, max(K, 64), seed=K)[:, :K]  # (its outlier sits at input 40)
        np.testing.assert_array_equal(KQuantLinear([w], None, kernel())(x).numpy(), reference(w, x))


@torch.inference_mode()
def test_rows_are_the_same_whatever_rows_share_the_call_and_fused_types_split(level):
    """Qwen2.5-0.5B's q/k/v: Q5_0 q and k, Q8_0 v, width 896, with a bias."""
    parts = [random_blocks(T.Q5_0, 96, 896, 1), random_blocks(T.Q5_0, 32, 896, 2), random_blocks(T.Q8_0, 32, 896, 3)]
    lin, x, y = check_fused_rows(parts, reference)
    for n in (2, 3, 5):
        assert torch.equal(lin(x[8 - n:]), y[8 - n:])
    plain = KQuantLinear(parts, None, kernel())
    assert torch.equal(plain(x.bfloat16()), plain(x.bfloat16().float()).bfloat16())  # bf16 widens exactly
    kv = lin.take_rows(slice(96, None))
    assert torch.equal(kv(x), y[:, 96:]) and torch.equal(kv.dequantize(), lin.dequantize()[96:])
    ids = torch.tensor([[0, 100], [159, 33]])
    dense = torch.cat([p.dequantize() for p in parts])
    assert torch.equal(lin.rows(ids), dense[ids]) and torch.equal(lin.dequantize(), dense)


@torch.inference_mode()
def test_q5_q8_fuse_with_k_quants_where_the_width_takes_256(level):
    parts = [k_blocks(T.Q4_K, 32, 512, 1), random_blocks(T.Q5_0, 16, 512, 2), random_blocks(T.Q8_0, 48, 512, 3),
             k_blocks(T.Q6_K, 16, 512, 4)]
    lin = linear_from_parts(parts, None, "auto", CPU, torch.float32)
    assert isinstance(lin, KQuantLinear)
    x = activations(5, 512, seed=3)
    want = [k_reference(p, x) if p.qtype in (T.Q4_K, T.Q6_K) else reference(p, x) for p in parts]
    np.testing.assert_array_equal(lin(x).numpy(), np.concatenate(want, 1))


def test_the_repack_adds_no_byte_and_tiles_keep_their_blocks_width():
    for qtype in (T.Q5_0, T.Q8_0):
        w = random_blocks(qtype, 32, 896, 0)
        lin = KQuantLinear([w], None, kernel())
        assert repack(w).nbytes == w.data.nbytes == lin.packed.numel()
    q4k = lin.tiles.clone()
    q4k[:, 1] = int(T.Q4_K)  # the same bytes read as 256-wide blocks: 896 does not divide
    with pytest.raises(RuntimeError, match="tile 0 is not a Q4_K, Q6_K, Q5_0 or Q8_0 tile of K = 896"):
        kernel().kquant_check(lin.packed, q4k, 896)


def test_auto_runs_q5_q8_as_stored_and_falls_back_where_the_kernel_cannot(int8):
    kernel()
    q5, q8 = random_blocks(T.Q5_0, 32, 896, 0), random_blocks(T.Q8_0, 16, 896, 1)
    lin = linear_from_parts([q5, q8], None, "auto", CPU, torch.float32)
    assert isinstance(lin, KQuantLinear) and kernel_spec(lin)[0] == 4
    # a part of a type the kernel lacks (Q4_0), or rows that do not tile by 16: the old int8 repack
    q4 = GGUFWeight(T.Q4_0, np.zeros((16, 28 * 18), np.uint8))
    assert isinstance(linear_from_parts([q5, q4], None, "auto", CPU, torch.float32), Int8Linear)
    assert isinstance(linear_from_parts([random_blocks(T.Q8_0, 40, 896, 2)], None, "auto", CPU, torch.float32), Int8Linear)
    head = RefinedHead.around(linear_from_parts([q8], None, "auto", CPU, torch.float32, keep_rows=True))
    assert isinstance(head.head, KQuantLinear) and head.ranker is not None  # int4 ranks: fewer bytes than Q8_0
    ids = torch.tensor([[3, 0, 15], [7, 7, 1]])
    assert torch.equal(head.rows(ids), q8.dequantize()[ids])  # the refined logits' rows: the blocks' own
    before = kernels.use_activations("bf16")  # the kernel has no bf16 path
    try:
        assert isinstance(linear_from_parts([q5], None, "auto", CPU, torch.float32), Int8Linear)
    finally:
        kernels.use_activations(before)


@torch.inference_mode()
def test_greedy_q5_q8_gguf_model_equals_its_fake_quantized_twin(tmp_path, level):
    """Widths 224 and 448 (no 256 divides them), gguf's own quantization of random weights."""
    from specee.model.llama import Transformer

    spec = TinyGGUF("qwen2", ("Q5_0", "Q8_0"), False, layers=3, hidden=224, intermediate=448, vocab=512)
    model = Transformer.load(write_gguf(tmp_path / "m.gguf", spec), "cpu", torch.float32, quantization="auto")
    linears = [getattr(w, n) for w in model.layers for n in ("qkv", "kv", "o", "gate_up", "down")]
    assert all(isinstance(x, KQuantLinear) for x in linears + [model.head.head]) and model.fast_layers is not None
    assert {p.qtype for x in linears for p in x.parts} == {T.Q5_0, T.Q8_0}
    assert_same_greedy(model, [1, 45, 200, 7, 88, 13, 250, 9], 24, rtol=0.02)


@torch.inference_mode()
def test_greedy_qwen_05b_equals_its_fake_quantized_twin(int8):
    """The draft model this is for: 133 Q5_0 and 13 Q8_0 tensors (the head among them), width 896."""
    from specee.model.llama import Transformer
    from specee.tokenizer import Tokenizer

    if not QWEN_05B.exists():
        pytest.skip(f"{QWEN_05B} is absent (the Qwen2.5-Coder-0.5B draft model, fetched by the first draft run)")
    model = Transformer.load(QWEN_05B, "cpu", torch.float32, quantization="auto")
    qkv, gate_up = model.layers[0].qkv, model.layers[0].gate_up
    assert isinstance(qkv, KQuantLinear) and {p.qtype for p in qkv.parts + gate_up.parts} >= {T.Q5_0}
    assert isinstance(model.head.head, KQuantLinear) and model.head.head.parts[0].qtype == T.Q8_0
    prompt = Tokenizer(QWEN_05B).tok.encode("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n").ids
    assert_same_greedy(model, prompt, 32, rtol=0.02)
