"""Tool-call accuracy: the call each version reads from an answer, scored against a conversation's gold call
(right tool, equal arguments), in infer.py's rows and summary and in training's dev scores."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from chatglm_tune.data.dialogues import ToolCall
from chatglm_tune.data.records import read_records
from chatglm_tune.evaluation.callmetrics import score_calls
from chatglm_tune.evaluation.extraction import format_summary, make_row, summarize
from chatglm_tune.evaluation.metrics import format_score, score_answers
from chatglm_tune.models import registry
from chatglm_tune.models.glm.formats import CHATGLM2, CHATGLM3, GLM4, GLM4_0414, GLM_EDGE

WEATHER = ToolCall("get_weather", {"city": "北京"})


def test_each_version_reads_the_calls_it_writes():
    assert CHATGLM3.read_call("get_weather\n```python\ntool_call(city='北京')\n```") == WEATHER
    assert CHATGLM3.read_call(CHATGLM3.tool_arguments({"amount": 100, "to": "美元"}).join(["f\n", ""])) == \
        ToolCall("f", {"amount": 100, "to": "美元"})
    for version in (GLM4, GLM4_0414):  # GLM-4-0414: its template's call, the name as metadata, JSON arguments
        assert version.read_call('get_weather\n{"city": "北京"}') == WEATHER
    for version in (CHATGLM3, GLM4, GLM4_0414):  # the JSON form of GLM-4's fine-tuning README
        assert version.read_call('{"name": "get_weather", "arguments": {"city": "北京"}}') == WEATHER
    for text in ("北京今天晴。", "北京\n今天晴。", "get_weather\n", "get_weather\ntool_call(city=北京)",
                 '\n{"city": "北京"}'):
        assert all(version.read_call(text) is None for version in (CHATGLM3, GLM4, GLM4_0414)), text
    for version in (CHATGLM2, GLM_EDGE):  # no tool calls in their chat
        assert version.read_call('get_weather\n{"city": "北京"}') is None


def _records(tmp_path, rows: list[dict]):
    path = tmp_path / "dev.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return read_records(path)[0]


TOOLS = [{"name": "get_weather", "description": "天气", "parameters": {"city": "城市"}},
         {"name": "get_time", "description": "时间", "parameters": {"city": "城市"}}]


def _call_record(tool: str, city: str) -> dict:
    return {"tools": TOOLS, "conversations": [{"role": "user", "content": f"{city}?"},
                                             {"role": "tool", "name": tool, "parameters": {"city": city}}]}


def test_exact_match_needs_the_right_tool_and_equal_arguments(tmp_path):
    records = _records(tmp_path, [_call_record("get_weather", "北京"), _call_record("get_time", "上海"),
                                  _call_record("get_weather", "广州"), _call_record("get_time", "东京"),
                                  {"tools": TOOLS, "conversations": [{"role": "user", "content": "你好"},
                                                                     {"role": "assistant", "content": "你好！"}]}])
    predicted = [WEATHER, ToolCall("get_time", {"city": "北京"}), None, ToolCall("get_time", {"city": "东京"}),
                 ToolCall("get_time", {"city": "东京"})]
    scores = score_calls(predicted, records)
    assert scores == {"calls": 4, "exact_match": 0.5, "right_tool": 0.75, "text_for_call": 1, "call_for_text": 1}
    assert score_calls([None], records[-1:]) is None  # no gold call: nothing to score
    both = score_answers(["a"] * 5, records, predicted)
    assert both["tool_calls"] == scores and "rouge-l" in both
    assert both["score"] == both["rouge-l"] / 100  # a text answer among the calls: the best checkpoint by ROUGE-L
    calls_only = score_answers(["a"] * 4, records[:4], predicted[:4])
    assert calls_only["score"] == calls_only["tool_calls"]["exact_match"] == 0.5  # every gold answer a call
    assert format_score(calls_only["score"], records[:4]) == "tool-call exact match 0.5000"  # train.py's last line
    assert format_score(both["score"], records).startswith("rouge-l ")
    assert score_answers(["a"] * 5, records)["tool_calls"]["text_for_call"] == 4  # no calls read: all text


def test_infer_rows_and_summary_carry_the_call(tmp_path):
    """make_row reads the call from the generated ids; the summary scores the rows' calls (resumed ones too:
    from the rows as written)."""
    _, tok = registry.VERSIONS["chatglm3"].tiny(["北京?上海?天气时间城市"], tmp_path / "tok")
    records = _records(tmp_path, [_call_record("get_weather", "北京"), _call_record("get_time", "上海")])
    answers = ["get_weather\n```python\ntool_call(city='北京')\n```", "上海现在是10:00。"]
    stop = tok.prompt_format.stop_ids(tok)[:1]
    rows = [make_row(i, r, tok, tok.encode(a, add_special_tokens=False) + stop, free_text=True)
            for i, (r, a) in enumerate(zip(records, answers))]
    assert [(row["tool_call"], row["call_match"]) for row in rows] == [(WEATHER.to_json(), True), (None, False)]
    rows = [json.loads(json.dumps(row, ensure_ascii=False)) for row in rows]  # as read back from the output file
    summary = summarize(rows, records, new_rows=2, new_tokens=10, seconds=1.0)
    assert summary["scores"]["tool_calls"]["exact_match"] == 0.5
    assert "tool calls: exact match 0.5000 (right tool 0.5000) of 2" in format_summary(summary)


@pytest.mark.parametrize("tuning, flags", [("ptuning", ["--pre-seq-len", "4"]), ("lora", ["--lora-r", "4"])])
def test_tool_conversations_train_every_method_and_are_scored_in_eval_and_infer(tuning, flags, tmp_path):
    """P-tuning v2 and LoRA (full fine-tuning: bench/training/tools.py) train on the tool set's rows; the dev
    evaluation and infer.py score its calls."""
    import infer as infer_cli
    import train as train_cli
    from serving import tiny_model

    data = Path(__file__).resolve().parents[1] / "data"
    train, dev = tmp_path / "train.jsonl", tmp_path / "dev.jsonl"
    train.write_text("".join((data / "tools_train.jsonl").read_text(encoding="utf-8").splitlines(True)[:4]),
                     encoding="utf-8")
    dev.write_text("".join((data / "tools_dev.jsonl").read_text(encoding="utf-8").splitlines(True)[:2]),
                   encoding="utf-8")
    base, out = tiny_model("chatglm3", tmp_path / "base"), tmp_path / "run"
    assert train_cli.main(["--model", str(base), "--tuning", tuning, *flags, "--train-file", str(train), "--dev-file",
                           str(dev), "--output-dir", str(out), "--max-steps", "2", "--batch-size", "2", "--max-src-len",
                           "700", "--max-len", "800", "--threads", "1"]) == 0
    evals = [json.loads(line)["eval"] for line in (out / "metrics.jsonl").read_text().splitlines() if '"eval"' in line]
    assert evals and all(e["tool_calls"]["calls"] == 2 for e in evals)
    infer_cli.main(["--model", str(out), "--input", str(dev), "--output", str(tmp_path / "o.jsonl"),
                    "--max-new-tokens", "8"])
    rows = [json.loads(line) for line in (tmp_path / "o.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [row["call_match"] for row in rows] == [row["tool_call"] is not None and row["tool_call"] == gold
                                                   for row, gold in zip(rows, _gold_calls(dev))]


def _gold_calls(dev: Path) -> list[dict]:
    return [{"name": turn["name"], "arguments": turn["parameters"]}
            for turn in (json.loads(line)["conversations"][-1]
                         for line in dev.read_text(encoding="utf-8").splitlines())]
