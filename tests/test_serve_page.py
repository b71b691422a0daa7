"""The chat page of serve.py in a real headless Chromium (Playwright), against a real server on a tiny random
GLM-4 model.

- the header shows the model id and version from /v1/models;
- a chat message sent with Enter posts exactly the conversation (no system message when the field is empty)
  with "stream": true; the assistant bubble grows delta by delta as the server-sent events arrive, ends
  equal to the non-streaming answer of the same request (greedy decoding is deterministic) and shows the
  finish reason;
- the extraction box posts one text per line and shows one block per text whose triples table (or
  "no triples") and raw generated text are what /v1/extract answers for the same texts;
- errors are shown in the error line: an HTTP 400's message, and an error event inside a stream;
- Stop aborts a stream: the text so far stays, marked "stopped";
- triples show as a table with model text as text (no HTML);
- the API key is kept across a reload and sent as a Bearer header.
The stream's error event and the triples table are checked on answers the test hands the browser (a random
model writes no triples, and a healthy server sends no error event); the rest talks to the server.

Needs Chromium and Playwright (`apt install chromium`, `pip install playwright`; no browser download: the
system Chromium is used, or the one the CHROMIUM environment variable names); skips without them. With
SERVE_PAGE_SCREENSHOT=PATH the page is saved there as a PNG after the chat and the extraction.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from commands import HANG_S
from serving import serve_py, tiny_model

ROOT = Path(__file__).resolve().parents[1]
INSTALL = "needs Chromium and Playwright: apt install chromium && pip install playwright"
WAIT_MS = HANG_S * 1000  # Playwright waits for what the page shows: a bound on a hang, not a speed
MESSAGE = "你好"

try:
    from playwright.sync_api import expect, sync_playwright
except ImportError:
    pytest.skip(f"playwright is not importable; {INSTALL}", allow_module_level=True)


def chromium_executable() -> str | None:
    """$CHROMIUM when set (it must exist), else `chromium` or `chromium-browser` on PATH."""
    named = os.environ.get("CHROMIUM")
    if named:
        return named if os.path.isfile(named) and os.access(named, os.X_OK) else None
    return next(filter(None, (shutil.which(name) for name in ("chromium", "chromium-browser"))), None)


CHROMIUM = chromium_executable()
if CHROMIUM is None:
    WHERE = f"CHROMIUM={os.environ['CHROMIUM']} is not an executable" if os.environ.get("CHROMIUM") else \
        "no chromium or chromium-browser on PATH"
    pytest.skip(f"{WHERE}; {INSTALL} (or set CHROMIUM to a Chromium executable)", allow_module_level=True)


def call(base: str, path: str, body: dict | None = None) -> tuple[int, bytes]:
    """(HTTP status, body bytes) of a GET (no body) or a JSON POST."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=HANG_S) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def post(base: str, path: str, body: dict) -> dict:
    status, raw = call(base, path, body)
    assert status == 200, raw
    return json.loads(raw)


def stream_deltas(base: str, body: dict) -> tuple[list[str], str]:
    """(the non-empty `delta.content`s, the finish reason) of a streaming chat request."""
    status, raw = call(base, "/v1/chat/completions", {**body, "stream": True})
    assert status == 200, raw
    payloads = [e.removeprefix("data: ") for e in raw.decode().split("\n\n") if e.strip()]
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p)["choices"][0] for p in payloads[:-1]]
    return [c["delta"]["content"] for c in chunks if c["delta"].get("content")], chunks[-1]["finish_reason"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(base URL, model id) of serve.py on a tiny random GLM-4 model; stopped with SIGTERM afterwards."""
    for module in ("starlette", "uvicorn"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed: pip install -e \".[serve]\"")
    directory = tmp_path_factory.mktemp("serve-page") / "glm4-tiny"
    directory.mkdir()
    tiny_model("glm4", directory)
    with serve_py(directory, directory.parent / "server.log") as (proc, base):
        yield base, directory.name
    assert proc.poll() is not None, "serve.py did not exit"


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM)
        try:
            yield browser
        finally:
            browser.close()


def open_page(browser, base: str):
    page = browser.new_page(viewport={"width": 1100, "height": 800})
    page.set_default_timeout(WAIT_MS)  # every action and navigation too, not Playwright's 30 s
    page.goto(base + "/")
    return page


# Records each text the assistant bubbles are given: the page sets a bubble's text to the answer so far at
# every delta, so a streaming page records the growing prefixes, one per delta.
RECORD_SHOWN = """() => {
  window.shownTexts = [];
  new MutationObserver((records) => {
    for (const record of records)
      for (const node of record.addedNodes)
        if (node.nodeType === Node.TEXT_NODE && record.target.matches('.msg.assistant .text'))
          window.shownTexts.push(node.data);
  }).observe(document.getElementById('messages'), {childList: true, subtree: true});
}"""


def test_page_streams_a_chat_and_shows_extracted_triples(server, browser):
    base, model_id = server
    page = open_page(browser, base)
    expect(page.locator("#model")).to_have_text(model_id, timeout=WAIT_MS)
    expect(page.locator("#version")).to_have_text("GLM-4")

    # chat: Enter sends the one user message, streamed
    page.evaluate(RECORD_SHOWN)
    page.fill("#max-tokens", "8")
    page.fill("#temperature", "0")
    page.fill("#prompt", MESSAGE)
    with page.expect_request(lambda r: r.url.endswith("/v1/chat/completions")) as sent:
        page.press("#prompt", "Enter")
    body = {"messages": [{"role": "user", "content": MESSAGE}], "max_tokens": 8, "temperature": 0}
    assert sent.value.post_data_json == {**body, "stream": True}
    bubble = page.locator("#messages .msg.assistant").last
    expect(bubble.locator(".finish")).to_have_text(re.compile(r"\S"), timeout=WAIT_MS)
    expect(page.locator("#error")).to_be_empty()

    answer = post(base, "/v1/chat/completions", body)["choices"][0]
    deltas, finish = stream_deltas(base, body)
    assert answer["message"]["content"] and "".join(deltas) == answer["message"]["content"]
    assert len(deltas) >= 2, f"the answer came in one delta {deltas}: pick a longer max_tokens"
    assert bubble.locator(".text").text_content() == answer["message"]["content"]
    assert bubble.locator(".finish").text_content() == answer["finish_reason"] == finish
    assert page.evaluate("window.shownTexts") == ["".join(deltas[: i + 1]) for i in range(len(deltas))]
    expect(page.locator("#messages .msg.user")).to_have_text([MESSAGE])

    # extraction: one block per line, as /v1/extract answers
    lines = (ROOT / "data" / "spo_dev.jsonl").read_text(encoding="utf-8").splitlines()
    texts = [json.loads(line)["text"] for line in lines[40:42]]
    page.fill("#extract-input", "\n".join(texts))
    with page.expect_request(lambda r: r.url.endswith("/v1/extract")) as sent:
        page.click("#extract-button")
    assert sent.value.post_data_json == {"texts": texts}
    blocks = page.locator("#triples .result")
    expect(blocks).to_have_count(2, timeout=WAIT_MS)
    results = post(base, "/v1/extract", {"texts": texts})["results"]
    for block, text, result in zip(blocks.all(), texts, results):
        assert text in block.locator(".source").text_content()
        shown = [[cell.text_content() for cell in row.locator("td").all()] for row in block.locator("tbody tr").all()]
        assert shown == result["triples"]
        expect(block.locator(".none")).to_have_count(0 if result["triples"] else 1)
        if not result["triples"]:
            expect(block.locator(".none")).to_have_text("no triples")
        assert block.locator(".generated").text_content() == result["generated"]
    expect(page.locator("#error")).to_be_empty()

    screenshot = os.environ.get("SERVE_PAGE_SCREENSHOT")
    if screenshot:
        Path(screenshot).parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=screenshot)
    page.close()


# Clicks Stop as soon as an assistant bubble is given text.
STOP_AT_FIRST_TEXT = """() => {
  const observer = new MutationObserver((records) => {
    if (records.some((record) => record.target.matches('.msg.assistant .text'))) {
      document.getElementById('stop').click();
      observer.disconnect();
    }
  });
  observer.observe(document.getElementById('messages'), {childList: true, subtree: true});
}"""


def test_page_shows_errors_stops_renders_triple_tables_and_sends_the_api_key(server, browser):
    base, model_id = server
    page = open_page(browser, base)
    expect(page.locator("#model")).to_have_text(model_id, timeout=WAIT_MS)

    # an HTTP 400: the server's message in the error line, the prompt given back
    page.fill("#max-tokens", "100000")
    page.fill("#prompt", MESSAGE)
    page.click("#send")
    status, raw = call(base, "/v1/chat/completions", {"messages": [{"role": "user", "content": MESSAGE}],
                                                      "max_tokens": 100000, "stream": True})
    assert status == 400
    expect(page.locator("#error")).to_contain_text(json.loads(raw)["error"]["message"], timeout=WAIT_MS)
    expect(page.locator("#messages .msg.assistant .finish")).to_have_text("error")
    expect(page.locator("#prompt")).to_have_value(MESSAGE)

    # Stop, clicked as the first text shows: the stream is aborted, the text so far stays
    body = {"messages": [{"role": "user", "content": MESSAGE}], "max_tokens": 8, "temperature": 0}
    full = post(base, "/v1/chat/completions", body)["choices"][0]["message"]["content"]
    page.click("#clear")
    page.fill("#max-tokens", "8")
    page.fill("#temperature", "0")
    page.fill("#prompt", MESSAGE)
    page.evaluate(STOP_AT_FIRST_TEXT)
    page.click("#send")
    expect(page.locator("#messages .msg.assistant .finish")).to_have_text("stopped", timeout=WAIT_MS)
    stopped = page.locator("#messages .msg.assistant .text").text_content()
    assert stopped and full.startswith(stopped) and len(stopped) < len(full)
    expect(page.locator("#stop")).to_be_disabled()
    expect(page.locator("#send")).to_be_enabled()

    # an error event inside a stream: the text so far stays, the message is shown
    chunk = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "<i>half</i>"},
                                                             "finish_reason": None}]}
    error = {"error": {"message": "decoding failed: boom", "type": "server_error", "param": None, "code": "x"}}
    events = "".join(f"data: {json.dumps(e)}\n\n" for e in (chunk, error)) + "data: [DONE]\n\n"
    page.route("**/v1/chat/completions", lambda route: route.fulfill(status=200, content_type="text/event-stream",
                                                                     body=events))
    page.click("#clear")
    page.fill("#prompt", MESSAGE)
    page.click("#send")
    expect(page.locator("#error")).to_contain_text("decoding failed: boom", timeout=WAIT_MS)
    expect(page.locator("#messages .msg.assistant .text")).to_have_text("<i>half</i>")
    assert page.locator("#messages i").count() == 0

    # triples as a table, model text as text
    triples = [["<b>泵</b>", "部件", "活塞"], ["a", "b", "c"]]
    answer = {"object": "extraction", "usage": {"prompt_tokens": 9, "completion_tokens": 9, "total_tokens": 18},
              "results": [{"index": 0, "text": "t1", "generated": "(<b>泵</b>,部件,活塞)(a,b,c)",
                           "triples": triples,
                           "malformed": [], "stopped": "eos", "new_tokens": 7},
                          {"index": 1, "text": "t2", "generated": "?", "triples": [], "malformed": ["?"],
                           "stopped": "length", "new_tokens": 2}]}
    page.route("**/v1/extract", lambda route: route.fulfill(status=200, json=answer))
    page.fill("#extract-input", "t1\n\n t2\n")
    with page.expect_request(lambda r: r.url.endswith("/v1/extract")) as sent:
        page.click("#extract-button")
    assert sent.value.post_data_json == {"texts": ["t1", "t2"]}  # blank lines dropped, ends trimmed
    blocks = page.locator("#triples .result")
    expect(blocks).to_have_count(2, timeout=WAIT_MS)
    expect(blocks.nth(0).locator("tbody tr")).to_have_count(2)
    rows = blocks.nth(0).locator("tbody tr").all()
    assert [[cell.text_content() for cell in row.locator("td").all()] for row in rows] == triples
    assert page.locator("#triples b").count() == 0
    expect(blocks.nth(1).locator(".none")).to_have_text("no triples")
    expect(blocks.nth(1).locator("table")).to_have_count(0)

    # the API key: kept across a reload, sent as a Bearer header
    page.fill("#api-key", "secret-key")
    with page.expect_request(lambda r: r.url.endswith("/v1/models")) as sent:
        page.press("#api-key", "Tab")
    assert sent.value.headers.get("authorization") == "Bearer secret-key"
    with page.expect_request(lambda r: r.url.endswith("/v1/models")) as sent:
        page.reload()
    assert sent.value.headers.get("authorization") == "Bearer secret-key"
    expect(page.locator("#api-key")).to_have_value("secret-key")
    page.close()
