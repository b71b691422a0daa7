"""The report of bench/serve/serve.py: what limits each configuration's figures (the model alone, timed by
serve_children.py floor, and the cores' ceilings), the targets, the printed table and the `.md` beside the results
JSON.
"""

from __future__ import annotations

from bench.serve.serve_servers import MB
from bench.serve.serve_soak import SOAK_RSS_AFTER

TARGET_SPEEDUP = 6.0  # tok/s at 16 streams, batching / one at a time
TARGET_TTFT_RATIO = 3.0  # TTFT p95 at 16 streams / at 1 stream, batching server
TARGET_STREAMS = 16
TARGET_LLAMA_AIM = 1.5  # tok/s at 16 streams, serve.py / llama-server: the aim (the target: >= 1x)
OVERHEAD_SHARE = 0.5  # a configuration whose larger floor is under this share of its wall time is overhead-bound


def step_ms(floor: dict, rows: float) -> float:
    """The model alone's ms per decode step at `rows` rows: linear between the batch sizes it was timed at."""
    points = sorted((int(b), v["ms_per_step"]) for b, v in floor["batches"].items())
    if rows <= points[0][0]:
        return points[0][1]
    for (b0, t0), (b1, t1) in zip(points, points[1:]):
        if rows <= b1:
            return t0 + (t1 - t0) * (rows - b0) / (b1 - b0)
    return points[-1][1] * rows / points[-1][0]


def model_alone_s(floor: dict, row: dict, batching: bool) -> float:
    """Seconds the model alone needs for a configuration's work: its prompt tokens at the measured prefill cost
    per token (4 prompts a forward when batching, else 1) and its decode steps at its rows per step."""
    per_token = floor["prefill_ms_per_token_4x64" if batching else "prefill_ms_per_token_1x64"]
    return (row["prompt_tokens"] * per_token + row["steps"] * step_ms(floor, row["rows_per_step"] or 1)) / 1000


def limits(rows: list[dict], floor: dict | None, ceil: dict | None, weight_bytes: int, params: int) -> list[str]:
    """One line per toolkit row: its wall time against what the model alone needs for the same work (the rest
    is the server's: HTTP, the event loop, scheduling, cache copies), and against two floors of the cores,
    the larger naming the bound: reading the weights once per decode step (steps x weight bytes / the GEMV
    read rate from memory) and the arithmetic (2 x params x (prompt + completion tokens) / the GEMM peak)."""
    if not ceil or not weight_bytes or not params:
        return []
    lines = []
    gemv, peak = ceil["gemv_read_gbs"] * 1e9, ceil["gemm_gflops"]["512"] * 1e9
    for r in rows:
        if not r.get("steps"):
            continue
        rows_step = r["rows_per_step"] or 1
        memory_s = r["steps"] * weight_bytes / gemv
        flops = 2 * params * (r["tokens"] + r["prompt_tokens"])
        compute_s = flops / peak
        bound = "weight reads (memory bandwidth)" if memory_s >= compute_s else "arithmetic (the cores' GEMM rate)"
        floor_s = max(memory_s, compute_s)
        if floor_s < OVERHEAD_SHARE * r["wall_s"]:
            bound = f"neither floor explains half the time (nearer: {bound.split(' (')[0]})"
        r["limit"] = {"memory_floor_s": round(memory_s, 2), "compute_floor_s": round(compute_s, 2), "bound": bound,
                      "of_floor": round(floor_s / r["wall_s"], 2),
                      "weights_gbs": round(r["steps"] * weight_bytes / r["wall_s"] / 1e9, 2),
                      "gflops": round(flops / r["wall_s"] / 1e9, 1)}
        alone = ""
        if floor:
            alone_s = model_alone_s(floor, r, r["server"] != "batch1")
            r["limit"].update(model_alone_s=round(alone_s, 2), model_alone_step_ms=round(step_ms(floor, rows_step), 1),
                              server_share=round(1 - alone_s / r["wall_s"], 2))
            share = 1 - alone_s / r["wall_s"]
            alone = (f"; the model alone needs {alone_s:.1f} s for this work ({step_ms(floor, rows_step):.0f} ms/step "
                     f"at {rows_step:.1f} rows + prefills): the server adds "
                     + (f"{100 * share:.0f}% of the wall" if share >= 0 else "nothing measurable")
                     + (" (the model-alone timing was disturbed: it exceeds the server's wall by over 10%)"
                        if share < -0.1 else ""))
        lines.append(
            f"{r['server']:<8} {r['streams']:>2} streams: wall {r['wall_s']:.1f} s, {r['ms_per_step']:.0f} ms/step at "
            f"{rows_step:.1f} rows{alone}; cores: weights {memory_s:.1f} s ({r['limit']['weights_gbs']:.1f} GB/s of "
            f"{ceil['gemv_read_gbs']}), arithmetic {compute_s:.1f} s ({r['limit']['gflops']:.1f} GFLOP/s of "
            f"{ceil['gemm_gflops']['512']}) -> {bound}; server CPU {r['server_cpu_pct']:.0f}% of a core, "
            f"clients {r['client_cpu_pct']:.0f}%")
    return lines


def reachable_speedup(rows: list[dict], floor: dict | None, batch_name: str) -> dict | None:
    """The tok/s ratio the model alone allows at 16 streams for the same work: the batching row's work at its
    rows per step, against the same work one request at a time (batch-1 steps, one prompt a forward)."""
    b16 = next((r for r in rows if r["server"] == batch_name and r["streams"] == TARGET_STREAMS
                and r.get("steps")), None)
    if not floor or b16 is None:
        return None
    batched = model_alone_s(floor, b16, True)
    decode_rows = b16["tokens"] - (b16["requests"] - b16["failed"])
    single = (b16["prompt_tokens"] * floor["prefill_ms_per_token_1x64"] + decode_rows * step_ms(floor, 1)) / 1000
    return {"batched_s": round(batched, 2), "one_at_a_time_s": round(single, 2), "ratio": round(single / batched, 2)}


HEADER = (f"{'server':<12} {'str':>3} {'req':>4} {'fail':>4} {'tokens':>6} {'wall s':>7} {'tok/s':>7} {'req/s':>6} "
          f"{'TTFT50':>7} {'TTFT95':>7} {'ITL50':>6} {'ITL95':>6} {'TPOT50':>6} {'TPOT95':>6} {'steps/s':>7} "
          f"{'rows/st':>7} {'srvCPU':>6} {'cliCPU':>6} {'other':>5} {'RSS MB':>6}")


def fmt(v, spec=""):
    return "-" if v is None else format(v, spec)


def table_row(r: dict) -> str:
    return (f"{r['server']:<12} {r['streams']:>3} {r['requests']:>4} {r['failed']:>4} {r['tokens']:>6} "
            f"{r['wall_s']:>7.1f} {r['tokens_per_s']:>7.1f} {r['requests_per_s']:>6.2f} "
            f"{fmt(r['ttft_p50_ms'], '.0f'):>7} {fmt(r['ttft_p95_ms'], '.0f'):>7} {fmt(r['itl_p50_ms'], '.0f'):>6} "
            f"{fmt(r['itl_p95_ms'], '.0f'):>6} {fmt(r['tpot_p50_ms'], '.0f'):>6} {fmt(r['tpot_p95_ms'], '.0f'):>6} "
            f"{fmt(r.get('steps_per_s'), '.1f'):>7} {fmt(r.get('rows_per_step'), '.1f'):>7} "
            f"{r['server_cpu_pct']:>6.0f} {r['client_cpu_pct']:>6.0f} {r['others_cpu_pct']:>5.0f} "
            f"{r['peak_rss_mb']:>6}")


def targets(rows: list[dict], batch_name: str, one_name: str, floor: dict | None = None) -> dict:
    def find(server, streams):
        return next((r for r in rows if r["server"] == server and r["streams"] == streams), None)

    out = {}
    b16, o16, b1 = find(batch_name, TARGET_STREAMS), find(one_name, TARGET_STREAMS), find(batch_name, 1)
    if b16 and o16 and o16["tokens_per_s"]:
        ratio = b16["tokens_per_s"] / o16["tokens_per_s"]
        out["speedup_at_16"] = {"value": round(ratio, 2), "target": TARGET_SPEEDUP, "pass": ratio >= TARGET_SPEEDUP,
                                "text": f"tok/s at {TARGET_STREAMS} streams: {b16['tokens_per_s']:.1f} (--max-batch "
                                        f"32) vs {o16['tokens_per_s']:.1f} (--max-batch 1) = {ratio:.2f}x (target >= "
                                        f"{TARGET_SPEEDUP:g}x)"}
    if b16 and b1 and b1["ttft_p95_ms"] and b16["ttft_p95_ms"] is not None:
        ratio = b16["ttft_p95_ms"] / b1["ttft_p95_ms"]
        text = (f"TTFT p95 (--max-batch {b16['server'][5:]}): {b16['ttft_p95_ms']:.0f} ms at {TARGET_STREAMS} streams "
                f"vs {b1['ttft_p95_ms']:.0f} ms at 1 = {ratio:.2f}x (target <= {TARGET_TTFT_RATIO:g}x)")
        entry = {"value": round(ratio, 2), "target": TARGET_TTFT_RATIO, "pass": ratio <= TARGET_TTFT_RATIO}
        if b16.get("ttft_p95_later_ms") is not None:
            later = b16["ttft_p95_later_ms"] / b1["ttft_p95_ms"]
            entry["later_requests"] = round(later, 2)
            text += (f"; without each stream's first request (the {TARGET_STREAMS} sent at once): "
                     f"{b16['ttft_p95_later_ms']:.0f} ms = {later:.2f}x")
        if floor:
            burst_ms = (TARGET_STREAMS * b16["prompt_tokens"] / max(1, b16["requests"])
                        * floor["prefill_ms_per_token_4x64"])
            entry["burst_prefill_ms"] = round(burst_ms)
            text += (f"; prefilling {TARGET_STREAMS} prompts that arrive at once takes the model alone {burst_ms:.0f} "
                     f"ms (= {burst_ms / b1['ttft_p95_ms']:.1f}x the 1-stream p95) before the last one's first token")
        entry["text"] = text
        out["ttft_p95_16_vs_1"] = entry
    out.update(against_llama_server(find(batch_name, TARGET_STREAMS), find("llama-server", TARGET_STREAMS)))
    return out


def against_llama_server(ours: dict | None, theirs: dict | None) -> dict:
    """At TARGET_STREAMS streams: output tok/s >= llama-server's (aim TARGET_LLAMA_AIM x), TTFT p95 no worse, peak
    RSS lower."""
    if not (ours and theirs and theirs["tokens_per_s"] and ours["ttft_p95_ms"] and theirs["ttft_p95_ms"]):
        return {}
    speed = ours["tokens_per_s"] / theirs["tokens_per_s"]
    ttft = ours["ttft_p95_ms"] / theirs["ttft_p95_ms"]
    rss = ours["peak_rss_mb"] / theirs["peak_rss_mb"]
    at = f"at {TARGET_STREAMS} streams"
    return {
        "tok_s_vs_llama_server": {
            "value": round(speed, 2), "target": 1.0, "pass": speed >= 1.0,
            "text": f"tok/s {at}: {ours['tokens_per_s']:.2f} (serve.py) vs {theirs['tokens_per_s']:.2f} (llama-server) "
                    f"= {speed:.2f}x (target >= 1x, aim {TARGET_LLAMA_AIM:g}x)"},
        "ttft_p95_vs_llama_server": {
            "value": round(ttft, 2), "target": 1.0, "pass": ttft <= 1.0,
            "text": f"TTFT p95 {at}: {ours['ttft_p95_ms']:.0f} ms (serve.py) vs {theirs['ttft_p95_ms']:.0f} ms "
                    f"(llama-server) = {ttft:.2f}x (target <= 1x)"},
        "peak_rss_vs_llama_server": {
            "value": round(rss, 2), "target": 1.0, "pass": rss < 1.0,
            "text": f"peak RSS {at}: {ours['peak_rss_mb']} MB (serve.py) vs {theirs['peak_rss_mb']} MB (llama-server) "
                    f"= {rss:.2f}x (target < 1x)"},
    }


def markdown(summary: dict) -> str:
    m = summary["model"]
    size = (f", {m['params'] / 1e6:.0f} M parameters, {m['weight_bytes'] / MB:.0f} MB float32" if m.get("params")
            else "")  # the full-size run times no model alone, which is where these come from
    lines = [f"# serve.py under concurrent OpenAI clients ({'quick' if summary['quick'] else 'full run'})", "",
             f"Generated by `python bench/serve/serve.py {' '.join(summary['argv'])}` (its docstring says what each "
             f"figure is). Model: {m.get('version', '?')} {m.get('size', '')} random weights{size}; "
             f"{summary['threads']} threads; CPU: {summary['cpu']}; {summary['seconds']:.0f} s in all.", "",
             "| server | streams | requests | failed | tokens | wall s | tok/s | req/s | TTFT p50 ms | TTFT p95 ms | "
             "TTFT p95 later ms | ITL p50 ms | ITL p95 ms | TPOT p50 ms | TPOT p95 ms | steps/s | rows/step | server "
             "CPU % | client CPU % | others' CPU % | peak RSS MB |",
             "|" + "---|" * 21]
    for r in summary["results"]:
        lines.append("| " + " | ".join(fmt(v) for v in (
            r["server"], r["streams"], r["requests"], r["failed"], r["tokens"], r["wall_s"], r["tokens_per_s"],
            r["requests_per_s"], r["ttft_p50_ms"], r["ttft_p95_ms"], r["ttft_p95_later_ms"], r["itl_p50_ms"],
            r["itl_p95_ms"], r["tpot_p50_ms"], r["tpot_p95_ms"], r.get("steps_per_s"), r.get("rows_per_step"),
            r["server_cpu_pct"], r["client_cpu_pct"], r["others_cpu_pct"], r["peak_rss_mb"])) + " |")
    lines += ["", "## Targets", ""]
    lines += [f"- {'PASS' if t['pass'] else 'MISS'}: {t['text']}" for t in summary["targets"].values()]
    if summary.get("limits"):
        lines += ["", "## What limits each figure", ""] + [f"- {line}" for line in summary["limits"]]
        if summary.get("floor"):
            fb = summary["floor"]["batches"]
            lines.append("- model alone (`generation.generate`): " + ", ".join(
                f"batch {b}: {v['ms_per_step']} ms/step = {v['tokens_per_s']} tok/s" for b, v in fb.items()))
        if summary.get("ceilings"):
            c = summary["ceilings"]
            lines.append(f"- cores: copy {c['copy_bandwidth_gbs']} GB/s, GEMV read {c['gemv_read_gbs']} GB/s, GEMM "
                         "GFLOP/s by rows " + ", ".join(f"{k}: {v}" for k, v in c["gemm_gflops"].items()))
    for name, note in summary.get("skipped", {}).items():
        lines.append(f"- {name} skipped: {note}")
    s = summary.get("soak")
    if s:
        lines += ["", "## Soak (--max-batch 32)", "",
                  f"{s['sent']}/{s['requests']} requests from {s['clients']} clients in {s['wall_s']} s "
                  f"({s['requests_per_s']} req/s): {s['by_category']}; failures {s['failures']}; RSS after the first "
                  f"{SOAK_RSS_AFTER} {s['rss_after_first_mb']} MB, at the end {s['rss_end_mb']} MB "
                  f"({s['rss_growth_pct']}%), peak {s['rss_peak_mb']} MB: **{'PASS' if s['passed'] else 'FAIL'}**", ""]
        lines += [f"- {'ok' if v else 'FAILED'}: {k}" for k, v in s["checks"].items()]
        lines += [f"- failure: `{f}`" for f in s["failure_examples"]]
    return "\n".join(lines) + "\n"


def tok_s_ratios(rows: list[dict], max_batch: int, plain: str = "", spec: str = "-spec") -> dict[int, float]:
    """Per stream count: the speculative batching server's tok/s over the plain one's (where both ran); or of any
    other pair of row names (`batchN` + the suffixes)."""
    tok_s = {(r["server"], r["streams"]): r["tokens_per_s"] for r in rows}
    plain, spec = f"batch{max_batch}{plain}", f"batch{max_batch}{spec}"
    return {streams: round(tok_s[spec, streams] / tok_s[plain, streams], 3) for (name, streams) in tok_s
            if name == spec and (plain, streams) in tok_s}
