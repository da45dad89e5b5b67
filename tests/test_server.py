"""`specee serve` through the official openai client against a live server on a loopback port:
greedy texts equal `LLM.generate`'s (streamed or not; full depth, n-gram and draft-model speculation;
EAGLE and early exit in test_server_modes.py),
usage counts, 64 and 200 concurrent streams, a disconnect that cancels, n choices, tokenize, metrics
and the command line."""
from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time

import pytest
from conftest import real_model_dir

pytest.importorskip("fastapi", reason="the server extra (pip install 'specee[server]') is not installed")
openai = pytest.importorskip("openai", reason="the openai client (requirements-ci.txt) is not installed")

from server_helpers import LiveServer, served_chat, smollm_llm  # noqa: E402

from specee import LLM, SamplingParams  # noqa: E402
from specee.server import create_app  # noqa: E402

QUESTIONS = ["What is the capital of France?", "Name three colours.", "Why is the sky blue?"]
STORIES = ["Once upon a time", "The little dog", "Lily wanted to", "One day, a big", "Tom and Sue",
           "The sun was", "A bird sang", "Mom said", "The cat", "There was a boy", "Sam had a red",
           "In the park", "The old man", "A little girl", "Ben and his", "The big tree"]
MODES = {"full_depth": None, "ngram": {"method": "ngram", "num_speculative_tokens": 3}}


@pytest.fixture(scope="module")
def smollm():
    llm = smollm_llm()
    server = LiveServer(create_app(llm, model_name="smollm2"))
    yield llm, server
    server.stop()


@pytest.fixture(scope="module")
def stories():
    llm = LLM(real_model_dir("stories260K"), dtype="float32")
    server = LiveServer(create_app(llm, model_name="stories"))
    yield llm, server
    server.stop()


@pytest.fixture(params=list(MODES))
def mode(request, smollm):
    llm, _ = smollm
    llm.enable_speculative(MODES[request.param])
    if llm.speculative is not None:  # every step drafts: the gates, timing a busy machine, might not
        llm.speculative.gate = llm.speculative.row_gate = None
    yield request.param
    llm.enable_speculative(None)


def test_greedy_chat_streamed_and_generate_agree_with_usage(smollm, mode):
    llm, server = smollm
    client = server.client()
    for question in QUESTIONS[:2]:
        want = llm.generate(question, SamplingParams(max_tokens=24), chat=True)[0]
        messages = [{"role": "user", "content": question}]
        full = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=24, temperature=0)
        choice = full.choices[0]
        assert choice.message.content == want.text and choice.finish_reason == want.finish_reason
        assert full.usage.prompt_tokens == len(want.prompt_token_ids) == len(llm.encode(question, chat=True))
        assert full.usage.completion_tokens == len(want.token_ids)
        assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
        chunks = list(client.chat.completions.create(model="smollm2", messages=messages, max_tokens=24,
                                                     temperature=0, stream=True,
                                                     stream_options={"include_usage": True}))
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
            [want.finish_reason]
        assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == full.usage.model_dump()
        stats = full.model_extra["specee"]["choices"][0]
        assert stats["generated_tokens"] == len(want.token_ids)
        assert stats["threads"] == want.stats.threads == llm.threads.choice.threads >= 1  # was 0 when served
        if mode == "ngram":
            assert 0 <= stats["speculative"]["acceptance_rate"] <= 1
    assert server.metric("specee:spec_decode_num_drafts_total") > 0 or mode == "full_depth"


@pytest.mark.parametrize("tree", [None, {"topk": 2, "size": 6}])
def test_draft_model_speculation_served_equals_generate(tree):
    """Speculative decoding with a draft model (the reference pair), chain and tree."""
    config = {"method": "draft_model", "model": str(real_model_dir("ref-draft-4L")), "num_speculative_tokens": 3}
    llm = LLM(real_model_dir("ref-target-24L"), dtype="float32",
              speculative_config={**config, **({"tree": tree} if tree else {})})
    llm.speculative.gate = None  # every step drafts: the gate, timing a busy machine, might not (CI once drafted none)
    server = LiveServer(create_app(llm, model_name="ref"))
    try:
        want = llm.generate(QUESTIONS[0], SamplingParams(max_tokens=24), chat=True)[0]
        full, streamed = served_chat(server, "ref", QUESTIONS[0], 24)
        assert full.choices[0].message.content == streamed == want.text
        assert full.model_extra["specee"]["choices"][0]["speculative"]["method"] == "draft_model"
        assert server.metric("specee:spec_decode_num_accepted_tokens_total") > 0
    finally:
        server.stop()


def test_greedy_completion_streamed_and_generate_agree(smollm):
    llm, server = smollm
    client = server.client()
    prompt = "The three primary colours are"
    want = llm.generate(prompt, SamplingParams(max_tokens=20))[0]
    full = client.completions.create(model="smollm2", prompt=prompt, max_tokens=20, temperature=0)
    assert full.choices[0].text == want.text and full.usage.completion_tokens == len(want.token_ids)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="smollm2", prompt=prompt, max_tokens=20, temperature=0, stream=True) if c.choices)
    assert streamed == want.text


def test_64_concurrent_streams_equal_one_at_a_time(stories):
    llm, server = stories
    alone = {p: server.client().completions.create(model="stories", prompt=p, max_tokens=16, temperature=0)
             .choices[0].text for p in STORIES}
    prompts = STORIES * 4

    async def one(client, prompt: str) -> str:
        stream = await client.completions.create(model="stories", prompt=prompt, max_tokens=16, temperature=0,
                                                 stream=True)
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def main() -> list[str]:
        async with server.async_client() as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    t0 = time.monotonic()
    texts = asyncio.run(main())
    assert texts == [alone[p] for p in prompts]
    assert time.monotonic() - t0 < 60


def test_200_streams_at_once_all_finish_through_the_waiting_queue(stories):
    """More streams than --max-num-seqs (64): the rest wait their turn, none is refused or lost."""
    _, server = stories

    async def one(client, i: int) -> int:
        stream = await client.completions.create(model="stories", prompt=STORIES[i % 16], max_tokens=6,
                                                 temperature=0, stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        return [c.usage.completion_tokens async for c in stream if c.usage][0]

    async def main() -> list[int]:
        async with server.async_client() as client:
            return await asyncio.gather(*(one(client, i) for i in range(200)))

    assert asyncio.run(main()) == [6] * 200
    assert server.metric("specee:num_requests_waiting") == server.metric("specee:num_requests_running") == 0


def test_a_disconnected_stream_is_aborted_within_a_step(smollm):
    _, server = smollm
    client = server.client()
    aborted = server.metric("specee:request_success_total", 'finished_reason="abort"')
    stream = client.completions.create(model="smollm2", prompt="Write a long story about a dragon.",
                                       max_tokens=4000, temperature=0, stream=True, extra_body={"ignore_eos": True})
    for _, _ in zip(range(3), stream):
        pass
    assert server.metric("specee:num_requests_running") == 1
    stream.close()
    assert_aborted_and_idle(server, aborted)


def assert_aborted_and_idle(server, aborted_before: int) -> None:
    """Within 5 s nothing runs and one more request has finished as "abort" (on a busy machine the
    request may not have started when the client gave up: nothing ran yet, and its abort came later)."""
    deadline = time.monotonic() + 5
    while (server.metric("specee:num_requests_running")
           or server.metric("specee:request_success_total", 'finished_reason="abort"') < aborted_before + 1) \
            and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.metric("specee:num_requests_running") == 0
    assert server.metric("specee:request_success_total", 'finished_reason="abort"') == aborted_before + 1


def test_a_client_that_gives_up_on_a_plain_request_aborts_it(smollm):
    _, server = smollm
    aborted = server.metric("specee:request_success_total", 'finished_reason="abort"')
    with pytest.raises(openai.APITimeoutError):
        server.client(timeout=1.0).completions.create(model="smollm2", prompt="Write a long story.", max_tokens=4000,
                                                      temperature=0, extra_body={"ignore_eos": True})
    assert_aborted_and_idle(server, aborted)


def test_n_choices_and_several_prompts(stories):
    llm, server = stories
    client = server.client()
    out = client.completions.create(model="stories", prompt="Once upon a time", max_tokens=12, n=3,
                                    temperature=0.8, seed=5)
    want = [llm.generate("Once upon a time", SamplingParams(max_tokens=12, temperature=0.8, seed=5 + i))[0].text
            for i in range(3)]
    assert [c.index for c in out.choices] == [0, 1, 2] and [c.text for c in out.choices] == want
    assert out.usage.prompt_tokens == len(llm.encode("Once upon a time"))
    two = client.completions.create(model="stories", prompt=STORIES[:2], max_tokens=8, temperature=0)
    assert [c.text for c in two.choices] == [o.text for o in llm.generate(STORIES[:2], SamplingParams(max_tokens=8))]


def test_tokenize_counts_chat_messages_as_the_chat_route_encodes_them(smollm):
    """/tokenize and /v1/chat/completions share one conversion ("developer" reads as "system"), so a
    client's count is the prompt the chat route runs."""
    llm, server = smollm
    messages = [{"role": "developer", "content": "Answer in French."}, {"role": "user", "content": QUESTIONS[0]}]
    status, _, body = server.request("POST", "/tokenize", {"messages": messages})
    ids = json.loads(body)["tokens"]
    assert status == 200 and ids == llm.tokenizer.encode_chat([{"role": "system", "content": "Answer in French."},
                                                               messages[1]])
    out = server.client().chat.completions.create(model="smollm2", messages=messages, max_tokens=1, temperature=0)
    assert out.usage.prompt_tokens == len(ids)


def test_models_tokenize_detokenize_health_and_metrics(stories):
    llm, server = stories
    assert [m.id for m in server.client().models.list().data] == ["stories"]
    status, _, body = server.request("POST", "/tokenize", {"prompt": "Once upon a time"})
    ids = llm.tokenizer.encode("Once upon a time")
    assert status == 200 and json.loads(body)["tokens"] == ids
    status, _, body = server.request("POST", "/detokenize", {"tokens": ids})
    assert status == 200 and json.loads(body)["prompt"] == llm.tokenizer.decode(ids)
    assert server.request("GET", "/health")[0] == 200
    status, headers, text = server.request("GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    for name in ("num_requests_running", "num_requests_waiting", "num_requests_swapped", "prompt_tokens_total", "generation_tokens_total",
                 "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                 "spec_decode_num_accepted_tokens_total", "early_exit_layer_bucket"):
        assert f"specee:{name}" in text.decode()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_specee_serve_command():
    """The CLI: binds, loads the model in the background, serves with the key, stops on SIGTERM."""
    model = real_model_dir("stories260K")
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen([sys.executable, "-m", "specee", "serve", "--model", str(model), "--port", str(port),
                             "--served-model-name", "tiny", "--api-key", "k3y"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k3y", max_retries=0)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if client.with_options(timeout=2).get("/../health", cast_to=object) == {"status": "ok"}:
                    break
            except (openai.APIConnectionError, openai.APIStatusError):
                time.sleep(0.2)
        out = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=5, temperature=0)
        assert out.usage.completion_tokens == 5
    finally:
        proc.terminate()
        # uvicorn shuts down cleanly, then re-raises the signal it caught
        assert proc.wait(20) in (0, -15), proc.stdout.read().decode()[-2000:]
