"""specee's tokenizer against transformers' AutoTokenizer: encoding, decoding, special tokens,
chat templates (rendering and token ids), and incremental detokenization."""
from __future__ import annotations

import copy
import re

import pytest
from checkpoints import clone_checkpoint, edit_json
from conftest import real_model_dir

from specee.tokenizer import IncrementalDetokenizer, Tokenizer

pytestmark = pytest.mark.usefixtures("single_thread")

TEXTS = [
    "Hello world",
    "Once upon a time, there was a little girl named Lily.",
    "  leading spaces and  double  spaces ",
    "line one\nline two\n\n\tindented\r\nwindows",
    "Unicode: café naïve façade — “quotes” 😀 日本語 ß",
    "numbers 3.14159 and 1,000,000 and 2+2=4",
    "def f(x):\n    return x ** 2  # comment\n",
    "specials in text: <s> </s> <unk> <|im_start|>user\nhi<|im_end|> <|endoftext|>",
    " ",
    "a",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "You are a helpful assistant."},
     {"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "Be brief."},
     {"role": "user", "content": "Hi!"},
     {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a story about café 😀 and <tags>."}],
]


@pytest.fixture(scope="module", params=["stories260K", "ref-target-24L", "tiny:llama2", "tiny:qwen2", "tiny:tied"])
def pair(request, real_hf_tokenizer, tiny_checkpoint):
    """(ours, transformers') tokenizers of a real model or of a tiny checkpoint's tokenizer."""
    from transformers import AutoTokenizer

    if request.param.startswith("tiny:"):
        path = tiny_checkpoint(request.param[5:])
        return Tokenizer(path), AutoTokenizer.from_pretrained(str(path))
    return Tokenizer(real_model_dir(request.param)), real_hf_tokenizer(request.param)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(pair, text):
    ours, hf = pair
    assert ours.encode(text) == hf(text).input_ids
    assert ours.encode(text, add_special_tokens=False) == hf(text, add_special_tokens=False).input_ids


def test_decode_matches_transformers(pair):
    ours, hf = pair
    for text in TEXTS:
        ids = hf(text).input_ids
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False)


def test_special_tokens_match_transformers(pair):
    ours, hf = pair
    assert ours.eos_token_id == hf.eos_token_id
    assert ours.pad_token_id == hf.pad_token_id
    assert ours.vocab_size == len(hf)


def test_incremental_detokenizer_streams_exactly_the_decoded_text(pair):
    """Token by token (multi-byte characters split over byte tokens included), the deltas add up
    to exactly the text the whole sequence decodes to after the prompt."""
    ours, hf = pair
    prompt = hf("Prompt: ").input_ids
    for text in TEXTS:
        ids = hf(text, add_special_tokens=False).input_ids
        detok = IncrementalDetokenizer(ours, prompt)
        streamed = "".join(detok.add(t) for t in ids)
        assert streamed == ours.decode(prompt + ids)[len(ours.decode(prompt)):], text


# ---- chat templates -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ref_target(real_hf_tokenizer):
    return Tokenizer(real_model_dir("ref-target-24L")), real_hf_tokenizer("ref-target-24L")


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_chat_template_rendering_matches_transformers(ref_target, conversation, add_generation_prompt):
    ours, hf = ref_target
    messages = CONVERSATIONS[conversation]
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected


@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_chat_encoding_matches_transformers(ref_target, conversation):
    ours, hf = ref_target
    messages = CONVERSATIONS[conversation]
    expected = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    assert ours.encode_chat(messages) == list(expected)


@pytest.mark.slow
def test_llm_chat_prompt_ids_match_transformers(real_llm, real_hf_tokenizer):
    from specee import SamplingParams

    llm, hf = real_llm("ref-target-24L"), real_hf_tokenizer("ref-target-24L")
    out = llm.generate("What is the capital of France?", SamplingParams(max_tokens=1), chat=True)[0]
    expected = hf.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                      tokenize=True, add_generation_prompt=True)
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    assert out.prompt_token_ids == list(expected)


def test_no_chat_template_is_a_clear_error():
    tok = Tokenizer(real_model_dir("stories260K"))
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


# Templates exercising what transformers' template environment provides beyond plain Jinja:
# strftime_now (Llama 3.x date line), loop controls, a tojson that keeps non-ASCII and '<' as is,
# the special tokens as variables, raise_exception (Mistral's role check).
LLAMA3_LIKE = (
    "{{- bos_token }}\n"
    "{%- if strftime_now is defined %}{%- set date_string = strftime_now('%d %b %Y') %}"
    "{%- else %}{%- set date_string = '26 Jul 2024' %}{%- endif %}\n"
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system_message = '' %}{%- endif %}\n"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{{- 'Today Date: ' + date_string + '\\n\\n' }}{{- system_message }}{{- '<|eot_id|>' }}\n"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}\n"
)
LOOP_TOJSON = (
    "{% for m in messages %}{% if m['role'] == 'system' %}{% continue %}{% endif %}"
    "{{ m['role'] }}: {{ m['content'] | tojson }}{{ eos_token }}\n"
    "{% if loop.index >= 3 %}{% break %}{% endif %}{% endfor %}"
    "{{ {'b': 1, 'a': '<é>'} | tojson }}{% if unk_token is defined %}[{{ unk_token }}]{% endif %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
MISTRAL_LIKE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% else %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
)


@pytest.fixture(scope="module")
def templated(tiny_checkpoint, tmp_path_factory):
    """template -> (ours, transformers') tokenizer of a tiny checkpoint carrying that chat template."""
    from transformers import AutoTokenizer

    cache = {}

    def get(template: str):
        if template not in cache:
            path = clone_checkpoint(tiny_checkpoint("llama2"), tmp_path_factory.mktemp("tmpl") / "model")
            edit_json(path / "tokenizer_config.json", chat_template=template)
            cache[template] = Tokenizer(path), AutoTokenizer.from_pretrained(str(path))
        return cache[template]

    return get


@pytest.mark.parametrize("template", [LLAMA3_LIKE, LOOP_TOJSON, MISTRAL_LIKE], ids=["llama3", "loop_tojson", "mistral"])
def test_transformers_template_features(templated, template):
    ours, hf = templated(template)
    five_turns = CONVERSATIONS[2][1:] + [{"role": "assistant", "content": "Once upon a time."},
                                         {"role": "user", "content": "  Another, please!  "}]
    for messages in CONVERSATIONS + [five_turns]:
        if template is MISTRAL_LIKE and messages[0]["role"] == "system":
            continue
        expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ours.apply_chat_template(messages, add_generation_prompt=True) == expected


def test_template_raise_exception(templated):
    ours, hf = templated(MISTRAL_LIKE)
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(Exception, match="roles must alternate"):
        hf.apply_chat_template(bad, tokenize=False)
    with pytest.raises(ValueError, match="chat template error: Conversation roles must alternate"):
        ours.apply_chat_template(bad)


@pytest.mark.parametrize("template,says", [
    ("{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}", "runs past 1000000 loop steps"),
    ("{% set s = 'x' * 99999 %}{% for i in s %}{% for j in s %}{% endfor %}{% endfor %}", "runs past 1000000 loop"),
    ("{{ 'x' * 10**9 }}", "runs past 1000000 loop steps"),
    ("{% for i in %}", "Expected an expression"),  # these three were tracebacks
    ("{{ ''.__class__.__mro__ }}", "access to attribute '__class__' of 'str' object is unsafe"),
    ("{{ range(10**9) }}", "The sandbox blocks ranges larger than MAX_RANGE"),
])
def test_a_hostile_chat_template_is_one_line_naming_its_file(templated, template, says):
    """A model file's template is untrusted: nested loops hung the CLI (the sandbox caps one range, not loops
    inside loops); syntax and sandbox errors were tracebacks."""
    ours = copy.copy(templated(LOOP_TOJSON)[0])  # the fixture's is shared
    ours.chat_template = template
    with pytest.raises(ValueError, match=rf"^{ours.source}: chat template error: .*{re.escape(says)}"):
        ours.apply_chat_template([{"role": "user", "content": "hi"}])


def test_the_loop_budget_is_per_render(templated):
    ours, hf = templated(LOOP_TOJSON)
    messages = [{"role": "user", "content": "hi"}]
    for _ in range(3):  # each render starts with the whole budget
        assert ours.apply_chat_template(messages) == hf.apply_chat_template(messages, tokenize=False,
                                                                            add_generation_prompt=True)


def test_output_ending_inside_a_multibyte_character_keeps_it_as_the_full_decode_does():
    """A request that stops (length or EOS) after 1 or 2 of the 3 byte tokens of "€": its text is
    what decoding all its tokens gives (a trailing U+FFFD), not the text before the character."""
    from specee.engine.sequence import Sequence
    from specee.sampling import SamplingParams

    tok = Tokenizer(real_model_dir("ref-target-24L"))
    prompt = tok.encode("Price:")
    ids = tok.encode(" 5€", add_special_tokens=False)
    assert tok.decode(ids[:-1]).endswith("\ufffd")  # the euro sign is split over byte tokens
    eos = tok.eos_token_id
    for cut in (len(ids) - 2, len(ids) - 1):
        by_length = Sequence("", prompt, SamplingParams(max_tokens=cut), tok, frozenset({eos}))
        by_eos = Sequence("", prompt, SamplingParams(max_tokens=99), tok, frozenset({eos}))
        for t in ids[:cut]:
            by_length.append(t)
            by_eos.append(t)
        by_eos.append(eos)
        for seq, reason in ((by_length, "length"), (by_eos, "stop")):
            assert seq.finish_reason == reason
            assert seq.text == tok.decode(ids[:cut]) and seq.text.endswith("\ufffd")
            assert seq.take_stream_delta() == seq.text  # streaming ends with the same text
