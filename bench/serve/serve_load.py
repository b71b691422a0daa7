"""The load of bench/serve/serve.py: S concurrent streams of OpenAI clients, each sending its requests one after
another (a fixed mix of SPO completions and chats), timed chunk by chunk; a configuration's figures (tok/s,
TTFT, inter-token gaps, TPOT, engine steps, CPU, RSS). serve.py's docstring says what each figure is.
"""

from __future__ import annotations

import concurrent.futures
import json
import resource
import threading
import time
from dataclasses import dataclass, field

from bench.serve.serve_servers import MB, ROOT, RssSampler, Server, busy_cpu_seconds, self_cpu_seconds

DEV = ROOT / "data" / "spo_dev.jsonl"


# A chat's answer held to this schema (`--schema`): its strings unbounded, so that a random model's answer runs to its
# max_tokens as an unconstrained one does, and the two cost the same tokens
SCHEMA = {"type": "json_schema", "json_schema": {"name": "Triple", "schema": {
    "type": "object", "properties": {"subject": {"type": "string"}, "relation": {"type": "string"},
                                     "object": {"type": "string"}},
    "required": ["subject", "relation", "object"], "additionalProperties": False}}}


@dataclass(frozen=True)
class Spec:
    kind: str  # "chat" or "completion"
    text: str
    max_tokens: int
    response_format: dict | None = None  # a chat's (`SCHEMA`)


@dataclass
class Outcome:
    ok: bool
    tokens: int = 0
    seconds: float = 0.0
    ttft: float | None = None
    gaps: list = field(default_factory=list)
    chunks: int = 0
    finish: str | None = None
    prompt_tokens: int = 0
    usage: bool = False
    error: str | None = None
    last: float | None = None  # request sent -> last text chunk
    first_of_stream: bool = False  # its stream's first request (all streams send theirs at once)

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first text: (last text - first text) / (tokens - 1)."""
        if self.ttft is None or self.last is None or self.tokens < 2:
            return None
        return (self.last - self.ttft) / (self.tokens - 1)


def dev_texts() -> list[str]:
    return [json.loads(line)["text"] for line in DEV.read_text(encoding="utf-8").splitlines()]


def chat_content(text: str) -> str:
    return f"请从下面这段话中抽取实体和它们的关系：{text}"


def workload(streams: int, per_stream: int, mix: list[int], texts: list[str], *, chats: bool = False,
             response_format: dict | None = None) -> list[list[Spec]]:
    """Each stream's requests, in order (request k of the run: completion when k is even, chat when odd, or every one
    a chat with `chats`, asking `response_format`; max_tokens mix[k % len(mix)]; text k % len(texts))."""
    out = []
    for s in range(streams):
        specs = []
        for i in range(per_stream):
            k = s * per_stream + i
            kind = "chat" if chats or k % 2 else "completion"
            specs.append(Spec(kind, texts[k % len(texts)], mix[k % len(mix)],
                              response_format if kind == "chat" else None))
        out.append(specs)
    return out


def openai_client(server: Server):
    import openai

    return openai.OpenAI(base_url=f"{server.base}/v1", api_key="x", max_retries=0, timeout=1800)


def stream_one(client, server: Server, spec: Spec) -> Outcome:
    """One streamed request to `server` through the openai client, timed chunk by chunk."""
    kw = dict(model=server.model_id, max_tokens=spec.max_tokens, temperature=0, stream=True,
              stream_options={"include_usage": True},
              **({"extra_body": server.extra_body} if server.extra_body else {}))
    start = time.perf_counter()
    out = Outcome(ok=False)
    last = None
    try:
        if spec.kind == "chat":
            stream = client.chat.completions.create(messages=[{"role": "user", "content": chat_content(spec.text)}],
                                                    **kw, **({"response_format": spec.response_format}
                                                             if spec.response_format else {}))
        else:
            stream = client.completions.create(prompt=server.prompt_of(spec.text), **kw)
        with stream:
            for chunk in stream:
                now = time.perf_counter()
                if getattr(chunk, "usage", None):
                    out.usage, out.tokens = True, chunk.usage.completion_tokens
                    out.prompt_tokens = chunk.usage.prompt_tokens
                for choice in chunk.choices:
                    text = choice.delta.content if spec.kind == "chat" else choice.text
                    if text:
                        out.chunks += 1
                        if out.ttft is None:
                            out.ttft = now - start
                        else:
                            out.gaps.append(now - last)
                        last = now
                    if choice.finish_reason:
                        out.finish = choice.finish_reason
    except Exception as err:  # the run goes on; the table counts it
        out.error = f"{type(err).__name__}: {err}"[:300]
    out.seconds = time.perf_counter() - start
    out.last = None if last is None else last - start
    if not out.usage:
        out.tokens = out.chunks  # a server without usage chunks (llama.cpp may send none): chunks ~ tokens
    out.ok = out.error is None and out.finish is not None
    return out


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    pos = (len(values) - 1) * q / 100
    lo, hi = int(pos), min(int(pos) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


def ms(value: float | None) -> float | None:
    return None if value is None else round(1000 * value, 1)


def run_config(server: Server, streams: int, specs: list[list[Spec]]) -> dict:
    """Every stream's requests, concurrently; the configuration's figures."""
    clients = [openai_client(server) for _ in range(streams)]
    server.wait_idle()
    h0, cpu0, self0 = server.health(), server.cpu(), resource.getrusage(resource.RUSAGE_SELF)
    busy0, mine0 = busy_cpu_seconds(), self_cpu_seconds()
    outcomes: list[Outcome] = []
    lock = threading.Lock()

    def one_stream(s: int):
        for i, spec in enumerate(specs[s]):
            o = stream_one(clients[s], server, spec)
            o.first_of_stream = i == 0
            with lock:
                outcomes.append(o)

    with RssSampler(server.proc.pid) as rss:
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(streams) as pool:
            list(pool.map(one_stream, range(streams)))
        wall = time.perf_counter() - start
    h1, cpu1, self1 = server.health(), server.cpu(), resource.getrusage(resource.RUSAGE_SELF)
    others = busy_cpu_seconds() - busy0 - (self_cpu_seconds() - mine0) - (cpu1 - cpu0)
    for c in clients:
        c.close()
    good = [o for o in outcomes if o.ok]
    tokens = sum(o.tokens for o in good)
    ttfts = [o.ttft for o in good if o.ttft is not None]
    later = [o.ttft for o in good if o.ttft is not None and not o.first_of_stream]
    gaps = [g for o in good for g in o.gaps]
    tpots = [o.tpot for o in good if o.tpot is not None]
    chunks = sum(o.chunks for o in good)
    row = {"server": server.name, "streams": streams, "requests": len(outcomes), "failed": len(outcomes) - len(good),
           "errors": sorted({o.error for o in outcomes if o.error})[:3], "tokens": tokens,
           "prompt_tokens": sum(o.prompt_tokens for o in good), "wall_s": round(wall, 2),
           "tokens_per_s": round(tokens / wall, 2), "requests_per_s": round(len(good) / wall, 3),
           "ttft_p50_ms": ms(percentile(ttfts, 50)), "ttft_p95_ms": ms(percentile(ttfts, 95)),
           "ttft_p95_later_ms": ms(percentile(later, 95)),
           "itl_p50_ms": ms(percentile(gaps, 50)), "itl_p95_ms": ms(percentile(gaps, 95)),
           "tpot_p50_ms": ms(percentile(tpots, 50)), "tpot_p95_ms": ms(percentile(tpots, 95)),
           "chunks_per_token": round(chunks / tokens, 3) if tokens else None,
           "finish": {f: sum(o.finish == f for o in good) for f in sorted({o.finish for o in good})},
           "server_cpu_pct": round(100 * (cpu1 - cpu0) / wall, 1),
           "client_cpu_pct": round(100 * (self1.ru_utime + self1.ru_stime - self0.ru_utime - self0.ru_stime) / wall, 1),
           "peak_rss_mb": round(rss.peak / MB), "vmhwm_mb": round(server.memory().get("VmHWM", 0) / MB),
           "others_cpu_pct": round(max(0.0, 100 * others / wall), 1)}
    if h0 is not None and h1 is not None:
        steps = h1["steps"] - h0["steps"]
        row.update(steps=steps, steps_per_s=round(steps / wall, 2),
                   rows_per_step=round((tokens - len(good)) / steps, 2) if steps else None,
                   ms_per_step=round(1000 * wall / steps, 1) if steps else None)
    return row


def warm_up(server: Server, texts: list[str], schema: bool = False) -> None:
    client = openai_client(server)
    for spec in (Spec("completion", texts[0], 4), Spec("chat", texts[0], 4), *([Spec("chat", texts[0], 4, SCHEMA)]
                                                                                 if schema else [])):
        o = stream_one(client, server, spec)
        if not o.ok:
            raise RuntimeError(f"{server.name}: the warm-up {spec.kind} request failed: {o.error}\n{server.log_tail()}")
    client.close()
