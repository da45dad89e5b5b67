"""Loading a GGUF quickly, with the same results as the slow ways it replaced: the header read by
model/gguf_header.py against gguf's GGUFReader; block codes read from their bits (gguf_blocks.block_codes
for the int4 types, the repack reference's for the others) against gguf's
dequantization of unit-scale blocks; dequantization in chunks against whole tensors; the C++ K-quant
repack against the numpy layout; the converted GGUF tokenizer read back from its cache file."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import MODELS

gguf = pytest.importorskip("gguf")
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T  # noqa: E402

from gguf_checkpoints import TinyGGUF, write_gguf  # noqa: E402
from specee.model import gguf_blocks  # noqa: E402
from specee.model.gguf_blocks import GGUFWeight  # noqa: E402
from kquant_layout import all_codes  # noqa: E402
from specee.model.gguf_header import Header  # noqa: E402

SMOLLM2 = MODELS / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
QWEN_DIR = Path(os.environ.get("SPECEE_CACHE") or Path.home() / ".cache" / "specee") / "models"
QWEN = [QWEN_DIR / "qwen2.5-coder-0.5b-instruct" / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        QWEN_DIR / "qwen2.5-coder-1.5b-instruct" / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"]
TYPES = ["Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q6_K", "Q8_0"]
F16_ONE = np.frombuffer(np.float16(1).tobytes(), np.uint8)


def unit_scale_codes(w: GGUFWeight) -> np.ndarray:
    """The codes as gguf's own dequantization gives them: a copy of the blocks with d = 1, mins 0 and
    sub-block scales 1 dequantizes to code - offset (the nibble and bit order is gguf's, not ours)."""
    import gguf.quants

    size = GGML_QUANT_SIZES[w.qtype][1]
    unit = np.ascontiguousarray(w.data).reshape(-1, size).copy()
    name = w.qtype.name
    if name == "Q6_K":
        unit[:, 192:208], unit[:, 208:210] = 1, F16_ONE
    else:
        unit[:, 0:2] = F16_ONE
    if name in ("Q4_1", "Q4_K"):
        unit[:, 2:4] = 0
    if name == "Q4_K":
        unit[:, 4:16] = np.array([1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1], np.uint8)
    offset = {"Q4_0": 8, "Q5_0": 16, "Q6_K": 32, "Q8_0": 128}.get(name, 0)
    values = getattr(gguf.quants, name).dequantize_blocks(unit) + offset
    return values.reshape(w.shape).astype(np.uint8)


def random_weight(name: str, rows: int = 32, cols: int = 512, seed: int = 0) -> GGUFWeight:
    """Random bytes for every field: every code pattern appears, and the codes do not depend on scales."""
    qtype = T[name]
    block, size = GGML_QUANT_SIZES[qtype]
    raw = np.random.default_rng(seed).integers(0, 256, (rows, cols // block * size), dtype=np.uint8)
    return GGUFWeight(qtype, raw)


def real_files() -> list[Path]:
    return [p for p in [SMOLLM2, *QWEN] if p.exists()]


@pytest.mark.parametrize("name", TYPES)
def test_block_codes_are_gguf_codes_on_random_blocks(name):
    w = random_weight(name)
    codes = all_codes(w)
    assert codes.shape == w.shape and codes.dtype == np.uint8
    np.testing.assert_array_equal(codes, unit_scale_codes(w))
    assert codes.max() == {"Q5_0": 31, "Q6_K": 63, "Q8_0": 255}.get(name, 15)  # every bit reached


def test_block_codes_are_gguf_codes_on_real_files():
    if not SMOLLM2.exists():
        pytest.skip(f"SmolLM2 GGUF not available: {SMOLLM2} is absent")
    seen = set()
    for path in real_files():
        for t in Header(path).tensors:
            if t.data.ndim == 2 and t.tensor_type.name in TYPES:
                rows = t.data[: min(len(t.data), 256)]  # the first rows of every matrix
                w = GGUFWeight(t.tensor_type, rows)
                np.testing.assert_array_equal(all_codes(w), unit_scale_codes(w), err_msg=f"{path.name} {t.name}")
                seen.add(t.tensor_type.name)
    assert {"Q4_1", "Q8_0"} <= seen


def assert_same_header(path: Path) -> None:
    reader, header = gguf.GGUFReader(path), Header(path)
    arrays = {k: f for k, f in reader.fields.items() if f.types and f.types[0] == gguf.GGUFValueType.ARRAY}
    scalars = {k: f.contents() for k, f in reader.fields.items() if k not in arrays and not k.startswith("GGUF.")}
    assert header.metadata == scalars
    assert {k: type(v) for k, v in header.metadata.items()} == {k: type(v) for k, v in scalars.items()}
    assert header.array_lengths == {k: len(f.data) for k, f in arrays.items()}
    assert header.data_offset == reader.data_offset and len(header.tensors) == len(reader.tensors)
    for a, b in zip(reader.tensors, header.tensors):
        assert (a.name, a.tensor_type, a.n_elements, a.n_bytes, a.data_offset) == \
               (b.name, b.tensor_type, b.n_elements, b.n_bytes, b.data_offset)
        assert list(a.shape) == list(b.shape) and a.data.shape == b.data.shape and a.data.dtype == b.data.dtype
        np.testing.assert_array_equal(a.data, b.data, err_msg=a.name)


@pytest.mark.parametrize("types", [("Q4_0", "Q8_0", "F16"), ("Q4_K", "Q6_K", "Q5_0", "F32")])
def test_header_equals_gguf_reader_on_written_files(tmp_path, types):
    assert_same_header(write_gguf(tmp_path / "tiny.gguf", TinyGGUF("qwen2", types, tied=False)))


def test_header_equals_gguf_reader_on_real_files():
    if not real_files():
        pytest.skip(f"no real GGUF available: {SMOLLM2} is absent")
    for path in real_files()[:2]:  # SmolLM2 and Qwen2.5-Coder-0.5B: their vocabularies, merges, templates
        assert_same_header(path)


@pytest.mark.parametrize("name", TYPES)
def test_chunked_dequantization_equals_whole(name, monkeypatch):
    import gguf.quants

    w = random_weight(name, rows=48, cols=1024, seed=1)
    size = GGML_QUANT_SIZES[w.qtype][1]
    scales = {"Q6_K": [(208, 210)]}.get(name, [(0, 2)] + ([(2, 4)] if name in ("Q4_1", "Q4_K") else []))
    blocks = w.data.reshape(-1, size)
    for a, b in scales:  # finite float16 scales, so equality means something
        blocks[:, a:b] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    whole = getattr(gguf.quants, name).dequantize_blocks(blocks).reshape(w.shape)
    monkeypatch.setattr(gguf_blocks, "CHUNK_BLOCKS", 7)  # chunks that end mid-row, a short last one
    np.testing.assert_array_equal(w.dequantize().numpy(), whole)


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q5_0", "Q8_0"])
def test_cpp_repack_is_the_numpy_layout(name):
    """kquant_repack.cpp against the numpy layout (tests/kquant_layout.py), byte for byte, for fused
    parts whose tiles end in a short group; and the tile table that goes with it."""
    from kquant_layout import interleave, repack
    from specee.model import kernels
    from specee.model.quant_gguf import KQuantLinear

    if kernels.int4_kernel() is None:
        pytest.skip("the CPU kernels are not built here (no compiler)")
    parts = [random_weight(name, rows=rows, cols=512, seed=rows) for rows in (336, 48)]  # 21 and 3 tiles
    want, tiles, at = [], [], 0
    for w in parts:
        blocks, rows = interleave(repack(w), at, int(w.qtype))
        want.append(blocks)
        tiles += rows
        at += blocks.size
    lin = KQuantLinear(parts, None, kernels.int4_kernel())
    np.testing.assert_array_equal(lin.packed.numpy(), np.concatenate(want))
    assert lin.tiles.tolist() == [list(t) for t in tiles]


# ---- the converted tokenizer's cache -----------------------------------------------------------------
def test_gguf_tokenizer_is_converted_once_then_read_back(tmp_path, monkeypatch):
    if not SMOLLM2.exists():
        pytest.skip(f"SmolLM2 GGUF not available: {SMOLLM2} is absent")
    from specee import tokenizer as tk

    monkeypatch.setenv("SPECEE_CACHE", str(tmp_path))
    tk._cached_gguf.cache_clear()
    converted = tk.Tokenizer(SMOLLM2)
    stored = list((tmp_path / "tokenizers").glob("*.json"))
    assert len(stored) == 1

    copy = tmp_path / "elsewhere" / "renamed.gguf"  # a copy or a move finds the same entry
    copy.parent.mkdir()
    shutil.copyfile(SMOLLM2, copy)
    tk._cached_gguf.cache_clear()
    assert tk.Tokenizer(copy).encode("Hi there") == converted.encode("Hi there")
    assert list((tmp_path / "tokenizers").glob("*.json")) == stored

    def no_conversion(path):
        raise AssertionError("converted again although the cache holds the tokenizer")

    monkeypatch.setattr(tk, "_convert_gguf", no_conversion)
    tk._cached_gguf.cache_clear()
    cached = tk.Tokenizer(SMOLLM2)
    texts = ["What is the capital of France?", "def f(x):\n    return x ** 2\n", "Größe 你好 😀 <|im_end|>",
             "  a\tb\n"]
    for text in texts:
        assert cached.encode(text) == converted.encode(text)
        assert cached.decode(converted.encode(text)) == converted.decode(converted.encode(text))
    messages = [{"role": "user", "content": "Hi"}]
    assert cached.encode_chat(messages) == converted.encode_chat(messages)
    assert (cached.eos_token, cached.bos_token, cached.vocab_size) == \
           (converted.eos_token, converted.bos_token, converted.vocab_size)

    monkeypatch.undo()  # a damaged cache file is converted again and replaced
    monkeypatch.setenv("SPECEE_CACHE", str(tmp_path))
    stored[0].write_text('{"tokenizer": "not json')
    tk._cached_gguf.cache_clear()
    assert tk.Tokenizer(SMOLLM2).encode(texts[0]) == converted.encode(texts[0])
    assert json.loads(stored[0].read_text())["chat_template"] == converted.chat_template
    tk._cached_gguf.cache_clear()


@pytest.mark.parametrize("name", ["Q6_K", "Q8_0"])
def test_ranker_codes_by_rows_equal_whole(name):
    from specee.model.quant import Int8Linear, int4_codes_from_float, int4_codes_of, linear_from_parts

    w = random_weight(name, rows=160, cols=512, seed=3)
    size = GGML_QUANT_SIZES[w.qtype][1]
    field = slice(208, 210) if name == "Q6_K" else slice(0, 2)
    w.data.reshape(-1, size)[:, field] = np.frombuffer(np.float16(0.02).tobytes(), np.uint8)
    heads = [linear_from_parts([w], None, "auto", torch.device("cpu"), torch.float32),
             Int8Linear.from_float(w.dequantize())]
    for head in heads:
        whole = int4_codes_from_float(head.dequantize())
        by_rows = int4_codes_of(head, weights_at_a_time=37 * 512)  # chunks of 37 rows, a short last one
        assert all(torch.equal(a, b) for a, b in zip(whole, by_rows)), type(head).__name__


def test_header_of_a_cut_or_scrambled_file_is_a_one_line_error(tmp_path):
    """Every cut inside the header, and bytes scrambled there, give CheckpointError (or, for a
    scramble that still parses, a header), never another exception or a hang."""
    from specee.model.gguf import open_gguf
    from specee.model.weights import CheckpointError

    data = write_gguf(tmp_path / "tiny.gguf", TinyGGUF("llama", ("Q8_0", "Q4_K"), tied=True)).read_bytes()
    end = Header(tmp_path / "tiny.gguf").data_offset
    rng = np.random.default_rng(0)
    cases = [data[:cut] for cut in range(0, end + 64, 37)]
    for _ in range(40):
        bad = bytearray(data)
        at = rng.integers(4, end, 3)
        bad[at[0]:at[0] + 8] = rng.integers(0, 256, 8, dtype=np.uint8).tobytes()
        bad[at[1]], bad[at[2]] = 0xFF, 0x7F
        cases.append(bytes(bad))
    refused = 0
    for i, case in enumerate(cases):
        path = tmp_path / f"case{i}.gguf"
        path.write_bytes(case)
        try:
            open_gguf(path)
        except CheckpointError as e:
            assert "not a readable GGUF file" in str(e) and "\n" not in str(e)
            if 4 < len(case) < len(data):  # a cut says where it went wrong, in words
                assert "past the end of the file" in str(e), str(e)
            refused += 1
    assert refused >= len(cases) - 40  # every cut is refused; scrambles mostly are
