"""Tests of the data shapes `chatglm_tune.data.records.read_records` accepts: both file layouts whatever the
suffix, bytes that are not UTF-8, conversations records, instruction/input/output records, and the
errors of records that match no shape."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from chatglm_tune.data.records import RecordError, Triple, read_records
from chatglm_tune.evaluation.metrics import score_answers
from chatglm_tune.options import DataColumns

REPO = Path(__file__).resolve().parents[1]
TEXT = "发动机出现异响，水泵漏油。"
ANSWER = "发动机_部件故障_异响\n水泵_部件故障_漏油"
TRIPLES = (Triple("发动机", "部件故障", "异响"), Triple("水泵", "部件故障", "漏油"))
GOOD = {"text": TEXT, "answer": ANSWER}


def lines_of(*items) -> bytes:
    """JSON lines (UTF-8) of the items; bytes items are written as they are."""
    return b"".join((i if isinstance(i, bytes) else json.dumps(i, ensure_ascii=False).encode()) + b"\n" for i in items)


def user(content) -> dict:
    return {"role": "user", "content": content}


def assistant(content) -> dict:
    return {"role": "assistant", "content": content}


# ----------------------------------------------------------------------------------------------
# Layouts: a JSON array or JSON lines, decided by the content


def test_advertisegen_json_file_of_json_lines_reads_like_its_jsonl(tmp_path):
    fixture = REPO / "tests" / "fixtures" / "advertise_small.jsonl"
    (tmp_path / "train.json").write_bytes(fixture.read_bytes())
    columns = DataColumns(prompt="content", response="summary")
    from_json, report = read_records(tmp_path / "train.json", columns=columns)
    from_jsonl, _ = read_records(fixture, columns=columns)
    assert report.total == 0 and len(from_json) == len(from_jsonl) > 2
    assert [(r.text, r.response) for r in from_json] == [(r.text, r.response) for r in from_jsonl]
    assert from_json[1].source == f"{tmp_path / 'train.json'}:2"


def test_a_jsonl_file_holding_an_array_is_read_as_an_array(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text("\n  " + json.dumps([GOOD, GOOD], ensure_ascii=False, indent=2), encoding="utf-8")
    records, _ = read_records(path)
    assert [(r.text, r.triples, r.source) for r in records] == [(TEXT, TRIPLES, f"{path}[0]"),
                                                                (TEXT, TRIPLES, f"{path}[1]")]


def test_errors_in_a_pretty_printed_array_name_index_line_and_field(tmp_path):
    path = tmp_path / "a.json"
    path.write_text(json.dumps([GOOD, GOOD, {"text": TEXT, "answer": "a_b"}], ensure_ascii=False, indent=2),
                    encoding="utf-8")
    with pytest.raises(RecordError) as info:
        read_records(path)
    assert str(info.value).startswith(f"{path}, array index 2 (line 10), field 'answer line 1': ")
    records, report = read_records(path, on_bad_record="skip")
    assert len(records) == 2 and dict(report.counts) == {"bad_triple": 1}


def test_an_array_that_is_not_json_raises_naming_its_line_even_when_skipping(tmp_path):
    path = tmp_path / "a.json"
    path.write_text('[\n {"text": "a"},\n {"text": "b"}\n {"text": "c"}\n]\n', encoding="utf-8")
    with pytest.raises(RecordError,
                       match=r"a\.json, line 4: not valid JSON \(expected ',' or ']' after array item 1\)"):
        read_records(path, on_bad_record="skip")
    path.write_text('[{"text": "a"},]', encoding="utf-8")
    with pytest.raises(RecordError, match=r"a\.json, line 1: not valid JSON \(Expecting value"):
        read_records(path)
    path.write_text(json.dumps([GOOD]) + "\n" + json.dumps([GOOD]) + "\n", encoding="utf-8")
    with pytest.raises(RecordError, match=r"line 1: more content after the JSON array"):
        read_records(path)


def test_json_lines_that_do_not_parse_say_which_layouts_are_read(tmp_path):
    path = tmp_path / "a.json"
    path.write_text(json.dumps(GOOD, ensure_ascii=False, indent=2), encoding="utf-8")  # one pretty-printed object
    with pytest.raises(RecordError,
                       match=r"a\.json, line 1: not valid JSON .*one JSON array, or one JSON object a line"):
        read_records(path)


def test_empty_array_and_byte_order_marks(tmp_path):
    path = tmp_path / "a.json"
    path.write_bytes(b"\xef\xbb\xbf  []  \n")
    assert read_records(path)[0] == []
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps([GOOD]).encode())
    assert [r.triples for r in read_records(path)[0]] == [TRIPLES]
    path.write_bytes(b"\xef\xbb\xbf" + lines_of(GOOD, GOOD))
    assert [r.source for r in read_records(path)[0]] == [f"{path}:1", f"{path}:2"]


# ----------------------------------------------------------------------------------------------
# Bytes that are not UTF-8


def test_a_line_that_is_not_utf8_is_a_bad_record_naming_file_and_line(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_bytes(lines_of(GOOD, '{"text": "油压'.encode() + b"\xff" + '偏低"}'.encode(), GOOD))
    with pytest.raises(RecordError) as info:
        read_records(path)
    assert str(info.value) == f"{path}, line 2: not UTF-8 (byte 0xff at byte 17 of the line)"
    assert info.value.reason == "not_utf8"
    records, report = read_records(path, on_bad_record="skip")
    assert [r.source for r in records] == [f"{path}:1", f"{path}:3"]
    assert dict(report.counts) == {"not_utf8": 1} and report.examples["not_utf8"][0].startswith(f"{path}, line 2:")


def test_an_array_item_that_is_not_utf8_is_a_bad_record_naming_index_and_line(tmp_path):
    path = tmp_path / "a.json"
    items = [json.dumps(GOOD, ensure_ascii=False).encode(), b'{"text":\n "\xc3\x28"}', json.dumps(GOOD).encode()]
    path.write_bytes(b"[\n" + b",\n".join(items) + b"\n]\n")
    with pytest.raises(RecordError, match=r"a\.json, array index 1 \(line 3\): not UTF-8 \(byte 0xc3 on line 4\)"):
        read_records(path)
    records, report = read_records(path, on_bad_record="skip")
    assert [r.source for r in records] == [f"{path}[0]", f"{path}[2]"] and dict(report.counts) == {"not_utf8": 1}


def test_a_utf16_file_is_refused_as_a_whole(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_bytes(lines_of(GOOD).decode().encode("utf-16"))
    with pytest.raises(RecordError, match=r"a\.jsonl, line 1: the file is UTF-16"):
        read_records(path, on_bad_record="skip")


# ----------------------------------------------------------------------------------------------
# Conversations


def test_conversations_give_query_history_and_free_text_response(tmp_path):
    chats = [
        {"conversations": [user("类型#裙*颜色#红色"), assistant("一条红裙。")]},
        {"conversations": [user("类型#裙"), assistant("一条裙子。"), user("再短一点"), assistant("红裙。")]},
        {"conversations": [user("类型#裙"), assistant("一条裙子。"), user("没有答案的提示")]},
    ]
    path = tmp_path / "chat.json"
    path.write_bytes(lines_of(*chats))
    records, report = read_records(path)
    assert report.total == 0
    assert [(r.text, r.history, r.response, r.triples) for r in records] == [
        ("类型#裙*颜色#红色", (), "一条红裙。", None),
        ("再短一点", (("类型#裙", "一条裙子。"),), "红裙。", None),
        ("没有答案的提示", (("类型#裙", "一条裙子。"),), None, None),
    ]
    # the same records as prompt/response/history columns give
    rows = [{"prompt": "类型#裙*颜色#红色", "response": "一条红裙。", "history": []},
            {"prompt": "再短一点", "response": "红裙。", "history": [["类型#裙", "一条裙子。"]]}]
    (tmp_path / "cols.jsonl").write_bytes(lines_of(*rows))
    columns, _ = read_records(tmp_path / "cols.jsonl",
                              columns=DataColumns(prompt="prompt", response="response", history="history"))
    assert [(r.text, r.history, r.answer) for r in columns] == [(r.text, r.history, r.answer) for r in records[:2]]


BAD_CHATS = [
    ({"conversations": [user("q"), assistant("a"), {"role": "user", "content": 3}, assistant("b")]}, "not_string",
     "field 'conversations[2].content': expected a string, got int"),
    ({"conversations": [user("q"), {"content": "a"}]}, "missing_field", "field 'conversations[1].role': missing"),
    ({"conversations": [user("q"), {"role": "system", "content": "你是助手"}, assistant("a")]}, "system_turn",
     "field 'conversations[1].role': a system turn comes first, once (before any user turn)"),
    ({"conversations": [user("q"), {"role": "bot", "content": "{}"}]}, "bad_role",
     "field 'conversations[1].role': expected system, user, assistant or tool, got 'bot'"),
    ({"conversations": [assistant("a")]}, "bad_role", "field 'conversations[0].role': expected 'user'"),
    ({"conversations": [user("q"), assistant("a"), assistant("b")]}, "bad_role", "field 'conversations[2].role'"),
    ({"conversations": [user("q"), {"role": "assistant", "content": "a", "loss": "no"}]}, "bad_loss",
     "field 'conversations[1].loss': expected true or false, got 'no'"),
    ({"conversations": [user("q"), {"role": "assistant", "content": "a", "score": 1}]}, "unread_field",
     "field 'conversations[1].score': not read"),
    ({"conversations": [user(" "), assistant("a")]}, "empty_text",
     "field 'conversations[0].content': the last user turn is empty"),
    ({"conversations": []}, "empty_text", "field 'conversations': no turns"),
    ({"conversations": "q"}, "not_list", "field 'conversations': expected a list of turns, got str"),
    ({"conversations": [["q", "a"]]}, "not_object", "field 'conversations[0]': expected a turn object, got list"),
    ({"conversations": [user("q"), assistant("a")], "tools": "get_weather"}, "not_list",
     "field 'tools': expected a list of tool definitions, got str"),
    ({"conversations": [user("q"), assistant("a")], "system": "你是助手"}, "unread_field", "field 'system': not read"),
]


@pytest.mark.parametrize("bad,reason,expected", BAD_CHATS, ids=[f"{i}-{b[1]}" for i, b in enumerate(BAD_CHATS)])
def test_bad_conversations_name_the_turn_and_field(tmp_path, bad, reason, expected):
    path = tmp_path / "chat.jsonl"
    path.write_bytes(lines_of({"conversations": [user("q"), assistant("a")]}, bad))
    with pytest.raises(RecordError) as info:
        read_records(path)
    assert str(info.value).startswith(f"{path}, line 2, {expected}"), str(info.value)
    assert info.value.reason == reason


def test_one_file_holds_one_kind_of_gold_answer(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_bytes(lines_of(GOOD, {"conversations": [user("q")]},
                              {"conversations": [user("q"), assistant("a")]}, GOOD))
    with pytest.raises(RecordError,
                       match=rf"line 3: its gold answer is a free-text response .*, that of {path}:1 triples"):
        read_records(path)
    records, report = read_records(path, on_bad_record="skip")
    assert len(records) == 3 and dict(report.counts) == {"mixed_answers": 1}


# ----------------------------------------------------------------------------------------------
# Instruction/input/output


def test_the_instruction_leads_the_prompt_and_output_stays_triples(tmp_path):
    rows = [{"instruction": "抽取三元组。", "input": TEXT, "output": ANSWER},
            {"instruction": TEXT, "input": "", "output": ANSWER},
            {"instruction": TEXT, "output": ""},
            {"input": TEXT}]
    records, report = read_records(write(tmp_path / "alpaca.json", json.dumps(rows, ensure_ascii=False)))
    assert report.total == 0
    assert [(r.text, r.triples, r.response) for r in records] == [
        ("抽取三元组。\n" + TEXT, TRIPLES, None), (TEXT, TRIPLES, None), (TEXT, (), None), (TEXT, None, None)]
    scores = score_answers([ANSWER, "发动机_部件故障_异响", "", ""], records)  # scored as triples, as before
    assert "micro" in scores and scores["micro"]["recall"] == 3 / 4


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


BAD_SHAPES = [
    ({"content": "类型#裙", "summary": "一条裙子。"}, "unknown_shape",
     "matches none of the accepted shapes (fields: 'content', 'summary'): conversations; messages; text + spo_list; "
     "instruction + input + output; text + answer; other prompt/response fields need --prompt-column and "
     "--response-column"),
    ({}, "unknown_shape", "matches none of the accepted shapes (fields: none)"),
    ({"instruction": "抽取三元组。", "input": TEXT, "output": ANSWER, "history": [["q", "a"]]}, "unread_field",
     "field 'history': not read: earlier turns are read from a conversations record"),
    ({"instruction": "抽取三元组。", "input": TEXT, "system": "你是助手"}, "unread_field", "field 'system': not read"),
    ({"text": TEXT, "answer": ANSWER, "spo_list": []}, "mixed_shape",
     "field 'answer': not read by the text + spo_list shape of this record (it reads 'spo_list', 'text')"),
    ({"text": TEXT, "input": TEXT}, "mixed_shape", "field 'text': not read by the instruction + input + output shape"),
    ({"conversations": [user("q"), assistant("a")], "text": TEXT}, "mixed_shape",
     "field 'text': not read by the conversations shape"),
]


@pytest.mark.parametrize("bad,reason,expected", BAD_SHAPES, ids=[f"{i}-{b[1]}" for i, b in enumerate(BAD_SHAPES)])
def test_a_record_of_no_shape_or_of_two_is_refused_not_dropped(tmp_path, bad, reason, expected):
    path = tmp_path / "a.jsonl"
    path.write_bytes(lines_of(bad))
    with pytest.raises(RecordError) as info:
        read_records(path)
    assert str(info.value).startswith(f"{path}, line 1, {expected}" if expected.startswith("field ")
                                      else f"{path}, line 1: {expected}"), str(info.value)
    assert info.value.reason == reason
