"""The tokenizer of a GGUF file (SmolLM2-135M-Instruct, and the Qwen2.5-Coder pair when fetched) against
transformers' AutoTokenizer on the same file: encoding and decoding of 1,000+ varied strings, special
tokens, and the chat template rendered from the GGUF metadata."""
from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
from conftest import MODELS

from specee.tokenizer import Tokenizer

pytest.importorskip("gguf")

SMOLLM2 = MODELS / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
QWEN_DIR = Path(os.environ.get("SPECEE_CACHE") or Path.home() / ".cache" / "specee") / "models"
FILES = {"smollm2": SMOLLM2,
         "qwen2.5-coder-0.5b": QWEN_DIR / "qwen2.5-coder-0.5b-instruct" / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"}

FRAGMENTS = [
    "Hello world", "The quick brown fox jumps over the lazy dog.", "What is the capital of France?",
    "def f(x):\n    return x ** 2  # square\n", "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "SELECT name, COUNT(*) FROM users GROUP BY name;", "import numpy as np\nnp.zeros((3, 4))",
    "const f = async () => { await fetch('/api'); };", "<div class=\"x\">&amp;</div>", "{\"key\": [1, 2.5, null]}",
    "Bonjour, comment ça va ? Très bien.", "Größe, Straße, übermäßig", "¿Dónde está la biblioteca?",
    "Привет, как дела?", "你好，世界。今天天气很好。", "日本語のテキストです。", "안녕하세요",
    "مرحبا بالعالم", "שלום עולם", "नमस्ते दुनिया", "Γειά σου κόσμε", "emoji 😀🎉👍🏽 and ❤️",
    "3.14159 1,000,000 2+2=4 0x1F 1e-9", "   ", "\t\t", "\n\n\n", "  leading", "trailing  ", "a  b   c    d",
    "\r\n", "line\nbreak", "tab\tseparated\tvalues", "'s 't 're 've 'm 'll 'd", "CAPS and MiXeD case",
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<s>", "</s>", "<|fim_prefix|>", "<think>", "#", "@@", "~~~",
]


def varied_strings(n: int = 1200, seed: int = 0) -> list[str]:
    """Single fragments, then random concatenations of 1-4 fragments with random separators."""
    rng = random.Random(seed)
    seps = ["", " ", "  ", "\n", "\t", " \n ", "    "]
    texts = list(FRAGMENTS)
    while len(texts) < n:
        parts = rng.sample(FRAGMENTS, rng.randint(1, 4))
        texts.append("".join(p + rng.choice(seps) for p in parts))
    return texts


CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a helpful assistant."},
     {"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me about café 😀 and <tags>."}],
]


@pytest.fixture(scope="module", params=list(FILES))
def pair(request, gguf_llm, gguf_hf_tokenizer):
    path = FILES[request.param]
    if not path.exists():
        pytest.skip(f"{request.param} GGUF not available: {path} is absent")
    ours = gguf_llm(path).tokenizer if path == SMOLLM2 else Tokenizer(path)  # SmolLM2's LLM is shared
    return ours, gguf_hf_tokenizer(path)


def test_special_tokens(pair):
    ours, hf = pair
    assert (ours.bos_token, ours.eos_token, ours.pad_token, ours.unk_token) == (
        hf.bos_token, hf.eos_token, hf.pad_token, hf.unk_token)
    assert ours.eos_token_id == hf.eos_token_id is not None
    assert ours.vocab_size == len(hf)


def test_encode_and_decode_match_transformers(pair):
    ours, hf = pair
    texts = varied_strings()
    assert len(texts) >= 1000
    for text in texts:
        ids = hf(text).input_ids
        assert ours.encode(text) == ids, text
        assert ours.encode(text, add_special_tokens=False) == hf(text, add_special_tokens=False).input_ids, text
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True), text
        assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False), text


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_template_renders_like_transformers(pair, messages):
    ours, hf = pair
    assert ours.chat_template is not None and ours.chat_template == hf.chat_template
    text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(messages) == text
    assert ours.encode_chat(messages) == hf(text, add_special_tokens=False).input_ids
