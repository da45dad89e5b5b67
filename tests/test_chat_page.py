"""The chat page at `/` in a real headless Chromium (Debian's chromium + chromedriver, driven by
selenium): type a question, see the streamed answer equal `LLM.generate`'s, stop a long reply."""
from __future__ import annotations

import shutil
import time

import pytest

pytest.importorskip("fastapi", reason="the server extra (pip install 'specee[server]') is not installed")
webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (.ci/run installs it)")

from server_helpers import LiveServer, smollm_llm  # noqa: E402

from specee import SamplingParams  # noqa: E402
from specee.server import create_app  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")


@pytest.fixture(scope="module")
def page():
    if not (CHROMIUM and DRIVER):
        pytest.skip("Chromium or chromedriver not installed (Debian: apt-get install chromium chromium-driver)")
    llm = smollm_llm()
    server = LiveServer(create_app(llm, model_name="smollm2"))
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(flag)
    browser = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=DRIVER))
    try:
        browser.get(server.url + "/")
        yield browser, server, llm
    finally:
        browser.quit()
        server.stop()


def wait_for(condition, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(0.05)
    raise AssertionError("the page did not get there in time")


def ask(browser, text: str) -> None:
    from selenium.webdriver.common.keys import Keys

    box = browser.find_element("id", "prompt")
    box.send_keys(text)
    box.send_keys(Keys.ENTER)


def last_reply(browser):
    replies = browser.find_elements("css selector", ".msg.assistant, .msg.error")
    return replies[-1] if replies else None


def test_a_question_streams_its_answer(page):
    browser, _, llm = page
    wait_for(lambda: browser.find_element("id", "model").text == "smollm2")
    question = "What is the capital of France? Answer in one sentence."  # ends at EOS (not a near-tie: README)
    ask(browser, question)
    reply = wait_for(lambda: (r := last_reply(browser)) is not None and r.get_attribute("data-done") and r)
    want = llm.generate(question, SamplingParams(max_tokens=256), chat=True)[0].text
    assert reply.get_attribute("data-done") == "finished" and reply.text == want.strip()
    assert "tokens/s" in browser.find_element("id", "stats").text


def test_stop_ends_a_long_reply(page):
    browser, server, _ = page
    ask(browser, "Write a very long story about a dragon who learns to bake bread.")
    wait_for(lambda: (r := last_reply(browser)) is not None and r.get_attribute("data-streaming") and len(r.text) > 20)
    browser.find_element("id", "stop").click()
    reply = wait_for(lambda: (r := last_reply(browser)).get_attribute("data-done") and r)
    assert reply.get_attribute("data-done") == "stopped" and "(stopped)" in browser.find_element("id", "stats").text
    wait_for(lambda: server.metric("specee:num_requests_running") == 0, timeout=5)


def test_a_turn_that_fails_is_not_sent_again(page):
    """A 400 (here a message past the context) used to stay in the conversation with an empty reply, so
    every later turn failed the same way until "New chat"."""
    browser, _, _ = page
    browser.find_element("id", "reset").click()
    browser.execute_script("send(arguments[0])", "word " * 9000)
    reply = wait_for(lambda: (r := last_reply(browser)) is not None and r.get_attribute("data-done") and r)
    assert "error" in reply.get_attribute("class") and "context" in reply.text
    assert browser.execute_script("return messages.length") == 0
    ask(browser, "Say hello.")
    reply = wait_for(lambda: (r := last_reply(browser)).get_attribute("data-done") and "error" not in
                     r.get_attribute("class") and r)
    assert reply.get_attribute("data-done") == "finished" and reply.text
    assert browser.execute_script("return messages.map(m => m.role)") == ["user", "assistant"]
