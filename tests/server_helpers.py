"""A live uvicorn server on a free loopback port, in a thread of the test process, and raw HTTP."""
from __future__ import annotations

import functools
import http.client
import json
import socket
import threading
import time
from pathlib import Path


class LiveServer:
    def __init__(self, app):
        import uvicorn

        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)

    def client(self, **kwargs):
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=kwargs.pop("api_key", "none"), max_retries=0,
                             **kwargs)

    def async_client(self, **kwargs):
        import openai

        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0, timeout=120, **kwargs)

    def request(self, method: str, path: str, body: bytes | dict | None = None,
                headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        if isinstance(body, dict):
            body = json.dumps(body).encode()
        conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        out = resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
        conn.close()
        return out

    def metric(self, name: str, labels: str = "") -> float:
        """A sample's value from /metrics (0 when absent)."""
        _, _, text = self.request("GET", "/metrics")
        for line in text.decode().splitlines():
            if line.startswith(name + "{") and labels in line:
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def served_chat(server: LiveServer, model: str, question: str, max_tokens: int):
    """A greedy chat answer through the openai client, non-streamed (the response) and streamed (its text)."""
    client, messages = server.client(), [{"role": "user", "content": question}]
    full = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True) if c.choices)
    return full, streamed


SMOLLM = Path(__file__).resolve().parents[2] / "shared" / "models" / "smollm2-135m-instruct" / \
    "SmolLM2-135M-Instruct.Q4_1.gguf"


@functools.cache
def smollm_llm():
    """SmolLM2 on its own 4-bit weights, loaded once per test session (skips when the file is absent)."""
    import pytest

    from specee import LLM

    if not SMOLLM.exists():
        pytest.skip(f"SmolLM2 GGUF not available: {SMOLLM} is absent (../shared/models is not mounted)")
    return LLM(SMOLLM, quantization="auto")
