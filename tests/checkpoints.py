"""Tiny random Hugging Face checkpoints built with `transformers` itself, for parity tests.

Every checkpoint is what a user would have on disk: `XForCausalLM(config).save_pretrained(dir)`
(safetensors, optionally sharded) plus a real fast tokenizer (`tokenizer.json` +
`tokenizer_config.json`) trained in code with the `tokenizers` library, so nothing is
downloaded and nothing from ../shared is needed.

The random weights are made "sharper" than transformers' init (a larger initializer_range,
RMSNorm weights and biases perturbed away from 1 and 0) so that (a) a runtime that ignores
a norm weight or a bias gets visibly different logits, and (b) greedy argmaxes are not
near-ties that fp32 rounding could flip.

RoPE settings are written into config.json *after* saving, in the exact style a variant
needs (transformers-4 `rope_theta`/`rope_scaling` or transformers-5 `rope_parameters`),
because both styles occur in real checkpoints and the runtime must read both.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

# ---- tokenizer ------------------------------------------------------------------------------

_CORPUS = [
    "Once upon a time there was a little girl named Lily. She liked to play in the park.",
    "The quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat.",
    "Tom and his friend went to the big store to buy apples, bread and milk for dinner.",
    "One day the sun was shining and the birds were singing in the tall green trees.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "Question: What is 12 plus 30? Answer: 42. The answer is correct!",
    "She said: \"Hello, world\" and smiled; then they all laughed together happily.",
]
SPECIALS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2 as in Llama 2 tokenizers
TOKENIZER_VOCAB = 320


def build_tokenizer():
    """A Llama-2-like sentencepiece-style BPE (Metaspace, BOS added) trained on a tiny corpus.

    Returns a `tokenizers.Tokenizer`; every token decodes to plain ASCII text, so generated
    text is printable and stop strings can be chosen from it.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, special_tokens=SPECIALS, show_progress=False)
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return tok


BYTELEVEL_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # Qwen/SmolLM-style, no BOS added
# Qwen2's pre-tokenizer regex (digits split one by one); transformers 5's Qwen2Tokenizer installs it
# whatever tokenizer.json says, so a Qwen2 checkpoint's tokenizer.json must carry it too (real ones do).
QWEN2_PRETOKENIZE_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
                           r"""\s*[\r\n]+|\s+(?!\S)|\s+""")


def build_bytelevel_tokenizer(qwen: bool = False):
    """A GPT-2 (SmolLM) or Qwen2 style byte-level BPE (no BOS added, EOS <|im_end|>), trained on the tiny corpus."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    if qwen:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, special_tokens=BYTELEVEL_SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    return tok


def save_tokenizer(path: Path, kind: str = "metaspace") -> int:
    """Write tokenizer.json + tokenizer_config.json into `path`; return the tokenizer's vocab size.

    kind: "metaspace" (Llama 2 style, BOS added), "gpt2" (SmolLM style) or "qwen2" (Qwen2 style)."""
    from transformers import PreTrainedTokenizerFast

    if kind == "metaspace":
        tok = build_tokenizer()
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                       pad_token="<unk>")
        # not "LlamaTokenizer": that class rebuilds a byte-fallback Metaspace pipeline of its own; the
        # generic class uses tokenizer.json as it is (stories260K covers the LlamaTokenizer case)
        tokenizer_class = "TokenizersBackend"
    elif kind in ("gpt2", "qwen2"):
        tok = build_bytelevel_tokenizer(qwen=kind == "qwen2")
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
        tokenizer_class = "Qwen2Tokenizer" if kind == "qwen2" else "GPT2Tokenizer"
    else:
        raise ValueError(kind)
    fast.save_pretrained(str(path))
    # the class name real checkpoints carry (transformers 5 picks its tokenizer class from it)
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = tokenizer_class
    config_path.write_text(json.dumps(config, indent=2))
    return tok.get_vocab_size(with_added_tokens=True)


# ---- models ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    """One checkpoint flavour. `rope` is written into config.json in `rope_style` after saving."""

    name: str
    family: str  # llama | mistral | qwen2
    config: dict[str, Any] = field(default_factory=dict)
    rope: dict[str, Any] | None = None  # rope_parameters / rope_scaling content (None = default)
    rope_theta: float = 10000.0
    rope_style: str = "v5"  # "v4": rope_theta + rope_scaling keys; "v5": rope_parameters
    vocab_padding: int = 0  # model rows beyond the tokenizer's vocabulary (Qwen-style padded vocab)
    max_shard_size: str | None = None
    nonzero_biases: bool = True
    tokenizer: str = "metaspace"  # or "gpt2" / "qwen2": byte-level, no BOS added, EOS id 2 = <|im_end|>


_BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4, max_position_embeddings=256, rms_norm_eps=1e-5,
             initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0)

VARIANTS: dict[str, Variant] = {v.name: v for v in [
    # Llama 2: MHA, default RoPE, untied head, transformers-4 style config
    Variant("llama2", "llama", rope_style="v4"),
    # Llama 3.x: GQA, rope_scaling llama3 (transformers-4 keys, as on the hub)
    Variant("llama3", "llama", dict(num_key_value_heads=2), rope_theta=500000.0, rope_style="v4",
            rope={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}),
    # transformers-5 `rope_parameters` (default rope, non-default theta)
    Variant("rope_parameters", "llama", dict(num_key_value_heads=2), rope_theta=1e6, rope_style="v5"),
    # linear rope scaling given in the transformers-5 style
    Variant("rope_linear", "llama", rope_theta=10000.0, rope_style="v5", rope={"rope_type": "linear", "factor": 4.0}),
    # Llama with attention_bias: q/k/v *and* o biases
    Variant("llama_attention_bias", "llama", dict(attention_bias=True)),
    Variant("mistral", "mistral", dict(num_key_value_heads=2, sliding_window=4096), rope_style="v4"),
    # Qwen2: q/k/v biases (made non-zero), no o bias, padded vocabulary
    Variant("qwen2", "qwen2", dict(num_key_value_heads=2), rope_theta=1e6, vocab_padding=16, tokenizer="qwen2"),
    # SmolLM-style tied embeddings (and a byte-level tokenizer, as SmolLM has)
    Variant("tied", "llama", dict(num_key_value_heads=2, tie_word_embeddings=True), tokenizer="gpt2"),
    # GQA with an explicit head_dim != hidden / heads (64 / 4 = 16)
    Variant("gqa_head_dim", "llama", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32)),
    # sharded safetensors with model.safetensors.index.json
    Variant("sharded", "llama", dict(num_hidden_layers=3), max_shard_size="150KB"),
]}

# long-context checks only (not part of the per-variant parity sweep)
LONG_CONTEXT = Variant("llama3_long", "llama", dict(num_key_value_heads=2, max_position_embeddings=8192),
                       rope_theta=500000.0, rope_style="v4",
                       rope={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 64})


def _config_and_model(family: str, kwargs: dict[str, Any]):
    import transformers as tf

    cls = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM), "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
           "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM)}[family]
    config = cls[0](**kwargs)
    return config, cls[1](config)


@torch.no_grad()
def _sharpen(model: torch.nn.Module, seed: int) -> None:
    """Norm weights away from 1 and biases away from 0, so each must be applied to match."""
    g = torch.Generator().manual_seed(seed + 1)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
        elif name.endswith(".bias"):
            p.copy_(0.5 * torch.randn(p.shape, generator=g))


def make_checkpoint(path: str | Path, variant: str | Variant, seed: int = 0) -> Path:
    """Build and save the tiny random checkpoint `variant` into `path` (created); return the path."""
    v = VARIANTS[variant] if isinstance(variant, str) else variant
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok_vocab = save_tokenizer(path, v.tokenizer)
    kwargs = {**_BASE, **v.config, "vocab_size": tok_vocab + v.vocab_padding}
    torch.manual_seed(seed)
    config, model = _config_and_model(v.family, kwargs)
    model = model.float().eval()
    if v.nonzero_biases:
        _sharpen(model, seed)
    save_kwargs = {"max_shard_size": v.max_shard_size} if v.max_shard_size else {}
    model.save_pretrained(str(path), **save_kwargs)
    set_rope(path / "config.json", v.rope_theta, v.rope, v.rope_style)
    return path


def set_rope(config_path: Path, theta: float, scaling: dict[str, Any] | None, style: str) -> None:
    """Rewrite the RoPE keys of a saved config.json in the transformers-4 or -5 style."""
    raw = json.loads(config_path.read_text())
    for key in ("rope_parameters", "rope_scaling", "rope_theta"):
        raw.pop(key, None)
    if style == "v4":
        raw["rope_theta"] = theta
        raw["rope_scaling"] = dict(scaling) if scaling else None
        if "dtype" in raw:
            raw["torch_dtype"] = raw.pop("dtype")
    elif style == "v5":
        raw["rope_parameters"] = {"rope_type": "default", **(scaling or {}), "rope_theta": theta}
    else:
        raise ValueError(style)
    config_path.write_text(json.dumps(raw, indent=2))


def edit_json(path: Path, delete: tuple[str, ...] = (), **changes: Any) -> None:
    """Set keys of a JSON file (config.json, generation_config.json, ...) and remove `delete` keys."""
    raw = json.loads(Path(path).read_text())
    for key in delete:
        raw.pop(key, None)
    raw.update(changes)
    Path(path).write_text(json.dumps(raw, indent=2))


def clone_checkpoint(src: Path, dst: Path) -> Path:
    """A copy of a (tmp) checkpoint whose JSON files can be edited: weights are symlinked, JSON copied."""
    import shutil

    dst.mkdir(parents=True)
    for f in Path(src).iterdir():
        if f.suffix == ".json":
            shutil.copy(f, dst / f.name)
        else:
            (dst / f.name).symlink_to(f.resolve())
    return dst


def load_hf(path: str | Path):
    """The transformers reference model for a checkpoint directory, in float32, eval mode."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, output_loading_info=True)
    bad = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
    assert not bad, f"transformers did not load {path} cleanly: {bad}"
    return model.eval()
