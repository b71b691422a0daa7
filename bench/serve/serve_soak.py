"""The soak test of bench/serve/serve.py (--soak N): N short requests from several clients against the batching
server, 10% bad (each must get HTTP 400 with OpenAI's error JSON), 10% streams abandoned after their first chunk,
the rest good, half streamed; every answer checked, then the server's health, log and RSS growth.
"""

from __future__ import annotations

import json
import random
import threading
import time
from dataclasses import dataclass

from bench.serve.serve_load import chat_content
from bench.serve.serve_servers import MB, RssSampler, Server

SOAK_RSS_GROWTH = 0.10
SOAK_RSS_AFTER = 100
SOAK_TEXT_CHARS = 12  # soak prompts: the first characters of a dev text (short requests: prefill stays small)


BAD_KINDS = ("temperature", "model", "empty_messages", "max_tokens_0", "invalid_json")


@dataclass(frozen=True)
class SoakSpec:
    k: int
    category: str  # "good", "bad", "abandon"
    kind: str  # "chat" / "completion"; for "bad" one of BAD_KINDS
    stream: bool
    max_tokens: int
    text: str


def soak_specs(n: int, texts: list[str], seed: int = 0) -> list[SoakSpec]:
    specs = []
    for k in range(n):
        text = texts[k % len(texts)][:SOAK_TEXT_CHARS]
        max_tokens, kind = 4 + k % 5, ("completion", "chat")[(k // 10) % 2]
        if k % 10 == 0:
            specs.append(SoakSpec(k, "bad", BAD_KINDS[(k // 10) % len(BAD_KINDS)], False, max_tokens, text))
        elif k % 10 == 1:
            specs.append(SoakSpec(k, "abandon", kind, True, max_tokens, text))
        else:
            specs.append(SoakSpec(k, "good", ("completion", "chat")[k % 2], (k // 2) % 2 == 0, max_tokens, text))
    random.Random(seed).shuffle(specs)
    return specs


def soak_body(spec: SoakSpec, model: str) -> tuple[str, bytes]:
    """(path, body) of a soak request."""
    if spec.category == "bad":
        body = {"model": model, "messages": [{"role": "user", "content": chat_content(spec.text)}],
                "max_tokens": spec.max_tokens}
        if spec.kind == "temperature":
            body["temperature"] = -1
        elif spec.kind == "model":
            body["model"] = "no-such-model"
        elif spec.kind == "empty_messages":
            body["messages"] = []
        elif spec.kind == "max_tokens_0":
            body["max_tokens"] = 0
        else:
            return "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}'  # cut short: not JSON
        return "/v1/chat/completions", json.dumps(body).encode()
    body = {"model": model, "max_tokens": spec.max_tokens, "temperature": 0, "stream": spec.stream}
    if spec.stream:
        body["stream_options"] = {"include_usage": True}
    if spec.kind == "chat":
        body["messages"] = [{"role": "user", "content": chat_content(spec.text)}]
        return "/v1/chat/completions", json.dumps(body, ensure_ascii=False).encode()
    body["prompt"] = spec.text
    return "/v1/completions", json.dumps(body, ensure_ascii=False).encode()


def soak_one(session, base: str, model: str, spec: SoakSpec) -> str | None:
    """Send one soak request; None if it behaved, else what went wrong."""
    path, body = soak_body(spec, model)
    headers = {"Content-Type": "application/json"}
    if spec.category == "bad":
        r = session.post(base + path, data=body, headers=headers, timeout=120)
        try:
            err = r.json().get("error", {})
        except ValueError:
            err = None
        if r.status_code != 400 or not isinstance(err, dict) or not err.get("message"):
            return f"bad/{spec.kind}: HTTP {r.status_code} {r.text[:120]!r} (expected 400 with an error object)"
        return None
    if spec.category == "abandon":
        with session.post(base + path, data=body, headers=headers, timeout=120, stream=True) as r:
            if r.status_code != 200:
                return f"abandon/{spec.kind}: HTTP {r.status_code} {r.text[:120]!r}"
            for line in r.iter_lines():
                if line.startswith(b"data: "):
                    break  # the first chunk: hang up (the with block closes the connection)
        return None
    if not spec.stream:
        r = session.post(base + path, data=body, headers=headers, timeout=300)
        if r.status_code != 200:
            return f"good/{spec.kind}: HTTP {r.status_code} {r.text[:160]!r}"
        data = r.json()
        return _check_answer(spec, [data["choices"][0].get("finish_reason")], data.get("usage"), True)
    with session.post(base + path, data=body, headers=headers, timeout=300, stream=True) as r:
        if r.status_code != 200:
            return f"good/{spec.kind}/stream: HTTP {r.status_code} {r.text[:160]!r}"
        events = [line[6:] for line in r.iter_lines() if line.startswith(b"data: ")]
    if not events or events[-1] != b"[DONE]":
        return f"good/{spec.kind}/stream: no data: [DONE] at the end ({events[-1:]!r})"
    chunks = [json.loads(e) for e in events[:-1]]
    if any("error" in c for c in chunks):
        return f"good/{spec.kind}/stream: an error event {[c for c in chunks if 'error' in c][0]}"
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")
                and c["choices"][0].get("finish_reason")]
    usage = [c["usage"] for c in chunks if c.get("usage")]
    return _check_answer(spec, finishes, usage[-1] if len(usage) == 1 else None, len(usage) == 1)


def _check_answer(spec: SoakSpec, finishes: list, usage: dict | None, one_usage: bool) -> str | None:
    what = f"good/{spec.kind}/{'stream' if spec.stream else 'whole'}"
    if len(finishes) != 1 or finishes[0] not in ("length", "stop"):
        return f"{what}: finish_reason {finishes!r} (expected exactly one of length/stop)"
    if usage is None or not one_usage:
        return f"{what}: no (single) usage"
    n = usage["completion_tokens"]
    if not (n == spec.max_tokens and finishes[0] == "length") and not (finishes[0] == "stop"
                                                                       and 1 <= n <= spec.max_tokens):
        return f"{what}: {n} completion tokens with finish_reason {finishes[0]!r}, max_tokens {spec.max_tokens}"
    return None


def soak(server: Server, n: int, clients: int, time_limit: float, texts: list[str]) -> dict:
    import requests

    specs = soak_specs(n, texts)
    queue = list(reversed(specs))
    lock = threading.Lock()
    done = {"count": 0}
    failures: list[str] = []
    counts = {c: 0 for c in ("good", "bad", "abandon")}
    rss_marks: dict[str, int] = {}
    deadline = time.perf_counter() + time_limit
    server.wait_idle()

    def worker():
        session = requests.Session()
        while True:
            with lock:
                if not queue or time.perf_counter() > deadline:
                    return
                spec = queue.pop()
            try:
                problem = soak_one(session, server.base, server.model_id, spec)
            except Exception as err:
                problem = f"{spec.category}/{spec.kind}: {type(err).__name__}: {err}"[:300]
            with lock:
                counts[spec.category] += 1
                done["count"] += 1
                if problem:
                    failures.append(problem)
                if done["count"] == SOAK_RSS_AFTER:
                    rss_marks["after_first"] = server.memory().get("VmRSS", 0)

    cpu0 = server.cpu()
    with RssSampler(server.proc.pid) as rss:
        start = time.perf_counter()
        threads = [threading.Thread(target=worker) for _ in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - start
    idle = server.wait_idle(15)
    health = server.health()
    rss_end = server.memory().get("VmRSS", 0)
    rss_first = rss_marks.get("after_first")
    growth = None if not rss_first else (rss_end - rss_first) / rss_first
    sent = done["count"]
    checks = {
        "every_request_sent": sent == n,
        "good_answered_in_full": not [f for f in failures if f.startswith("good")],
        "bad_got_400": not [f for f in failures if f.startswith("bad")],
        "abandoned_streams_opened": not [f for f in failures if f.startswith("abandon")],
        "health_ok_and_idle_at_end": bool(health and health.get("status") == "ok" and idle),
        "no_traceback_in_server_log": server.tracebacks() == 0,
        f"rss_growth_within_{int(100 * SOAK_RSS_GROWTH)}pct": growth is not None and growth <= SOAK_RSS_GROWTH,
    }
    return {"requests": n, "sent": sent, "time_limit_s": time_limit, "wall_s": round(wall, 1), "clients": clients,
            "by_category": counts, "failures": len(failures), "failure_examples": failures[:8],
            "requests_per_s": round(sent / wall, 2), "server_cpu_pct": round(100 * (server.cpu() - cpu0) / wall, 1),
            "rss_after_first_mb": round((rss_first or 0) / MB), "rss_end_mb": round(rss_end / MB),
            "rss_peak_mb": round(rss.peak / MB), "rss_growth_pct": None if growth is None else round(100 * growth, 2),
            "health_end": health, "checks": checks, "passed": all(checks.values())}
