"""Tool calling learnt end to end by a tiny model: trained on the synthetic tool set, scored by infer.py, asked
through serve.py with the official openai client, and its GGUF export's chat template rendered by llama.cpp.

For each version (ChatGLM3-6B on `data/tools_{train,dev}.jsonl`, ChatGLM3's tools + conversations; GLM-4-9B on
`data/tools_glm4_{train,dev}.jsonl`, GLM-4's messages; `--versions glm4-0414` too: GLM-4's messages in its own chat
template's form; `--versions glm4-moe glm47-flash`: GLM-4.5 and GLM-4.7-Flash on `data/tools_agent_{train,dev}.jsonl`,
OpenAI-style messages that reason, then call, then answer from the result), from scratch in a work directory:
1. `train.py --model tiny-<version> --tuning full` on the train file, the dev file evaluated every `--eval-every`
   steps (metrics.jsonl: the first step whose dev tool-call exact match reached the target); the versions train at
   once, a thread each;
2. `infer.py` over the dev file: the tool-call exact match (right tool, equal arguments) of the saved model;
3. `serve.py` on the run, each dev conversation sent by the `openai` client as OpenAI sends it (the tools as
   `{"type": "function", "function": ...}`, `temperature=0`): the share of replies whose `tool_calls` hold the gold
   call, and the share whose call is the one infer.py read for that record (the same prompt, the same answer);
   for the agent GLMs also streamed (the share whose streamed call is the whole reply's), the share of replies with
   `reasoning_content`, and each call's conversation continued with a tool result sent back (the share answered in
   text);
4. where llama.cpp's `llama-server` is built (`--llama-server PATH` or $LLAMA_SERVER; the recipe in
   bench/serve/serve_servers.py), the run exported as an f16 GGUF by export.py, and for each dev conversation
   (OpenAI form) `/apply-template` then `/tokenize` with special tokens parsed: the share whose ids equal the
   toolkit's prompt ids for that record (what infer.py and serve.py feed the model); for the agent GLMs also
   llama-server's own greedy replies, its parser's calls against the gold ones and serve.py's.
Target: exact match >= 0.9 (infer.py and served) for both versions. The last line is JSON.

    python bench/training/tools.py [--versions chatglm3 glm4] [--max-steps 3000] [--results bench/results/tools.json]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # the repository: chatglm_tune, bench.<room>.<module>

from bench.common.measure import run_python  # noqa: E402
from bench.serve.serve_servers import Server, find_llama_server, free_port, toolkit_server  # noqa: E402

TARGET = 0.9
DATA = {"chatglm3": ("data/tools_train.jsonl", "data/tools_dev.jsonl"),
        "glm4": ("data/tools_glm4_train.jsonl", "data/tools_glm4_dev.jsonl"),
        "glm4-0414": ("data/tools_glm4_train.jsonl", "data/tools_glm4_dev.jsonl"),  # GLM-4's records and form
        # the agent GLMs on OpenAI-style records with thinking (`make_tools.py --form agent`): GLM-4.5, GLM-4.7-Flash
        "glm4-moe": ("data/tools_agent_train.jsonl", "data/tools_agent_dev.jsonl"),
        "glm47-flash": ("data/tools_agent_train.jsonl", "data/tools_agent_dev.jsonl")}
DEFAULT_VERSIONS = ["chatglm3", "glm4"]
AGENT_VERSIONS = ("glm4-moe", "glm47-flash")  # thinking models: served whole, streamed, and continued after a result
# a conversation of the set is under 700 tokens of the tiny tokenizers (~400 with the tools' JSON in word pieces)
# no early stopping: the dev exact match sits near 0 for the first ~1000 steps, until the model copies arguments;
# 3 layers: the 2-layer tiny ChatGLM3 plateaued at 0.76-0.79 (the first character of a name whose second is shared
# by another: 东京 -> 南京), the 3-layer one reached 0.96 at 2000 steps and 1.00 at 2500
TINY_LAYERS = 3
TRAIN_FLAGS = ["--tuning", "full", "--tiny-layers", str(TINY_LAYERS), "--max-src-len", "700", "--max-len", "800",
               "--patience", "0"]


def openai_request(raw: dict) -> tuple[list[dict], list[dict], dict]:
    """(messages, tools, gold call {"name", "arguments"}) of a dev record whose last turn is the gold call, in the
    form an OpenAI client sends: ChatGLM3's `tools` wrapped as functions, GLM-4's system tools as they are."""
    if "tools" in raw and "messages" in raw:  # OpenAI-style: the gold call is the last message's first tool call
        *context, last = raw["messages"]
        function = last["tool_calls"][0]["function"]
        return _plain(context), raw["tools"], {"name": function["name"], "arguments": function["arguments"]}
    if "conversations" in raw:
        *context, last = raw["conversations"]
        tools = [{"type": "function", "function": tool} for tool in raw["tools"]]
        return _plain(context), tools, {"name": last["name"], "arguments": last["parameters"]}
    system, *context, last = raw["messages"]
    return _plain(context), system["tools"], {"name": last["metadata"], "arguments": json.loads(last["content"])}


def _plain(turns: list[dict]) -> list[dict]:
    if any(turn["role"] not in ("system", "user", "assistant") for turn in turns):
        raise SystemExit("bench/training/tools.py: a dev conversation holds calls before its gold one; the bench "
                         "sends user, system and assistant text turns only")
    return [{"role": turn["role"], "content": turn["content"]} for turn in turns]


def first_step_reaching(metrics: Path, target: float) -> int | None:
    for line in metrics.read_text(encoding="utf-8").splitlines():
        entry = json.loads(line)
        calls = entry.get("eval", {}).get("tool_calls")
        if calls and calls["exact_match"] >= target:
            return entry["step"]
    return None


def served_calls(run: Path, requests: list, work: Path) -> list[dict | None]:
    """The call of serve.py's reply to each request (None for a text reply), by the openai client."""
    import openai

    server = toolkit_server("serve", run, threads=2, max_batch=8, extra=[], log_dir=work)
    server.start(timeout=300)
    try:
        client = openai.OpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0, timeout=120)
        calls = []
        for messages, tools, _ in requests:
            reply = client.chat.completions.create(model=server.model_id, messages=messages, tools=tools,
                                                   temperature=0, max_tokens=100).choices[0].message
            function = reply.tool_calls[0].function if reply.tool_calls else None
            calls.append(None if function is None
                         else {"name": function.name, "arguments": json.loads(function.arguments)})
        return calls
    finally:
        server.stop()


def _call_of(tool_calls) -> dict | None:
    function = tool_calls[0].function if tool_calls else None
    return None if function is None else {"name": function.name, "arguments": json.loads(function.arguments)}


def _result(tool_calls) -> str:
    """What the shipped set's tool returns for a call (`make_tools.result_of`), as a tool message's content."""
    from data.make_tools import result_of

    call = _call_of(tool_calls)
    return json.dumps(result_of(call["name"], call["arguments"], random.Random(0))[0], ensure_ascii=False)


def served_agent(run: Path, requests: list, work: Path) -> dict:
    """For a thinking model (the agent GLMs), each request asked three ways through the openai client: whole, streamed
    (its `reasoning_content`, `content` and `tool_calls` deltas joined), and, where the whole reply calls a tool, that
    call and a result sent back (the reply then an answer in text). The shares of: streamed calls equal to the whole
    reply's, replies with reasoning, continued conversations answered in text (not calling again). The call goes back
    with its `reasoning_content` (the templates keep the reasoning of the turns after the last user message, as the
    model was trained), the result with it what the shipped set's tool returns for that call
    (`make_tools.result_of`)."""
    import openai

    server = toolkit_server("serve-agent", run, threads=2, max_batch=8, extra=[], log_dir=work)
    server.start(timeout=300)
    same = reasoned = continued = called = 0
    try:
        client = openai.OpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0, timeout=120)
        for messages, tools, _ in requests:
            ask = dict(model=server.model_id, tools=tools, temperature=0, max_tokens=100)
            whole = client.chat.completions.create(messages=messages, **ask).choices[0].message
            reasoned += bool(getattr(whole, "reasoning_content", None))
            streamed = [delta.tool_calls or [] for chunk in client.chat.completions.create(
                messages=messages, stream=True, **ask) for delta in [chunk.choices[0].delta] if chunk.choices]
            same += _call_of([c for calls in streamed for c in calls]) == _call_of(whole.tool_calls)
            if whole.tool_calls:
                called += 1
                back = [*messages, {"role": "assistant", "content": whole.content, "tool_calls": [
                    c.model_dump() for c in whole.tool_calls], "reasoning_content": whole.reasoning_content},
                    {"role": "tool", "tool_call_id": whole.tool_calls[0].id, "content": _result(whole.tool_calls)}]
                answer = client.chat.completions.create(messages=back, **ask).choices[0]
                continued += answer.finish_reason == "stop" and bool(answer.message.content)
        n = len(requests)
        return {"streamed_same_as_whole": same / n, "with_reasoning": reasoned / n,
                "continued_in_text": continued / max(called, 1)}
    finally:
        server.stop()


def llama_checks(binary: Path, run: Path, requests: list, dev: Path, work: Path, served: list) -> dict:
    """llama.cpp's `llama-server --jinja` on the f16 GGUF export: the share of dev conversations whose ids, rendered by
    its `/apply-template` from the export's chat template and tokenized by its `/tokenize`, equal the toolkit's prompt
    ids for the record; for the agent GLMs (their thinking prompt asked by `reasoning_effort`, as llama-server takes
    it) also its own greedy replies' calls, read by its parser: the share equal to the gold call, and to serve.py's."""
    from chatglm_tune.data.records import read_records
    from chatglm_tune.options import EncodingOptions
    from chatglm_tune.runs import loading

    out = work / f"gguf-{run.name}"  # one export a version
    run_python("export.py", run, out, "--format", "gguf", "--type", "f16", "--name", "tools")
    gguf = next(out.glob("*.gguf"))
    port = free_port()
    server = Server("llama-server", [str(binary), "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port),
                                     "--jinja", "--threads", "2", "--no-webui"], {}, work / "llama-server.log",
                    engine_stats=False)
    try:
        server.start(timeout=120)
    except RuntimeError as err:  # llama.cpp could not run the file: its log's GGML_ASSERT line says why
        log = (work / "llama-server.log").read_text(errors="replace").splitlines()
        why = next((line for line in log if "GGML_ASSERT" in line), str(err).splitlines()[0])
        return {"llama_prompt_ids_equal": None, "llama_error": why.strip()}
    agent = run.name in AGENT_VERSIONS
    asked = {"reasoning_effort": "high"} if agent else {}
    try:
        tokenizer = loading.load_run(loading.resolve_run(run))[1]
        records, _ = read_records(dev)
        same, calls = 0, []
        for record, (messages, tools, _) in zip(records, requests):
            text = _post(server, "/apply-template", {"messages": messages, "tools": tools, **asked})["prompt"]
            ids = _post(server, "/tokenize", {"content": text, "add_special": False, "parse_special": True})["tokens"]
            same += ids == tokenizer.prompt_format.prompt_ids(tokenizer, record, EncodingOptions(prompt=""))[0]
            if agent:
                reply = _post(server, "/v1/chat/completions", {"messages": messages, "tools": tools, "temperature": 0,
                                                                "max_tokens": 100, **asked})["choices"][0]["message"]
                function = (reply.get("tool_calls") or [{}])[0].get("function")
                calls.append(function and {"name": function["name"], "arguments": json.loads(function["arguments"])})
        result = {"llama_prompt_ids_equal": same / len(records)}
        if agent:
            result["llama_calls_exact_match"] = sum(c == gold for c, (_, _, gold) in zip(calls, requests)) / len(calls)
            result["llama_calls_same_as_served"] = sum(c == s for c, s in zip(calls, served)) / len(calls)
        return result
    finally:
        server.stop()


def _post(server: Server, path: str, body: dict) -> dict:
    import urllib.request

    request = urllib.request.Request(server.base + path, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as r:
        return json.loads(r.read())


def finished_run_seconds(run: Path) -> float | None:
    """The training seconds a finished train.py run in `run` recorded (metrics.jsonl's final entry), else None."""
    metrics = run / "metrics.jsonl"
    lines = metrics.read_text(encoding="utf-8").splitlines() if metrics.is_file() else []
    final = json.loads(lines[-1]).get("final") if lines else None
    return None if final is None else final["seconds"]


def train_all(versions: list[str], args, work: Path) -> dict[str, float]:
    """Train every version at once, one thread each (two 1-thread processes outrun two 2-thread ones taking
    turns on 2 cores): the wall seconds of each run. With `--reuse`, a finished run in the work directory is
    measured as it is (its own recorded training seconds)."""
    done = {v: finished_run_seconds(work / v) for v in versions} if args.reuse else {}
    versions = [v for v in versions if done.get(v) is None]
    if not versions:
        return done
    with ThreadPoolExecutor(len(versions)) as pool:
        runs = {v: pool.submit(run_python, "train.py", "--model", f"tiny-{v}", "--train-file", REPO / DATA[v][0],
                               "--dev-file", REPO / DATA[v][1], *TRAIN_FLAGS, "--max-steps", args.max_steps,
                               "--eval-every", args.eval_every, "--threads", 1, "--output-dir", work / v)
                for v in versions}
        return {**done, **{v: run.result().seconds for v, run in runs.items()}}


def measure(version: str, train_s: float, args, work: Path) -> dict:
    dev, run = REPO / DATA[version][1], work / version
    rows_path = work / f"{version}-dev.jsonl"
    summary_path = rows_path.with_name(rows_path.name + ".summary.json")
    for scratch in (rows_path, summary_path):  # an earlier measure's (--reuse)
        scratch.unlink(missing_ok=True)
    run_python("infer.py", "--model", run, "--input", dev, "--output", rows_path)
    summary = json.loads(summary_path.read_text(encoding="utf-8"))
    rows = [json.loads(line) for line in rows_path.read_text(encoding="utf-8").splitlines()]
    requests = [openai_request(json.loads(line)) for line in dev.read_text(encoding="utf-8").splitlines()]
    served = served_calls(run, requests, work)
    base = json.loads((run / "run_args.json").read_text(encoding="utf-8"))["model"]
    final = json.loads((run / "metrics.jsonl").read_text(encoding="utf-8").splitlines()[-1])["final"]
    result = {"train_s": round(train_s, 1), "layers": TINY_LAYERS, "steps": final["step"],
              **({} if base.startswith("tiny") else {"trained_from": base}),  # a run continued from another (--reuse)
              "first_step_at_target": first_step_reaching(run / "metrics.jsonl", TARGET),
              "infer_exact_match": summary["scores"]["tool_calls"]["exact_match"],
              "served_exact_match": sum(s == gold for s, (_, _, gold) in zip(served, requests)) / len(requests),
              "served_same_as_infer": sum(s == r["tool_call"] for s, r in zip(served, rows)) / len(rows)}
    if version in AGENT_VERSIONS:
        result.update(served_agent(run, requests, work))
    binary = find_llama_server(args.llama_server)
    result.update({"llama_prompt_ids_equal": None} if binary is None
                  else llama_checks(binary, run, requests, dev, work, served))
    return result


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--versions", nargs="+", choices=sorted(DATA), default=DEFAULT_VERSIONS)
    p.add_argument("--max-steps", type=int, default=3000, help="training steps of each tiny model")
    p.add_argument("--eval-every", type=int, default=250, help="steps between dev evaluations")
    p.add_argument("--llama-server", type=Path, help="llama.cpp's llama-server binary (default: $LLAMA_SERVER, PATH)")
    p.add_argument("--work-dir", type=Path, help="where the runs go (default: a new temporary directory)")
    p.add_argument("--reuse", action="store_true", help="measure the finished runs already in --work-dir instead of "
                   "training them again (e.g. once llama-server is built)")
    p.add_argument("--results", type=Path, help="also write the closing JSON here (e.g. bench/results/tools.json)")
    args = p.parse_args(argv)
    work = (args.work_dir or Path(tempfile.mkdtemp(prefix="chatglm_tune_tools_"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    trained = train_all(args.versions, args, work)
    results = {version: measure(version, trained[version], args, work) for version in args.versions}
    print(f"\n{'version':9s} {'train s':>8s} {'at 0.9':>7s} {'infer EM':>9s} {'served EM':>10s} {'=infer':>7s} "
          f"{'llama ids':>10s}")
    for version, r in results.items():
        llama = "n/a" if r["llama_prompt_ids_equal"] is None else f"{r['llama_prompt_ids_equal']:.2f}"
        print(f"{version:9s} {r['train_s']:8.1f} {str(r['first_step_at_target']):>7s} {r['infer_exact_match']:9.2f} "
              f"{r['served_exact_match']:10.2f} {r['served_same_as_infer']:7.2f} {llama:>10s}")
    for version, r in results.items():
        if "streamed_same_as_whole" in r:
            print(f"{version}: streamed call = whole {r['streamed_same_as_whole']:.2f}, with reasoning_content "
                  f"{r['with_reasoning']:.2f}, continued after the result in text {r['continued_in_text']:.2f}")
    met = all(min(r["infer_exact_match"], r["served_exact_match"]) >= TARGET for r in results.values())
    print(f"target: tool-call exact match >= {TARGET} by infer.py and served: {'met' if met else 'missed'}")
    line = json.dumps({"tools": {**results, "target": TARGET, "met": met}}, ensure_ascii=False)
    if args.results:
        args.results.write_text(line + "\n", encoding="utf-8")
    print(line)


if __name__ == "__main__":
    main()
