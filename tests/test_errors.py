"""Bad inputs fail early with a specific, actionable message."""
from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
import torch
from checkpoints import clone_checkpoint, edit_json
from cli_helpers import assert_one_line_error, run_cli

from specee import LLM, SamplingParams
from specee.model.config import UnsupportedModelError
from specee.model.kv_cache import ContextLengthError
from specee.model.weights import CheckpointError
from specee.tokenizer import Tokenizer

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint("llama2")


@pytest.fixture(scope="module")
def llm(tiny_llm):
    return tiny_llm("llama2")


def clone(ckpt, tmp_path):
    return clone_checkpoint(ckpt, tmp_path / "model")


# ---- checkpoint directory ---------------------------------------------------------------------


def test_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="model directory not found: .*does-not-exist"):
        LLM(tmp_path / "does-not-exist")
    with pytest.raises(FileNotFoundError, match="model file not found: .*missing.gguf"):
        LLM(tmp_path / "missing.gguf")


def test_directory_without_config(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        LLM(tmp_path)


def test_directory_without_weights(ckpt, tmp_path):
    shutil.copy(ckpt / "config.json", tmp_path / "config.json")
    with pytest.raises(CheckpointError, match="no model.safetensors or model.safetensors.index.json found"):
        LLM(tmp_path)


def test_pickle_only_weights(ckpt, tmp_path):
    from checkpoints import load_hf

    shutil.copy(ckpt / "config.json", tmp_path / "config.json")
    torch.save(load_hf(ckpt).state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"only pickle weights \(\*\.bin/\*\.pt\) found; specee loads safetensors"):
        LLM(tmp_path)


def test_missing_shard(tiny_checkpoint, tmp_path):
    path = clone(tiny_checkpoint("sharded"), tmp_path)
    shard = sorted(path.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"shards listed in model.safetensors.index.json are missing: {shard.name}"):
        LLM(path)


@pytest.mark.parametrize("index,reason", [
    ("{}", r"no 'weight_map'"),
    ('{"weight_map": ', "Expecting value"),
    ('{"weight_map": {"lm_head.weight": "../elsewhere.safetensors"}}', "shard file names in its directory"),
    ('{"weight_map": []}', "shard file names in its directory"),
])
def test_a_malformed_shard_index_is_one_line_naming_it(tiny_checkpoint, tmp_path, index, reason):
    path = clone(tiny_checkpoint("sharded"), tmp_path)
    (path / "model.safetensors.index.json").write_text(index)
    with pytest.raises(CheckpointError, match=rf"model.safetensors.index.json: .*{reason}") as e:
        LLM(path)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("edit,says", [
    ({"max_position_embeddings": 2**40}, "max_position_embeddings 1099511627776 is past the 2097152 positions"),
    ({"num_attention_heads": 0}, "num_attention_heads must be an integer >= 1, got 0"),  # was a ZeroDivisionError
    ({"rms_norm_eps": "x"}, "rms_norm_eps must be a finite number > 0, got 'x'"),  # a torch traceback at decode
    ({"hidden_size": "256"}, "hidden_size must be an integer >= 1, got '256'"),  # "config implies (8192, '256')"
    ({"rope_theta": float("nan")}, "rope_theta must be a finite number > 0, got nan"),
])
def test_hostile_config_values_are_one_line_naming_the_file(ckpt, tmp_path, edit, says):
    path = clone(ckpt, tmp_path)
    edit_json(path / "config.json", **edit)
    with pytest.raises(ValueError, match=re.escape(f"{path / 'config.json'}: {says}")):
        LLM(path)


def test_weights_that_do_not_fit_the_config(ckpt, tmp_path):
    path = clone(ckpt, tmp_path)
    edit_json(path / "config.json", intermediate_size=128)
    with pytest.raises(CheckpointError, match=r"weight 'model.layers.0.mlp.gate_proj.weight' has shape \(96, 64\), "
                                              r"config implies \(128, 64\)"):
        LLM(path)


def test_invalid_config_json(ckpt, tmp_path):
    path = clone(ckpt, tmp_path)
    (path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json: not valid JSON"):
        LLM(path)


def test_missing_tokenizer(ckpt, tmp_path):
    path = clone(ckpt, tmp_path)
    (path / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        LLM(path)


def _vocab(path) -> int:
    return json.loads((path / "config.json").read_text())["vocab_size"]


def test_vocab_size_not_matching_the_weights(ckpt, tmp_path):
    path = clone(ckpt, tmp_path)
    rows = _vocab(ckpt)
    edit_json(path / "config.json", vocab_size=100)
    with pytest.raises(CheckpointError, match=rf"weight 'model.embed_tokens.weight' has shape \({rows}, 64\), "
                                              r"config implies \(100, 64\)"):
        LLM(path)


def test_tokenizer_larger_than_the_embedding(ckpt, tiny_checkpoint, tmp_path):
    path = clone(ckpt, tmp_path)
    bigger = tiny_checkpoint("qwen2")  # its tokenizer has more tokens than llama2's model has rows
    n_tokens = Tokenizer(bigger).vocab_size
    assert n_tokens > _vocab(ckpt), "test premise"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).unlink()
        shutil.copy(bigger / name, path / name)
    with pytest.raises(ValueError, match=f"tokenizer has {n_tokens} tokens but the model only {_vocab(ckpt)} "
                                         "embedding rows"):
        LLM(path)


# ---- unsupported models -----------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["gpt2", "phi"])
def test_unsupported_architecture(arch, tmp_path):
    import transformers as tf

    if arch == "gpt2":
        cfg = tf.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=64)
        model, name = tf.GPT2LMHeadModel(cfg), "GPT2LMHeadModel"
    else:
        cfg = tf.PhiConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                           vocab_size=64, max_position_embeddings=64)
        model, name = tf.PhiForCausalLM(cfg), "PhiForCausalLM"
    model.save_pretrained(str(tmp_path))
    with pytest.raises(UnsupportedModelError, match=f"unsupported architecture '{name}'.*specee supports "
                                                    "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"):
        LLM(tmp_path)


@pytest.mark.parametrize("style", ["v4", "v5"])
@pytest.mark.parametrize("rope_type", ["yarn", "dynamic", "longrope"])
def test_unsupported_rope_type(ckpt, tmp_path, style, rope_type):
    path = clone(ckpt, tmp_path)
    scaling = {"rope_type": rope_type, "factor": 4.0, "original_max_position_embeddings": 64}
    if style == "v4":
        edit_json(path / "config.json", delete=("rope_parameters",), rope_theta=10000.0, rope_scaling=scaling)
    else:
        edit_json(path / "config.json", delete=("rope_scaling", "rope_theta"),
                  rope_parameters={**scaling, "rope_theta": 10000.0})
    with pytest.raises(UnsupportedModelError, match=f"unsupported rope scaling '{rope_type}'; supported: "
                                                    "default, linear, llama3"):
        LLM(path)


def test_old_style_rope_scaling_type_key(ckpt, tmp_path):
    """Older configs say {"type": "yarn"} instead of {"rope_type": ...}."""
    path = clone(ckpt, tmp_path)
    edit_json(path / "config.json", delete=("rope_parameters",), rope_theta=10000.0,
              rope_scaling={"type": "yarn", "factor": 2.0})
    with pytest.raises(UnsupportedModelError, match="unsupported rope scaling 'yarn'"):
        LLM(path)


@pytest.mark.parametrize("change, message", [
    ({"hidden_act": "gelu"}, "unsupported hidden_act 'gelu'"),
    ({"mlp_bias": True}, "mlp_bias=true is not supported"),
])
def test_unsupported_options(ckpt, tmp_path, change, message):
    path = clone(ckpt, tmp_path)
    edit_json(path / "config.json", **change)
    with pytest.raises(UnsupportedModelError, match=message):
        LLM(path)


# ---- requests ---------------------------------------------------------------------------------


def test_prompt_too_long_for_the_context(llm):
    limit = llm.model.cfg.max_position_embeddings
    assert limit == 256
    prompt = [5] * 250
    with pytest.raises(ContextLengthError, match=r"prompt \(250 tokens\) \+ max_tokens \(10\) = 260 exceeds the "
                                                 r"model's context of 256 tokens"):
        llm.generate([prompt], SamplingParams(max_tokens=10))
    with pytest.raises(ContextLengthError, match="exceeds the model's context"):
        llm.generate([[5] * 300], SamplingParams(max_tokens=1))
    # in a batch, one request that does not fit is refused before any work
    with pytest.raises(ContextLengthError, match=r"prompt \(250 tokens\)"):
        llm.generate([[5, 6], prompt], SamplingParams(max_tokens=10))
    with pytest.raises(ContextLengthError):
        list(llm.stream(prompt, SamplingParams(max_tokens=10)))


def test_prompt_exactly_filling_the_context_is_accepted(llm):
    out = llm.generate([[5] * 250], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    assert len(out.token_ids) == 6


@pytest.mark.parametrize("max_tokens", [0, -1, 2.5, True])
def test_bad_max_tokens(max_tokens):
    with pytest.raises(ValueError, match="max_tokens .* must be a positive integer"):
        SamplingParams(max_tokens=max_tokens)


@pytest.mark.parametrize("top_p", [0.0, -0.1, 1.01, float("nan")])
def test_top_p_outside_range(top_p):
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        SamplingParams(top_p=top_p)


@pytest.mark.parametrize("temperature", [-0.5, -1e-9, float("nan"), float("inf")])
def test_bad_temperature(temperature):
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
        SamplingParams(temperature=temperature)


@pytest.mark.parametrize("top_k", [-1, 1.5])
def test_bad_top_k(top_k):
    with pytest.raises(ValueError, match="top_k must be an integer >= 0"):
        SamplingParams(top_k=top_k)


def test_empty_stop_string():
    with pytest.raises(ValueError, match="stop must hold non-empty strings"):
        SamplingParams(stop=["ok", ""])


def test_empty_prompt(llm, tiny_llm):
    with pytest.raises(ValueError, match="empty prompt: at least one token is needed"):
        llm.generate([[]], SamplingParams(max_tokens=4))
    # a tokenizer that adds no BOS turns "" into no tokens at all
    qwen = tiny_llm("qwen2")
    assert qwen.tokenizer.encode("") == []
    with pytest.raises(ValueError, match="empty prompt: at least one token is needed"):
        qwen.generate("", SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="no prompts given"):
        llm.generate([], SamplingParams(max_tokens=4))


def test_token_ids_out_of_range(llm):
    vocab = llm.model.cfg.vocab_size
    with pytest.raises(ValueError, match=rf"prompt token ids out of range \[0, {vocab}\): \[{vocab}, -1\]"):
        llm.generate([[1, vocab, -1]], SamplingParams(max_tokens=2))


def test_a_float_token_id_is_refused_alone(llm):
    """A float id used to pass the range check and fail the embedding inside the step of every running request."""
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    running = llm.stream([3, 4, 5], params)
    first = next(running)
    with pytest.raises(TypeError, match="prompt token ids must be integers, got float"):
        llm.generate([5, 1.5], SamplingParams(max_tokens=2))
    text = first + "".join(running)
    assert llm.last_output.finish_reason == "length"
    alone = llm.generate([[3, 4, 5]], params)[0]
    assert text == alone.text
    assert llm.generate([[np.int64(3), 4, 5]], params)[0].token_ids == alone.token_ids  # numpy integers are ids


def test_params_list_length_mismatch(llm):
    with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
        llm.generate(["a", "b", "c"], [SamplingParams(), SamplingParams()])


def test_unknown_dtype(ckpt):
    with pytest.raises(ValueError, match="unknown dtype 'float8'"):
        LLM(ckpt, dtype="float8")


# ---- found when tried as a new user would: each a one-line `specee: error:` (exit 2) ---------------
@pytest.mark.parametrize("keep", [100, 20000])  # a cut header, and a header whose data is cut short
def test_truncated_safetensors_in_generate_and_info(ckpt, tmp_path, capsys, keep):
    path = clone(ckpt, tmp_path)
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    weights.unlink()  # the clone's weights are a symlink to the shared checkpoint
    weights.write_bytes(data[:keep])
    for argv in (["generate", "--prompt", "hi", "--no-chat"], ["info"]):
        code, _, err = run_cli(capsys, *argv, "--model", str(path))
        assert_one_line_error(code, err, "model.safetensors: not a readable safetensors file (truncated or corrupt")


def test_config_without_hidden_size(ckpt, tmp_path, capsys):
    path = clone(ckpt, tmp_path)
    edit_json(path / "config.json", delete=["hidden_size"])
    with pytest.raises(ValueError, match="config.json: missing required key.s. hidden_size"):
        LLM(path)
    code, _, err = run_cli(capsys, "info", "--model", str(path))
    assert_one_line_error(code, err, "missing required key(s) hidden_size")


@pytest.mark.parametrize("command", [["generate", "--prompt", "hi", "--draft", "ngram"],
                                     ["calibrate", "-o", "bank", "--draft", "ngram"],
                                     ["bench", "speed", "--draft", "ngram"]])
def test_huge_k_is_refused_before_any_work(capsys, monkeypatch, command):
    import specee.engine.llm as llm_module

    def never(*_a, **_k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(llm_module.LLM, "__init__", never)
    code, _, err = run_cli(capsys, *command, "--k", "5000")
    assert code == 2 and "--k 5000 is too large: at most 64" in err


def test_truncated_gguf_and_unsupported_tensor_type(tmp_path, capsys):
    from gguf_checkpoints import TinyGGUF, write_gguf

    spec = TinyGGUF("llama", ("Q8_0",), True)
    good = write_gguf(tmp_path / "good.gguf", spec).read_bytes()
    (tmp_path / "cut.gguf").write_bytes(good[: len(good) // 2])
    write_gguf(tmp_path / "q8_1.gguf", spec, override_type={"blk.1.ffn_down.weight": "Q8_1"})
    for argv in (["generate", "--prompt", "hi", "--no-chat"], ["info"]):
        code, _, err = run_cli(capsys, *argv, "--model", str(tmp_path / "cut.gguf"))
        assert_one_line_error(code, err, "cut.gguf: not a readable GGUF file (truncated or corrupt")
        code, _, err = run_cli(capsys, *argv, "--model", str(tmp_path / "q8_1.gguf"))
        assert_one_line_error(code, err, "GGUF tensor type(s) Q8_1 cannot be dequantized")


def test_errors_name_the_flag_the_user_typed(ckpt, capsys):
    code, _, err = run_cli(capsys, "generate", "--model", str(ckpt), "--prompt", "hi", "--no-chat",
                           "--max-new-tokens", "100000")
    assert_one_line_error(code, err, "--max-new-tokens (100000)", "lower --max-new-tokens")
    assert "max_tokens" not in err


def test_ctrl_c_in_chat_stops_the_reply_not_the_conversation(ckpt, tmp_path, capsys, monkeypatch):
    import io
    import sys

    from specee import cli

    path = clone(ckpt, tmp_path)
    edit_json(path / "tokenizer_config.json", chat_template="{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    seen: list[list[dict[str, str]]] = []
    original = Tokenizer.encode_chat

    def spy(self, messages):
        seen.append([dict(m) for m in messages])
        return original(self, messages)

    writes = []

    def write_out(text: str) -> None:
        writes.append(text)
        if len(seen) == 2 and text != "\n":  # the first reply (after the check before loading): Ctrl-C at its first text
            raise KeyboardInterrupt

    monkeypatch.setattr(Tokenizer, "encode_chat", spy)
    monkeypatch.setattr(cli.run, "write_out", write_out)
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello\nOnce upon a time\n"))
    code, _, err = run_cli(capsys, "chat", "--model", str(path), "--max-new-tokens", "6")
    assert code == 0, err
    assert "reply interrupted" in err
    check, *seen = seen  # before loading: does an empty turn leave room for --max-new-tokens?
    assert check == [{"role": "user", "content": ""}]
    assert [[m["role"] for m in msgs] for msgs in seen] == [["user"], ["user", "assistant", "user"]]
    assert seen[1][1]["content"] == writes[0]  # the interrupted reply keeps the text shown before Ctrl-C
    assert len([w for w in writes if w != "\n"]) > 1  # the second reply streamed
