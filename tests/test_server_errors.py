"""Every bad input to `specee serve` gets its status code and the OpenAI error shape naming the
field; the API key; the body size limit; 429 with Retry-After; 503 while the model loads."""
from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
from conftest import real_model_dir

pytest.importorskip("fastapi", reason="the server extra (pip install 'specee[server]') is not installed")
pytest.importorskip("openai", reason="the openai client (requirements-ci.txt) is not installed")

import openai  # noqa: E402
from server_helpers import LiveServer  # noqa: E402

from specee import LLM  # noqa: E402
from specee.server import create_app  # noqa: E402

CHAT = {"model": "stories", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
COMPLETION = {"model": "stories", "prompt": "Once upon a time", "max_tokens": 4}


@pytest.fixture(scope="module")
def llm():
    return LLM(real_model_dir("stories260K"), dtype="float32")


@pytest.fixture(scope="module")
def server(llm):
    server = LiveServer(create_app(llm, model_name="stories", max_body_bytes=64 * 1024))
    yield server
    server.stop()


def with_(base: dict, **fields) -> dict:
    return {**base, **fields}


BAD = [  # (path, body, status, param)
    ("/v1/completions", b'{"prompt": "x", ', 400, None),
    ("/v1/completions", b'[1, 2]', 400, None),
    ("/v1/completions", b'', 400, None),
    ("/v1/completions", with_(COMPLETION, frobnicate=1), 400, "frobnicate"),
    ("/v1/completions", with_(COMPLETION, model="gpt-4"), 404, "model"),
    ("/v1/completions", {"model": "stories"}, 400, "prompt"),
    ("/v1/completions", with_(COMPLETION, prompt=[]), 400, "prompt"),
    ("/v1/completions", with_(COMPLETION, prompt=[5, 99999]), 400, "prompt"),
    ("/v1/completions", with_(COMPLETION, prompt=[5] * 600), 400, "prompt"),
    ("/v1/completions", with_(COMPLETION, max_tokens=600), 400, "max_tokens"),
    ("/v1/completions", with_(COMPLETION, max_tokens=0), 400, "max_tokens"),
    ("/v1/completions", with_(COMPLETION, temperature=-1), 400, "temperature"),
    ("/v1/completions", with_(COMPLETION, temperature="hot"), 400, "temperature"),
    ("/v1/completions", with_(COMPLETION, top_p=0), 400, "top_p"),
    ("/v1/completions", with_(COMPLETION, top_k=-2), 400, "top_k"),
    ("/v1/completions", with_(COMPLETION, n=0), 400, "n"),
    ("/v1/completions", with_(COMPLETION, n=17), 400, "n"),
    ("/v1/completions", with_(COMPLETION, seed=-1), 400, "seed"),
    ("/v1/completions", with_(COMPLETION, stop=[""]), 400, "stop"),
    ("/v1/completions", with_(COMPLETION, min_p=0.1), 400, "min_p"),
    ("/v1/completions", with_(COMPLETION, presence_penalty=0.5), 400, "presence_penalty"),
    ("/v1/completions", with_(COMPLETION, frequency_penalty=0.5), 400, "frequency_penalty"),
    ("/v1/completions", with_(COMPLETION, logit_bias={"5": 10}), 400, "logit_bias"),
    ("/v1/completions", with_(COMPLETION, logprobs=2), 400, "logprobs"),
    ("/v1/completions", with_(COMPLETION, echo=True), 400, "echo"),
    ("/v1/completions", with_(COMPLETION, suffix="end"), 400, "suffix"),
    ("/v1/completions", with_(COMPLETION, best_of=3), 400, "best_of"),
    ("/v1/completions", with_(COMPLETION, stream_options={"include_usage": True}), 400, "stream_options"),
    ("/v1/chat/completions", with_(CHAT, messages=[]), 400, "messages"),
    ("/v1/chat/completions", with_(CHAT, messages=[{"role": "tool", "content": "x"}]), 400, "messages.0.role"),
    ("/v1/chat/completions", with_(CHAT, messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]), 400, "messages.0.content.0.type"),
    ("/v1/chat/completions", CHAT, 400, "messages"),  # stories260K has no chat template
    ("/v1/chat/completions", with_(CHAT, tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tools"),
    ("/v1/chat/completions", with_(CHAT, response_format={"type": "json_schema", "json_schema": {}}), 400,
     "response_format"),
    ("/v1/chat/completions", with_(CHAT, logprobs=True), 400, "logprobs"),
    ("/v1/chat/completions", with_(CHAT, max_completion_tokens=0), 400, "max_completion_tokens"),
    ("/v1/completions", b'{"model": "stories", "prompt": "x", "temperature": NaN}', 400, "temperature"),
    ("/tokenize", {"model": "stories"}, 400, "prompt"),
    ("/tokenize", {"model": "stories", "prompt": "\ud800"}, 400, "prompt"),  # a lone surrogate: it was a 500
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/v1/nothing", {}, 404, None),
]


@pytest.mark.parametrize("path,body,status,param", BAD, ids=[f"{i}-{b[3] or b[0]}" for i, b in enumerate(BAD)])
def test_bad_input_gets_its_status_and_the_openai_error_shape(server, path, body, status, param):
    got, _, raw = server.request("POST", path, body)
    error = json.loads(raw)["error"]
    assert got == status, error
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param or (param or "") in (error["param"] or ""), error
    assert "\n" not in error["message"]


def test_the_engine_serves_after_bad_inputs(server):
    out = server.client().completions.create(model="stories", prompt="Once upon a time", max_tokens=4, temperature=0)
    assert out.choices[0].finish_reason == "length"


def test_openai_client_sees_typed_errors(server):
    client = server.client()
    with pytest.raises(openai.BadRequestError, match="tool calling is not supported"):
        client.chat.completions.create(model="stories", messages=CHAT["messages"],
                                       tools=[{"type": "function", "function": {"name": "f"}}])
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="nope", prompt="x")


def test_body_size_limit(server):
    status, _, raw = server.request("POST", "/v1/completions", with_(COMPLETION, prompt="a " * 40_000))
    assert status == 413 and json.loads(raw)["error"]["code"] == "body_too_large"


def test_api_key(llm):
    server = LiveServer(create_app(llm, model_name="stories", api_key="s3cret"))
    try:
        for key in ("wrong", "s3cret-but-longer", "s3cre"):
            with pytest.raises(openai.AuthenticationError):
                server.client(api_key=key).models.list()
        status, headers, _ = server.request("GET", "/metrics")
        assert status == 401 and headers["www-authenticate"] == "Bearer"
        assert server.request("GET", "/health")[0] == 200
        assert server.client(api_key="s3cret").models.list().data[0].id == "stories"
    finally:
        server.stop()


def test_a_request_larger_than_the_kv_cache_is_a_400_naming_max_tokens():
    """It used to pass validation and fail on the engine thread: a 500, or a 200 stream with an error event."""
    server = LiveServer(create_app(LLM(real_model_dir("stories260K"), dtype="float32", kv_cache_memory=64),
                                   model_name="stories"))
    try:
        for body in (with_(COMPLETION, max_tokens=100), with_(COMPLETION, max_tokens=100, stream=True)):
            status, _, raw = server.request("POST", "/v1/completions", body)
            error = json.loads(raw)["error"]
            assert status == 400 and error["param"] == "max_tokens", error
            assert "the KV cache holds 64 tokens" in error["message"] and "--kv-cache-memory" in error["message"]
        out = server.client().completions.create(model="stories", prompt="Once upon a time", max_tokens=8)
        assert out.choices[0].finish_reason == "length"
        # without max_tokens, the rest of the context as far as the cache holds it (it was refused, naming a
        # max_tokens the client never sent)
        out = server.client().completions.create(model="stories", prompt="Once upon a time", extra_body={"ignore_eos": True})
        assert out.choices[0].finish_reason == "length" and out.usage.total_tokens == 64
        status, _, raw = server.request("POST", "/v1/completions", {"model": "stories", "prompt": [5] * 64})
        error = json.loads(raw)["error"]
        assert status == 400 and error["param"] == "prompt" and "no room" in error["message"], error
    finally:
        server.stop()


def test_a_full_queue_answers_429_with_retry_after():
    llm = LLM(real_model_dir("stories260K"), dtype="float32", max_num_seqs=1)  # one decodes, one may wait
    server = LiveServer(create_app(llm, model_name="stories", max_queue=1))
    long = {"prompt": "Once upon a time", "max_tokens": 500, "temperature": 0, "extra_body": {"ignore_eos": True}}

    async def main():
        async with server.async_client() as client:
            calls = [client.completions.with_raw_response.create(model="stories", **long) for _ in range(6)]
            return await asyncio.gather(*calls, return_exceptions=True)

    try:
        results = asyncio.run(main())
    finally:
        server.stop()
    refused = [r for r in results if isinstance(r, openai.RateLimitError)]
    served = [r for r in results if not isinstance(r, Exception)]
    assert len(served) >= 2 and refused, results
    assert refused[0].response.headers["retry-after"] == "1" and refused[0].body["code"] == "queue_full"


def test_a_request_that_no_queue_could_hold_is_a_400_not_a_429():
    """More sequences than the server runs and queues together: a retry cannot help (it was a 429 with
    Retry-After, which the client retried for nothing)."""
    server = LiveServer(create_app(LLM(real_model_dir("stories260K"), dtype="float32", max_num_seqs=2),
                                   model_name="stories", max_queue=3))
    try:
        for fields, param in (({"prompt": ["Once"] * 6}, "prompt"), ({"prompt": "Once", "n": 6}, "n")):
            status, _, raw = server.request("POST", "/v1/completions", {"model": "stories", "max_tokens": 2, **fields})
            error = json.loads(raw)["error"]
            assert status == 400 and error["param"] == param and "--max-queue" in error["message"], error
        out = server.client().completions.create(model="stories", prompt=["Once"] * 5, max_tokens=2)
        assert len(out.choices) == 5
    finally:
        server.stop()


def test_a_long_prompt_is_tokenized_off_the_event_loop(llm):
    """A 4 MB prompt's tokenization takes seconds; on the event loop it held every other request up (a
    stream beside it got no token for 4.75 s)."""
    server = LiveServer(create_app(llm, model_name="stories"))
    text = "Once upon a time there was a little girl. " * 90000
    took = {}

    def post(path: str, body: dict) -> None:
        t0 = time.monotonic()
        took[path] = server.request("POST", path, body)[0], time.monotonic() - t0

    try:
        calls = [threading.Thread(target=post, args=("/tokenize", {"model": "stories", "prompt": text})),
                 threading.Thread(target=post, args=("/v1/completions", {"model": "stories", "prompt": text}))]
        for call in calls:
            call.start()
        time.sleep(0.3)
        gaps = []
        while any(call.is_alive() for call in calls):
            t0 = time.monotonic()
            assert server.request("GET", "/health")[0] == 200
            gaps.append(time.monotonic() - t0)
        for call in calls:
            call.join()
    finally:
        server.stop()
    assert took["/tokenize"][0] == 200 and took["/v1/completions"][0] == 400
    slowest = min(t for _, t in took.values())
    assert slowest > 1.0, f"test premise: tokenizing the prompt takes a while ({took})"
    assert max(gaps) < slowest / 3, (gaps, took)


def test_max_num_seqs_bounds_what_runs_and_the_rest_wait():
    """The engine decodes at most max_num_seqs (LLM's, `serve --max-num-seqs`); /metrics says so: the others
    count as waiting, not running (the gauge once counted every request handed to the engine)."""
    llm = LLM(real_model_dir("stories260K"), dtype="float32", max_num_seqs=2)
    server = LiveServer(create_app(llm, model_name="stories"))
    body = {"prompt": "Once upon a time", "max_tokens": 300, "temperature": 0, "extra_body": {"ignore_eos": True}}
    seen: list[tuple[float, float]] = []

    async def main():
        async with server.async_client() as client:
            calls = asyncio.gather(*(client.completions.create(model="stories", **body) for _ in range(6)))
            while not calls.done():
                seen.append((server.metric("specee:num_requests_running"), server.metric("specee:num_requests_waiting")))
                await asyncio.sleep(0.01)
            return await calls

    try:
        outs = asyncio.run(main())
    finally:
        server.stop()
    assert [o.usage.completion_tokens for o in outs] == [300] * 6
    assert max(r for r, _ in seen) == 2 and max(w for _, w in seen) >= 1, seen


def test_a_request_aborted_while_it_waits_counts_no_prompt_tokens_and_its_latency():
    """/metrics counted the prompt tokens of requests that never ran, and left out the latency of one aborted
    before admission (it had no finish time)."""
    llm = LLM(real_model_dir("stories260K"), dtype="float32", max_num_seqs=1)
    server = LiveServer(create_app(llm, model_name="stories"))
    body = {"prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "extra_body": {"ignore_eos": True}}
    try:
        running = threading.Thread(target=server.client().completions.create, kwargs={"model": "stories", **body})
        running.start()
        while server.metric("specee:num_requests_running") < 1:
            time.sleep(0.01)
        with pytest.raises(openai.APITimeoutError):  # gives up while the other one decodes
            server.client(timeout=0.3).completions.create(model="stories", **body)
        running.join(60)
        deadline = time.monotonic() + 5
        while server.metric("specee:request_success_total", 'finished_reason="abort"') < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.metric("specee:request_success_total", 'finished_reason="length"') == 1
        assert server.metric("specee:request_success_total", 'finished_reason="abort"') == 1
        assert server.metric("specee:prompt_tokens_total") == len(llm.encode("Once upon a time"))
        assert server.metric("specee:e2e_request_latency_seconds_count") == 2
    finally:
        server.stop()


def test_health_is_503_while_loading(llm):
    loaded = threading.Event()

    def load():
        loaded.wait(30)
        return llm

    server = LiveServer(create_app(load=load, model_name="stories"))
    try:
        status, _, raw = server.request("GET", "/health")
        assert status == 503 and json.loads(raw) == {"status": "loading"}
        status, headers, raw = server.request("POST", "/v1/completions", COMPLETION)
        assert status == 503 and json.loads(raw)["error"]["code"] == "model_not_ready" and "retry-after" in headers
        loaded.set()
        deadline = time.monotonic() + 10
        while server.request("GET", "/health")[0] == 503 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.client().models.list().data[0].id == "stories"
    finally:
        server.stop()


def test_a_request_that_would_pass_the_swap_space_fails_alone(monkeypatch):
    """Two requests outgrow a 64-token pool with no swap space: the one that would be parked ends with a
    generation error naming --swap-space (a 500, or an error event in its stream), the other finishes."""
    from specee.engine import scheduler

    monkeypatch.setattr(scheduler, "FIRST_ROOM", 2)  # runs that must grow as they decode
    llm = LLM(real_model_dir("stories260K"), dtype="float32", kv_cache_memory=64, swap_space=0)
    server = LiveServer(create_app(llm, model_name="stories"))
    params = {"model": "stories", "prompt": "Once upon a time", "max_tokens": 40, "temperature": 0,
              "extra_body": {"ignore_eos": True}}

    async def main():
        client = server.async_client()

        async def streamed():
            text = ""
            async for chunk in await client.completions.create(stream=True, **params):
                text += chunk.choices[0].text
            return text
        return await asyncio.gather(client.completions.create(**params), streamed(), return_exceptions=True)

    try:
        results = asyncio.run(main())
        failed = [r for r in results if isinstance(r, openai.APIError)]
        assert len(failed) == 1 and "--swap-space" in str(failed[0]), results
        finished = next(r for r in results if not isinstance(r, Exception))
        assert finished if isinstance(finished, str) else finished.choices[0].finish_reason == "length"
        assert server.metric("specee:num_requests_running") == 0 and llm.engine.kv.free_blocks == llm.engine.kv.num_blocks
    finally:
        server.stop()
