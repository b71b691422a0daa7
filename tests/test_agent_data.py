"""The agent GLMs' training data (GLM-4.5, GLM-4.7, GLM-4.7-Flash): OpenAI-style conversations with tools, several
calls, tool results, several user turns, reasoning on and off, clear_thinking both ways, rendered token for token as
each release's chat template renders them through transformers, and trained exactly where the model writes.

- 50 conversations of our own making (seeded) go through `train.py --dry-run` on each tiny preset (`tiny-glm4-moe`:
  GLM-4.5's template form; `tiny-glm47`: GLM-4.7, GLM-4.5's architecture with GLM-4.7-Flash's template form;
  `tiny-glm47-flash`); a separate Python process that never imports the toolkit renders the same messages with
  transformers' `apply_chat_template` on the dry run's `tokenizer.json`: every row's `input_ids` are those ids and
  the one stop token the row ends with (`<|user|>` after an answer, `<|observation|>` after a call).
- The labels, decoded run by run, are exactly what an oracle written here from the releases' forms says each trained
  assistant turn writes: its kept reasoning and `</think>`, its content, its calls, and the role token after it;
  `--loss-on last` trains the last turn only.
- Bad records stop the dry run naming the file, the line and the field; versions without reasoning or tools refuse
  them saying why.
"""

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from chatglm_tune.data.records import read_records
from chatglm_tune.models.glm.formats import CHATGLM2
from chatglm_tune.models.glm.moe_templates import GLM4_MOE_LITE_TEMPLATE
from chatglm_tune.tuning.training import check_turns
from test_tiny_glm4 import in_process

# GLM-5 / 5.1 / 5.2 write the turns as GLM-4.7 does (5.1 and 5.2 write the tools unwrapped, 5.2 a reasoning-effort
# line first while thinking and `<think></think>` as its empty think block: all outside the trained runs)
PRESETS = {"tiny-glm4-moe": "glm45", "tiny-glm47": "glm47", "tiny-glm47-flash": "glm47", "tiny-glm5": "glm47",
           "tiny-glm51": "glm47", "tiny-glm52": "glm47", "tiny-glm53-flash": "glm53"}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "查天气", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "convert", "description": "换算", "parameters": {
        "type": "object", "properties": {"amount": {"type": "number"}, "to": {"type": "string"},
                                         "exact": {"type": "boolean"}, "extra": {"type": "object"}}}}},
    {"type": "function", "function": {"name": "now", "description": "现在几点", "parameters": {
        "type": "object", "properties": {}}}},
]
WORDS = ["北京", "上海", "天气", "晴", "多云", "美元", "hello world", "好的", "谢谢", "几点了", "Sure, let me check."]


def _text(rng: random.Random, n: int = 3) -> str:
    return "".join(rng.choice(WORDS) for _ in range(rng.randint(1, n)))


def _call(rng: random.Random) -> dict:
    name = rng.choice(["get_weather", "convert", "now"])
    arguments = {"get_weather": {"city": rng.choice(["北京", "上海"]), **({"days": 3} if rng.random() < .5 else {})},
                 "convert": {"amount": rng.choice([100, 2.5]), "to": "美元", "exact": rng.random() < .5,
                             **({"extra": {"a": [1, "x"]}} if rng.random() < .3 else {})},
                 "now": {}}[name]
    written = json.dumps(arguments, ensure_ascii=False) if rng.random() < .3 else arguments  # the API's JSON text
    return {"id": f"c{rng.randint(0, 999)}", "type": "function", "function": {"name": name, "arguments": written}}


def _assistant(rng: random.Random, thinking: bool, calls: list | None) -> dict:
    message = {"role": "assistant", "content": _text(rng) if not calls or rng.random() < .3 else
               rng.choice(["", None])}
    if calls:
        message["tool_calls"] = calls
    if thinking and rng.random() < .8:
        reasoning = _text(rng, 4)
        if rng.random() < .2 and message["content"]:  # the release's own form: reasoning inside <think> in content
            message["content"] = f"<think>{reasoning}</think>{message['content']}"
        else:
            message["reasoning_content"] = reasoning
    if rng.random() < .1:
        message["loss"] = False
    return message


def conversation(rng: random.Random) -> dict:
    """A conversation: an optional system message, 1-3 user turns, each answered directly or after 1-2 rounds of
    1-2 calls and their results; thinking on, off or the record's default; clear_thinking either way or unset."""
    thinking = rng.choice([True, False, None])
    messages = [{"role": "system", "content": _text(rng)}] if rng.random() < .3 else []
    for _ in range(rng.randint(1, 3)):
        messages.append({"role": "user", "content": _text(rng)})
        for _ in range(rng.choice([0, 1, 1, 2])):
            calls = [_call(rng) for _ in range(rng.choice([1, 1, 2]))]
            messages.append(_assistant(rng, thinking is not False, calls))
            for call in calls:
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": _text(rng)})
        messages.append(_assistant(rng, thinking is not False, None))
    record = {"tools": TOOLS, "messages": messages}
    if thinking is not None:
        record["enable_thinking"] = thinking
    clear = rng.choice([True, False, None])
    if clear is not None:
        record["clear_thinking"] = clear
    if not any(m.get("loss", True) for m in messages if m["role"] == "assistant"):
        messages[-1].pop("loss")
    return record


def conversations(form: str, n: int = 50, seed: int = 0) -> list[dict]:
    """`n` conversations; GLM-4.5's form gets no clear_thinking false where earlier turns reason (refused there);
    GLM-5.3-Flash's no enable_thinking false (its template always thinks), and call ids unique in a conversation (its
    template orders a run of results by them)."""
    rng, out = random.Random(seed), []
    while len(out) < n:
        record = conversation(rng)
        if form == "glm45" and record.get("clear_thinking") is False:
            record["clear_thinking"] = True
        if form == "glm53":
            record.pop("enable_thinking", None)
            _number_calls(record["messages"])
        out.append(record)
    return out


def _number_calls(messages: list[dict]) -> None:
    """Each call's id and its result's `tool_call_id` made c0, c1, ... in order."""
    count, ids = 0, []
    for message in messages:
        for call in message.get("tool_calls", ()):
            call["id"], count = f"c{count}", count + 1
            ids.append(call["id"])
        if message["role"] == "tool":
            message["tool_call_id"] = ids.pop(0)


# ----- the reference: transformers alone, in a process of its own -----

REFERENCE = r"""
import json, sys
from transformers import PreTrainedTokenizerFast
job = json.load(open(sys.argv[1], encoding="utf-8"))
tokenizer = PreTrainedTokenizerFast.from_pretrained(job["dir"])
out = []
for item in job["items"]:
    ids = tokenizer.apply_chat_template(item["messages"], tools=item["tools"], tokenize=True, **item["flags"])
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    runs, run = [], []
    for token, label in zip(item["input_ids"], item["labels"]):
        if label != -100:
            run.append(token)
        elif run:
            runs.append(run)
            run = []
    runs += [run] if run else []
    out.append({"ids": ids, "runs": [tokenizer.decode(r) for r in runs], "text": tokenizer.decode(ids),
                "stop": tokenizer.convert_ids_to_tokens(item["input_ids"][-1])})
assert not any(name.startswith("chatglm_tune") for name in sys.modules), "the reference imported the toolkit"
print(json.dumps(out, ensure_ascii=False))
"""


def template_messages(record: dict) -> list[dict]:
    """The record's messages as the template is given them: arguments as objects, null content as "", no loss."""
    out = []
    for message in record["messages"]:
        message = {k: v for k, v in message.items() if k not in ("loss", "tool_call_id")}
        if message.get("content") is None:
            message["content"] = ""
        for call in message.get("tool_calls", ()):
            if isinstance(call["function"]["arguments"], str):
                call["function"]["arguments"] = json.loads(call["function"]["arguments"])
        out.append(message)
    return out


def flags(record: dict) -> dict:
    """The record's thinking flags as the dry run renders them: its own, thinking on where it reasons otherwise."""
    reasons = any(m.get("reasoning_content") or "</think>" in (m.get("content") or "") for m in record["messages"])
    return {"enable_thinking": record.get("enable_thinking", reasons),
            **{name: record[name] for name in ("clear_thinking", "reasoning_effort") if name in record}}


def reference(run: Path, records: list[dict], rows: list[dict], tmp_path: Path) -> list[dict]:
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"dir": str(run), "items": [
        {"messages": template_messages(json.loads(json.dumps(r))), "tools": r["tools"], "flags": flags(r),
         "input_ids": row["input_ids"], "labels": row["labels"]} for r, row in zip(records, rows)]},
        ensure_ascii=False), encoding="utf-8")
    done = subprocess.run([sys.executable, "-c", REFERENCE, str(job)], capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


# ----- the oracle: what each trained assistant turn writes, from the releases' forms -----

def _parts(message: dict) -> tuple[str, str, list]:
    """(reasoning, content, calls) of an assistant message, stripped as the templates strip them."""
    content, reasoning = message.get("content") or "", message.get("reasoning_content") or ""
    if "</think>" in content:
        reasoning, content = content.split("</think>")[0].split("<think>")[-1], content.split("</think>")[-1]
    calls = [(c["function"]["name"], c["function"]["arguments"] if isinstance(c["function"]["arguments"], dict)
              else json.loads(c["function"]["arguments"])) for c in message.get("tool_calls", ())]
    return reasoning.strip(), content.strip(), calls


def _value(v) -> str:
    return v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)


def _written(form: str, reasoning: str, content: str, calls: list, kept: bool, after_user: bool,
             thinking: bool) -> str:
    """The trained text of one assistant turn, less the role token after it."""
    if form in ("glm47", "glm53"):  # GLM-5.3-Flash writes the turns as GLM-4.7 does
        calls_text = "".join(f"<tool_call>{name}" + "".join(f"<arg_key>{k}</arg_key><arg_value>{_value(v)}</arg_value>"
                                                            for k, v in args.items()) + "</tool_call>"
                             for name, args in calls)
        if thinking and kept:
            return f"{reasoning}</think>{content}{calls_text}"
        return ("</think>" if thinking and after_user else "") + content + calls_text
    calls_text = "".join(f"\n<tool_call>{name}\n" + "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{_value(v)}"
                                                            "</arg_value>\n" for k, v in args.items()) + "</tool_call>"
                         for name, args in calls)
    body = (f"\n<think>{reasoning}</think>" if kept else "\n<think></think>") + (f"\n{content}" if content else "")
    return (body if thinking and after_user else body.removeprefix("\n<think></think>")) + calls_text


def expected_runs(record: dict, form: str, loss_on: str = "all") -> list[str]:
    messages, flag = record["messages"], flags(record)
    thinking = flag["enable_thinking"] or form == "glm53"  # GLM-5.3-Flash's template always thinks
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    role_of = {"tool": "<|observation|>", "user": "<|user|>", "assistant": "<|assistant|>", "system": "<|system|>"}
    runs = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant" or not message.get("loss", True) or \
                (loss_on == "last" and i != len(messages) - 1):
            continue
        reasoning, content, calls = _parts(message)
        kept = bool(reasoning) and (i > last_user or (form == "glm47" and flag.get("clear_thinking") is False)
                                    or (form == "glm53" and flag.get("clear_thinking") is not True))
        after = role_of[messages[i + 1]["role"]] if i + 1 < len(messages) else \
            ("<|observation|>" if calls else "<|user|>")
        runs.append(_written(form, reasoning, content, calls, kept, i > last_user, thinking) + after)
    return runs


def dry_run(preset: str, records: list[dict], tmp_path: Path, *flags_) -> tuple[Path, list[dict]]:
    data = tmp_path / f"{preset}.jsonl"
    data.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    out = tmp_path / f"run-{preset}"
    in_process("train.py", "--model", preset, "--train-file", data, "--output-dir", out, "--dry-run",
               "--max-src-len", 2048, "--max-len", 4096, *flags_)
    rows = [json.loads(line) for line in (out / "examples.jsonl").read_text(encoding="utf-8").splitlines()]
    return out, rows


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_fifty_conversations_are_the_templates_ids_trained_where_the_model_writes(preset, tmp_path, capsys):
    form = PRESETS[preset]
    records = conversations(form)
    run, rows = dry_run(preset, records, tmp_path)
    assert "⟦" in capsys.readouterr().out  # the first example printed with its trained spans marked
    assert not (run / "config.json").exists() and not list(run.glob("*.safetensors"))  # no weights
    if preset == "tiny-glm47":  # GLM-4.7 (full): GLM-4.5's architecture, GLM-4.7-Flash's template form
        config = json.loads((run / "tokenizer_config.json").read_text(encoding="utf-8"))
        assert config["chat_template"] == GLM4_MOE_LITE_TEMPLATE
        assert json.loads((run / "dry_run.json").read_text(encoding="utf-8"))["version"] == "GLM-4.7"
    refs = reference(run, records, rows, tmp_path)
    for record, row, ref in zip(records, rows, refs):
        assert row["input_ids"][:-1] == ref["ids"], record
        assert ref["stop"] == ("<|observation|>" if record["messages"][-1].get("tool_calls") else "<|user|>")
        assert ref["runs"] == expected_runs(record, form), record
    covered = {(r.get("enable_thinking"), r.get("clear_thinking"), bool(m.get("tool_calls")), len(
        m.get("tool_calls", ()))) for r in records for m in r["messages"]}
    thinking = {None} if form == "glm53" else {True, False, None}  # GLM-5.3-Flash's template always thinks
    assert {t for t, *_ in covered} == thinking and {n for *_, n in covered} >= {0, 1, 2}


@pytest.mark.parametrize("effort", [None, "high"])
def test_glm52_writes_its_reasoning_effort_line_first_while_thinking_and_never_trains_it(effort, tmp_path):
    """GLM-5.2's template (`tiny-glm52`) writes `<|system|>Reasoning Effort: Max` (or `High` for --reasoning-effort
    high) before the tools where a conversation thinks, nothing where it does not: the rows are transformers' render
    with the same kwarg, the line outside every trained run."""
    records = conversations("glm47", n=12, seed=3)
    run, rows = dry_run("tiny-glm52", records, tmp_path, *(("--reasoning-effort", effort) if effort else ()))
    job = [dict(r, **({"reasoning_effort": effort} if effort else {})) for r in records]
    refs = reference(run, job, rows, tmp_path)
    written = f"Reasoning Effort: {(effort or 'max').capitalize()}"
    for record, row, ref in zip(records, rows, refs):
        assert row["input_ids"][:-1] == ref["ids"]
        assert (written in ref["text"]) == flags(record)["enable_thinking"]
        assert ref["runs"] == expected_runs(record, "glm47") and not any(written in run for run in ref["runs"])
    assert {flags(r)["enable_thinking"] for r in records} == {True, False}


def test_reasoning_effort_is_refused_where_a_template_writes_no_such_line(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps(conversations("glm47", n=1)[0], ensure_ascii=False) + "\n", encoding="utf-8")
    import train
    code = train.main(["--model", "tiny-glm5", "--train-file", str(data), "--output-dir", str(tmp_path / "run"),
                       "--dry-run", "--reasoning-effort", "high"])
    assert code != 0 and "writes no reasoning-effort line" in capsys.readouterr().err


def test_loss_on_last_trains_the_last_turn_only(tmp_path):
    records = conversations("glm47", n=10, seed=1)
    for record in records:
        record["messages"][-1].pop("loss", None)
    run, rows = dry_run("tiny-glm47-flash", records, tmp_path, "--loss-on", "last")
    for record, ref in zip(records, reference(run, records, rows, tmp_path)):
        assert ref["runs"] == expected_runs(record, "glm47", "last")


def test_a_dry_run_is_replaced_by_the_run_after_it_and_refuses_resume(tmp_path, capsys):
    run, _ = dry_run("tiny-glm47-flash", conversations("glm47", n=3), tmp_path)
    assert sorted(p.name for p in run.iterdir()) == ["dry_run.json", "examples.jsonl", "tokenizer.json",
                                                     "tokenizer_config.json"]
    dry_run("tiny-glm47-flash", conversations("glm47", n=3, seed=2), tmp_path)  # the same directory again
    import train

    data = str(tmp_path / "tiny-glm47-flash.jsonl")
    assert train.main(["--model", "tiny-glm47-flash", "--train-file", data, "--output-dir", str(run), "--dry-run",
                       "--resume"]) == 2
    assert "nothing to resume" in capsys.readouterr().err
    in_process("train.py", "--model", "tiny-glm47-flash", "--train-file", data, "--output-dir", run, "--tuning", "full",
               "--max-steps", 1, "--batch-size", 1, "--max-src-len", 1024, "--max-len", 2048, "--threads", 1)
    assert "replacing the dry run's output" in capsys.readouterr().err
    assert (run / "run_args.json").is_file() and not (run / "examples.jsonl").exists()


BAD = [  # (what is wrong, the record's messages change, the field named)
    ("undeclared", lambda m: m[1]["tool_calls"][0]["function"].update(name="nope"),
     "messages[1].tool_calls[0].function.name"),
    ("type", lambda m: m[1]["tool_calls"][0]["function"].update(arguments={"city": 3}),
     "messages[1].tool_calls[0].function.arguments.city"),
    ("required", lambda m: m[1]["tool_calls"][0]["function"].update(arguments={"days": 3}),
     "messages[1].tool_calls[0].function.arguments"),
    ("tool first", lambda m: m.insert(1, {"role": "tool", "content": "x"}), "messages[1].role"),
    ("two results", lambda m: m.insert(3, {"role": "tool", "content": "x"}), "messages[3].role"),
    ("unknown id", lambda m: m[2].update(tool_call_id="zz"), "messages[2].tool_call_id"),
    ("bad json", lambda m: m[1]["tool_calls"][0]["function"].update(arguments="{city"),
     "messages[1].tool_calls[0].function.arguments"),
    ("twice", lambda m: m[3].update(content="<think>a</think>b"), "messages[3].content"),
]


def _good() -> dict:
    return {"tools": TOOLS, "messages": [
        {"role": "user", "content": "北京天气"},
        {"role": "assistant", "reasoning_content": "查", "content": None, "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "北京"}}}]},
        {"role": "tool", "tool_call_id": "a", "content": "晴"},
        {"role": "assistant", "reasoning_content": "答", "content": "晴天"}]}


def _refusal(preset: str, record: dict, tmp_path: Path, capsys, *flags_, alone: bool = False) -> str:
    """train.py --dry-run's error on a file of a good record, then `record` (`alone`: `record` only)."""
    import train

    data = tmp_path / "bad.jsonl"
    data.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in ([] if alone else [_good()]) + [record]),
                    encoding="utf-8")
    status = train.main(["--model", preset, "--train-file", str(data), "--output-dir", str(tmp_path / "out"),
                         "--dry-run", "--max-len", "2048", "--max-src-len", "1024", *flags_])
    assert status == 2 and not (tmp_path / "out").exists()
    return capsys.readouterr().err


@pytest.mark.parametrize("what, change, field", BAD, ids=[b[0] for b in BAD])
def test_a_bad_record_stops_the_dry_run_naming_file_line_and_field(what, change, field, tmp_path, capsys):
    record = _good()
    change(record["messages"])
    err = _refusal("tiny-glm47-flash", record, tmp_path, capsys)
    assert "bad.jsonl, line 2, field" in err and repr(field) in err, err


def test_thinking_flags_that_cannot_render_as_asked_are_refused(tmp_path, capsys):
    off = {**_good(), "enable_thinking": False}
    assert "messages[1].reasoning_content" in _refusal("tiny-glm4-moe", off, tmp_path, capsys)
    assert "messages[1]" in _refusal("tiny-glm47-flash", _good(), tmp_path, capsys, "--no-enable-thinking")
    kept = _good()
    kept["messages"] += [{"role": "user", "content": "谢谢"}, {"role": "assistant", "content": "不客气"}]
    err = _refusal("tiny-glm4-moe", {**kept, "clear_thinking": False}, tmp_path, capsys)
    assert "drops the reasoning" in err and "bad.jsonl:2" in err
    assert "messages[1].reasoning_content" in err


@pytest.mark.parametrize("preset, why", [("tiny", "no reasoning"), ("tiny-chatglm3", "no reasoning"),
                                         ("tiny-glm4", "no reasoning"), ("tiny-glm-edge", "no reasoning")])
def test_versions_without_reasoning_refuse_it_saying_why(preset, why, tmp_path, capsys):
    err = _refusal(preset, _good(), tmp_path, capsys, alone=True)
    assert "bad.jsonl:1" in err and why in err and (preset == "tiny" or "messages[1].reasoning_content" in err), err
    calls_only = _good()
    for message in calls_only["messages"]:
        message.pop("reasoning_content", None)
    err = _refusal(preset, calls_only, tmp_path, capsys, alone=True)
    assert "bad.jsonl:1" in err and "tool" in err and (preset == "tiny" or "messages[1].tool_calls" in err), err


def test_chatglm2_refuses_reasoning_and_tools_saying_why(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(_good(), ensure_ascii=False) + "\n", encoding="utf-8")
    record = read_records(path)[0][0]
    with pytest.raises(ValueError, match="no reasoning"):
        check_turns(CHATGLM2, record)


@pytest.mark.parametrize("preset", ["tiny", "tiny-chatglm3", "tiny-glm4", "tiny-glm4-0414", "tiny-glm-edge",
                                    "tiny-glm4-moe", "tiny-glm47", "tiny-glm47-flash"])
def test_every_version_dry_runs_its_rows_before_any_weight(preset, tmp_path):
    """SPO records on every tiny preset: examples.jsonl holds what the run would train on (each row the encoding
    of its record by the tokenizer the dry run wrote), and nothing else but that tokenizer and the report."""
    from chatglm_tune.data.batches import encode_record
    from chatglm_tune.models import registry
    from chatglm_tune.options import EncodingOptions, TINY_PRESETS

    spo = Path(__file__).resolve().parents[1] / "data" / "spo_dev.jsonl"
    out = tmp_path / "run"
    in_process("train.py", "--model", preset, "--train-file", spo, "--output-dir", out, "--dry-run")
    rows = [json.loads(line) for line in (out / "examples.jsonl").read_text(encoding="utf-8").splitlines()]
    records, _ = read_records(spo)
    tokenizer = registry.VERSIONS[TINY_PRESETS[preset]].load_tokenizer(out)
    for record, row in zip(records, rows):
        example = encode_record(record, tokenizer, EncodingOptions())
        assert (row["input_ids"], row["labels"]) == (list(example.input_ids), list(example.labels))
    assert len(rows) == len(records)
    assert not (out / "config.json").exists() and not list(out.glob("*.safetensors")) and not list(out.glob("*.bin"))


def test_a_killed_dry_run_is_replaced_by_the_next(tmp_path):
    """What a dry run killed half-way leaves (its report saying it was building, a partial tokenizer file) is
    replaced by the same command."""
    out = tmp_path / "run-tiny-glm47-flash"
    out.mkdir()
    (out / "dry_run.json").write_text('{"state": "building"}', encoding="utf-8")
    (out / "tokenizer.json").write_text("{", encoding="utf-8")
    _, rows = dry_run("tiny-glm47-flash", conversations("glm47", n=2), tmp_path)
    assert len(rows) == 2 and json.loads((out / "dry_run.json").read_text(encoding="utf-8"))["train_records"] == 2


def test_an_answer_is_read_back_as_reasoning_content_and_typed_calls():
    """What a thinking model writes, in either form, read back: reasoning, content, several calls typed by the tools'
    schemas (a string parameter stays text), a zero-argument call; `read_calls` gives the calls the metrics compare."""
    from chatglm_tune.models.glm.agent_format import GLM4_MOE, GLM4_MOE_LITE

    answers = {GLM4_MOE: "<think>查两个</think>\n好的\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
                         "<arg_value>100</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>"
                         "\n<tool_call>now\n</tool_call>",
               GLM4_MOE_LITE: "查两个</think>好的<tool_call>get_weather<arg_key>city</arg_key><arg_value>100"
                              "</arg_value><arg_key>days</arg_key><arg_value>3</arg_value></tool_call>"
                              "<tool_call>now</tool_call>"}
    history = [{"role": "system", "content": "", "tools": TOOLS}, {"role": "user", "content": "q"}]
    for prompt_format, answer in answers.items():
        response, messages = prompt_format.chat_response([answer], "q", history)
        assert response == {"name": "get_weather", "parameters": {"city": "100", "days": 3}}
        assert messages[-1] == {"role": "assistant", "content": "好的", "reasoning_content": "查两个", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "100", "days": 3}}},
            {"type": "function", "function": {"name": "now", "arguments": {}}}]}
        calls = prompt_format.read_calls(answer, TOOLS)
        assert [(c.name, c.arguments) for c in calls] == [("get_weather", {"city": "100", "days": 3}), ("now", {})]


def test_infer_prompts_with_the_thinking_asked_and_refuses_it_where_a_version_has_none(tmp_path, capsys):
    """infer.py --enable-thinking / --no-enable-thinking on a tiny GLM-4.7-Flash run extract; the prompts they ask
    for are the template's thinking and non-thinking generation prompts (`<think>` and `</think>` last); a GLM-Edge
    directory refuses the flag before loading anything."""
    import infer
    import torch

    from chatglm_tune.models import registry

    records = conversations("glm47", n=2)
    run, _ = dry_run("tiny-glm47-flash", records, tmp_path)
    data = str(tmp_path / "tiny-glm47-flash.jsonl")
    in_process("train.py", "--model", "tiny-glm47-flash", "--train-file", data, "--output-dir", run, "--tuning", "full",
               "--max-steps", 1, "--batch-size", 1, "--max-src-len", 1024, "--max-len", 2048, "--threads", 1)
    asked = tmp_path / "asked.jsonl"
    asked.write_text(json.dumps({"tools": TOOLS, "messages": [{"role": "user", "content": "北京天气"}]},
                                ensure_ascii=False) + "\n", encoding="utf-8")
    for flag in ("--enable-thinking", "--no-enable-thinking"):
        out = tmp_path / f"{flag}.jsonl"
        infer.main(["--model", str(run), "--input", str(asked), "--output", str(out), "--max-new-tokens", "3", flag])
        assert len(out.read_text(encoding="utf-8").splitlines()) == 1
    from chatglm_tune.data.batches import prompt_ids
    from chatglm_tune.options import EncodingOptions
    from chatglm_tune.runs import loading

    tokenizer = loading.load_run(loading.resolve_run(run))[1]
    record = read_records(asked)[0][0]
    on, off = (prompt_ids(record, tokenizer, EncodingOptions(prompt="", enable_thinking=v)) for v in (True, False))
    assert tokenizer.convert_ids_to_tokens(on[-2:]) == ["<|assistant|>", "<think>"]
    assert tokenizer.convert_ids_to_tokens(off[-2:]) == ["<|assistant|>", "</think>"]
    edge = tmp_path / "edge"
    torch.manual_seed(0)
    model, _ = registry.VERSIONS["glm-edge"].tiny(["北京天气"], edge)
    model.save_pretrained(edge)
    with pytest.raises(SystemExit):
        infer.main(["--model", str(edge), "--text", "北京", "--enable-thinking"])
    assert "GLM-Edge's chat has no thinking" in capsys.readouterr().err
