"""Tests of chatglm_tune.data.records (reading, validation) and chatglm_tune.data.batches (official P-tuning encoding,
collators), and of the shipped synthetic set's generator `data/make_spo.py`."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from chatglm_tune.data.batches import (
    IGNORE_INDEX,
    EncodedDataset,
    SpecialIds,
    collate_prompts,
    collate_train,
    encode_record,
    prompt_ids,
)
from chatglm_tune.data.records import RecordError, SPORecord, Triple, answer_text, read_records
from chatglm_tune.models.chatglm6b.positions import build_position_ids
from chatglm_tune.models.chatglm6b.tokenizer import train_tokenizer
from chatglm_tune.options import EncodingOptions

REPO = Path(__file__).resolve().parents[1]
TEXT = "发动机出现异响，水泵漏油。"
TRIPLES = (Triple("发动机", "部件故障", "异响"), Triple("水泵", "部件故障", "漏油"))
ANSWER = "发动机_部件故障_异响\n水泵_部件故障_漏油"


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    texts = [TEXT, ANSWER, EncodingOptions().prompt, "用万用表测量电压。", "万用表_检测工具_电压", "油压偏低"] * 3
    return train_tokenizer(texts, tmp_path_factory.mktemp("tok"), vocab_size=400)


@pytest.fixture(scope="module")
def special(tok):
    return SpecialIds.of(tok)


def write_jsonl(path: Path, lines: list) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line, ensure_ascii=False)) + "\n"
                            for line in lines), encoding="utf-8")
    return path


def load_make_spo():
    """`data/make_spo.py` as a module (it is a script, not part of the package)."""
    if "make_spo" not in sys.modules:
        spec = importlib.util.spec_from_file_location("make_spo", REPO / "data" / "make_spo.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["make_spo"] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    return sys.modules["make_spo"]


# ----------------------------------------------------------------------------------------------
# Reading


INSTRUCTION = "抽取三元组。"
SHAPES = {
    "text_answer": {"text": TEXT, "answer": ANSWER},
    "instruction": {"instruction": INSTRUCTION, "input": TEXT, "output": ANSWER},
    "spo_list": {"text": TEXT, "spo_list": [{"subject": t.subject, "predicate": t.predicate, "object": t.object}
                                            for t in TRIPLES]},
    "competition": {"text": TEXT, "spo_list": [{"h": {"name": t.subject}, "t": {"name": t.object},
                                                "relation": t.predicate} for t in TRIPLES]},
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_every_shape_gives_the_same_record(tmp_path, shape):
    records, report = read_records(write_jsonl(tmp_path / "a.jsonl", [SHAPES[shape]]))
    assert report.total == 0
    text = INSTRUCTION + "\n" + TEXT if shape == "instruction" else TEXT  # the instruction leads the prompt text
    assert [(r.text, r.triples, r.response) for r in records] == [(text, TRIPLES, None)]
    assert records[0].source == f"{tmp_path / 'a.jsonl'}:1"
    assert records[0].answer == ANSWER


def test_json_array_and_jsonl_agree(tmp_path):
    items = [SHAPES[s] for s in sorted(SHAPES)]
    path = tmp_path / "a.json"
    path.write_text(json.dumps(items, ensure_ascii=False), encoding="utf-8")
    from_json, _ = read_records(path)
    from_jsonl, _ = read_records(write_jsonl(tmp_path / "a.jsonl", items))
    assert [(r.text, r.triples) for r in from_json] == [(r.text, r.triples) for r in from_jsonl]
    assert [r.source for r in from_json] == [f"{path}[{i}]" for i in range(len(items))]


def test_gold_is_optional_and_empty_answer_means_no_triple(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [{"text": TEXT}, {"text": TEXT, "answer": ""}, {"input": TEXT}, "", "   "])
    records, _ = read_records(path)  # blank lines are ignored
    assert [r.triples for r in records] == [None, (), None]
    assert records[0].answer is None and records[1].answer == ""


def test_answer_lines_are_stripped_and_duplicates_kept(tmp_path):
    answer = " 发动机 _部件故障_ 异响 \n\n发动机_部件故障_异响\n"
    records, _ = read_records(write_jsonl(tmp_path / "a.jsonl", [{"text": TEXT, "answer": answer}]))
    assert records[0].triples == (TRIPLES[0], TRIPLES[0])
    assert answer_text(records[0].triples) == "发动机_部件故障_异响\n发动机_部件故障_异响"


BAD = [
    ("{not json", "not_json", ["line 2", "not valid JSON"]),
    ([1, 2], "not_object", ["line 2", "expected a JSON object, got list"]),
    ({"answer": ANSWER}, "missing_field", ["line 2", "field 'text'", "missing"]),
    ({"text": 5, "answer": ANSWER}, "not_string", ["line 2", "field 'text'", "expected a string, got int"]),
    ({"text": TEXT, "answer": None}, "not_string", ["line 2", "field 'answer'", "got null"]),
    ({"text": "  ", "answer": ANSWER}, "empty_text", ["line 2", "field 'text'", "empty"]),
    ({"instruction": " ", "output": ANSWER}, "empty_text", ["line 2", "field 'instruction'", "both missing or blank"]),
    ({"instruction": "x", "input": 3}, "not_string", ["line 2", "field 'input'", "got int"]),
    ({"text": TEXT, "answer": "发动机_异响"}, "bad_triple",
     ["line 2", "field 'answer line 1'", "'发动机_异响'", "2 part(s)"]),
    ({"text": TEXT, "answer": ANSWER + "\n水_泵_部件故障_漏油"}, "bad_triple",
     ["line 2", "answer line 3", "4 part(s)"]),
    ({"text": TEXT, "answer": "发动机__异响"}, "empty_triple_part", ["line 2", "predicate is empty"]),
    ({"text": TEXT, "spo_list": [{"subject": "水_泵", "predicate": "部件故障", "object": "漏油"}]},
     "underscore_in_name", ["line 2", "field 'spo_list[0]'", "subject '水_泵' contains '_'"]),
    ({"text": TEXT, "spo_list": [{"h": {"name": "水泵"}, "t": {"name": "漏_油"}, "relation": "部件故障"}]},
     "underscore_in_name", ["line 2", "object '漏_油' contains '_'"]),
    ({"text": TEXT, "spo_list": [{"h": {"name": "水泵"}, "relation": "部件故障"}]}, "missing_field",
     ["line 2", "field 'spo_list[0].t'"]),
    ({"text": TEXT, "spo_list": [{"subject": "水泵", "predicate": 3, "object": "漏油"}]}, "not_string",
     ["line 2", "field 'spo_list[0].predicate'", "got int"]),
    ({"text": TEXT, "spo_list": "水泵_部件故障_漏油"}, "not_list", ["line 2", "field 'spo_list'"]),
]


@pytest.mark.parametrize("bad,reason,expected", BAD, ids=[f"{i}-{b[1]}" for i, b in enumerate(BAD)])
def test_bad_record_names_file_line_and_field(tmp_path, bad, reason, expected):
    path = write_jsonl(tmp_path / "bad.jsonl", [SHAPES["text_answer"], bad, SHAPES["text_answer"]])
    with pytest.raises(RecordError) as info:
        read_records(path)
    message = str(info.value)
    assert message.startswith(str(path)), message
    for part in expected:
        assert part in message, message
    assert info.value.reason == reason


def test_bad_item_of_a_json_array_names_its_index(tmp_path):
    path = tmp_path / "a.json"
    path.write_text(json.dumps([SHAPES["text_answer"], {"text": ""}]), encoding="utf-8")
    with pytest.raises(RecordError, match=r"a\.json, array index 1 \(line 1\), field 'text': the text is empty"):
        read_records(path)


def test_a_json_file_of_one_object_a_line_is_read_as_json_lines(tmp_path):
    path = write_jsonl(tmp_path / "train.json", [SHAPES["text_answer"], SHAPES["spo_list"]])
    records, report = read_records(path)
    assert report.total == 0 and [(r.text, r.triples, r.source) for r in records] == [
        (TEXT, TRIPLES, f"{path}:1"), (TEXT, TRIPLES, f"{path}:2")]


def test_skip_mode_counts_and_reports_every_skip(tmp_path):
    good = SHAPES["text_answer"]
    lines = [good, "{oops", good, {"text": ""}, {"text": TEXT, "answer": "a_b"}, {"text": ""}, good]
    records, report = read_records(write_jsonl(tmp_path / "a.jsonl", lines), on_bad_record="skip")
    assert [r.source.rsplit(":", 1)[1] for r in records] == ["1", "3", "7"]
    assert report.total == 4
    assert dict(report.counts) == {"not_json": 1, "empty_text": 2, "bad_triple": 1}
    assert [m.split(",")[1].strip() for m in report.examples["empty_text"]] == ["line 4", "line 6"]
    assert report.to_dict()["skipped"] == 4
    assert report.summary() == "skipped 4 bad record(s) (bad_triple: 1, empty_text: 2, not_json: 1)"


def test_unknown_mode_and_suffix_are_rejected(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [SHAPES["text_answer"]])
    with pytest.raises(ValueError, match="on_bad_record"):
        read_records(path, on_bad_record="ignore")
    with pytest.raises(ValueError, match="suffix"):
        read_records(tmp_path / "a.csv")


# ----------------------------------------------------------------------------------------------
# Encoding


def test_encoding_follows_the_official_layout(tok):
    options = EncodingOptions()
    record = SPORecord(TEXT, TRIPLES)
    ex = encode_record(record, tok, options)
    source = tok.encode(options.prompt + TEXT, add_special_tokens=False)
    answer = tok.encode(ANSWER, add_special_tokens=False)
    assert list(ex.input_ids) == source + [tok.gmask_token_id, tok.bos_token_id] + answer + [tok.eos_token_id]
    sop = ex.input_ids.index(tok.bos_token_id)
    assert sop == len(source) + 1
    # -100 over the context ([gMASK] included); <sop> and everything after it are labelled.
    assert list(ex.labels) == [IGNORE_INDEX] * sop + list(ex.input_ids[sop:])
    assert not ex.source_truncated and not ex.answer_truncated
    assert prompt_ids(record, tok, options) == list(ex.input_ids[: sop + 1])


def test_truncation_arithmetic(tok):
    options = EncodingOptions(max_src_len=6, max_len=11)  # 5 source tokens, 3 answer tokens
    record = SPORecord(TEXT * 3, TRIPLES)
    ex = encode_record(record, tok, options)
    source = tok.encode(options.prompt + record.text, add_special_tokens=False)[:5]
    answer = tok.encode(ANSWER, add_special_tokens=False)[:3]
    assert list(ex.input_ids) == source + [tok.gmask_token_id, tok.bos_token_id] + answer + [tok.eos_token_id]
    assert len(ex.input_ids) == options.max_len
    assert ex.source_truncated and ex.answer_truncated
    assert ex.input_ids.index(tok.gmask_token_id) == options.max_src_len - 1
    assert prompt_ids(record, tok, options) == source + [tok.gmask_token_id, tok.bos_token_id]


def test_lengths_never_exceed_max_len(tok):
    options = EncodingOptions(max_src_len=10, max_len=14)
    for text in ["油", TEXT, TEXT * 20]:
        for triples in [(), TRIPLES[:1], TRIPLES * 5]:
            ex = encode_record(SPORecord(text, triples), tok, options)
            assert len(ex.input_ids) == len(ex.labels) <= options.max_len
            assert ex.input_ids[-1] == tok.eos_token_id
            assert ex.input_ids.index(tok.gmask_token_id) <= options.max_src_len - 1


def test_empty_answer_trains_sop_then_eop(tok):
    ex = encode_record(SPORecord(TEXT, ()), tok)
    assert ex.input_ids[-3:] == (tok.gmask_token_id, tok.bos_token_id, tok.eos_token_id)
    assert ex.labels[-3:] == (IGNORE_INDEX, tok.bos_token_id, tok.eos_token_id)


def test_options_are_validated_and_records_without_gold_refused(tok):
    with pytest.raises(ValueError, match="exceed max_src_len"):
        EncodingOptions(max_src_len=10, max_len=11)
    with pytest.raises(ValueError, match="x.jsonl:3: has no gold answer"):
        encode_record(SPORecord(TEXT, None, "x.jsonl:3"), tok)


def test_dataset_counts_truncations(tok):
    options = EncodingOptions(prompt="文本：", max_src_len=8, max_len=14)
    records = [SPORecord("油", ()), SPORecord(TEXT * 4, ()), SPORecord("油", TRIPLES * 3)]
    ds = EncodedDataset.from_records(records, tok, options)
    assert len(ds) == 3 and ds[0].input_ids[-1] == tok.eos_token_id
    assert ds.truncation_counts() == {"examples": 3, "source_truncated": 1, "answer_truncated": 1, "row_truncated": 0}


# ----------------------------------------------------------------------------------------------
# Collators


def test_collate_train_pads_right_to_the_longest_row(tok, special):
    options = EncodingOptions()
    batch = [encode_record(SPORecord(t, tr), tok, options)
             for t, tr in [("油", ()), (TEXT, TRIPLES), (TEXT, TRIPLES[:1])]]
    out = collate_train(batch, special)
    longest = max(len(e.input_ids) for e in batch)
    assert out["input_ids"].shape == out["labels"].shape == out["attention_mask"].shape == (3, longest)
    assert longest < options.max_len  # padded to the batch, not to max_len
    positions = build_position_ids(out["input_ids"], bos_token_id=tok.bos_token_id, gmask_token_id=tok.gmask_token_id,
                                   mask_token_id=tok.mask_token_id, pad_mask=out["attention_mask"])
    assert positions.shape == (3, 2, longest)
    for i, ex in enumerate(batch):
        n = len(ex.input_ids)
        assert out["input_ids"][i, :n].tolist() == list(ex.input_ids)
        assert (out["input_ids"][i, n:] == special.pad_token_id).all()
        assert out["labels"][i, :n].tolist() == list(ex.labels)
        assert (out["labels"][i, n:] == IGNORE_INDEX).all()
        assert out["attention_mask"][i].tolist() == [1] * n + [0] * (longest - n)
        alone = build_position_ids(torch.tensor([ex.input_ids]), bos_token_id=tok.bos_token_id,
                                   gmask_token_id=tok.gmask_token_id, mask_token_id=tok.mask_token_id)
        assert torch.equal(positions[i, :, :n], alone[0])
        assert (positions[i, :, n:] == 0).all()


def test_collate_prompts_pads_left_and_keeps_each_rows_positions(tok, special):
    prompts = [prompt_ids(SPORecord(t, None), tok) for t in ["油", TEXT, TEXT * 2]]
    out = collate_prompts(prompts, special)
    s = max(map(len, prompts))
    assert out["input_ids"].shape == out["attention_mask"].shape == (3, s)
    positions = build_position_ids(out["input_ids"], bos_token_id=tok.bos_token_id, gmask_token_id=tok.gmask_token_id,
                                   mask_token_id=tok.mask_token_id, pad_mask=out["attention_mask"])
    for i, p in enumerate(prompts):
        pad = s - len(p)
        assert out["input_ids"][i].tolist() == [special.pad_token_id] * pad + p
        assert out["attention_mask"][i].tolist() == [0] * pad + [1] * len(p)
        alone = build_position_ids(torch.tensor([p]), bos_token_id=tok.bos_token_id,
                                   gmask_token_id=tok.gmask_token_id, mask_token_id=tok.mask_token_id)
        assert torch.equal(positions[i, :, pad:], alone[0])
        assert (positions[i, :, :pad] == 0).all()


def test_special_ids_come_from_the_tokenizer_or_config(tok):
    from chatglm_tune.models.chatglm6b.config import ChatGLMConfig

    assert SpecialIds.of(tok).gmask_token_id == tok.gmask_token_id != 130001
    config = ChatGLMConfig.from_name("tiny", **tok.config_overrides())
    assert SpecialIds.of(config) == SpecialIds.of(tok)


def test_collators_refuse_an_empty_batch(special):
    with pytest.raises(ValueError, match="empty batch"):
        collate_prompts([], special)


# ----------------------------------------------------------------------------------------------
# The synthetic set


def test_generator_is_deterministic_and_respects_relations():
    make_spo = load_make_spo()
    a = make_spo.generate_records(300, seed=7)
    assert a == make_spo.generate_records(300, seed=7)
    assert a != make_spo.generate_records(300, seed=8)
    subset = make_spo.generate_records(200, seed=7, relations=("组成", "检测工具"))
    assert {t[1] for r in subset for t in r.triples} == {"组成", "检测工具"}
    with pytest.raises(ValueError, match="subset"):
        make_spo.generate_records(1, seed=7, relations=("部件",))


def test_generated_records_are_valid_and_answers_derivable_from_the_text(tmp_path):
    make_spo = load_make_spo()
    make_spo.check_vocabulary()
    paths = list(make_spo.write_splits(tmp_path, n_train=400, n_dev=50, seed=3))
    train, _ = read_records(paths[0])
    dev, _ = read_records(paths[1])
    assert not {r.text for r in train} & {r.text for r in dev}
    for record in train:
        for t in record.triples:
            assert t.subject in record.text[:120] and t.object in record.text[:120], record
    stats = make_spo.statistics(make_spo.generate_records(400, seed=3))
    assert stats["empty"] and stats["with_duplicates"] and stats["shared_subject"] and stats["long_over_300_chars"]


def test_shipped_files_equal_what_the_script_writes(tmp_path):
    make_spo = load_make_spo()
    for path in make_spo.write_splits(tmp_path):
        shipped = REPO / "data" / path.name
        assert shipped.read_bytes() == path.read_bytes(), f"{shipped} is stale: run python data/make_spo.py"
        assert shipped.stat().st_size < 2_000_000


# ----------------------------------------------------------------------------------------------
# Prompt/response columns (the official P-tuning data shape)


def test_columns_read_prompt_response_and_history_as_the_official_prompt(tok, tmp_path):
    from chatglm_tune.models.chatglm6b.format import chat_prompt
    from chatglm_tune.options import DataColumns

    path = tmp_path / "chat.jsonl"
    rows = [{"prompt": "类型#裙*颜色#红色", "response": "一条红裙。", "history": []},
            {"prompt": "再短一点", "response": "红裙。", "history": [["类型#裙", "一条裙子。"]]},
            {"prompt": "没有答案的提示"}]
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    records, _ = read_records(path, columns=DataColumns(prompt="prompt", response="response", history="history"))
    assert [(r.text, r.history) for r in records] == [
        ("类型#裙*颜色#红色", ()), ("再短一点", (("类型#裙", "一条裙子。"),)), ("没有答案的提示", ())]
    assert [r.answer for r in records] == ["一条红裙。", "红裙。", None] and all(r.triples is None for r in records)
    # ChatGLM-6B's prompt: the official ptuning/main.py rounds whenever there is a history column
    options = EncodingOptions(prompt="")
    assert [prompt_ids(r, tok, options)[:-2] for r in records] == [tok.encode(t, add_special_tokens=False) for t in (
        "[Round 0]\n问：类型#裙*颜色#红色\n答：",
        "[Round 0]\n问：类型#裙\n答：一条裙子。\n[Round 1]\n问：再短一点\n答：",
        "[Round 0]\n问：没有答案的提示\n答：")]
    plain, _ = read_records(path, columns=DataColumns(prompt="prompt", response="response"))
    assert (plain[0].history is None
            and prompt_ids(plain[0], tok, options)[:-2] == tok.encode("类型#裙*颜色#红色", add_special_tokens=False))
    assert chat_prompt("q", None) == "q"

    path.write_text(json.dumps({"prompt": "p", "response": "r", "history": [["only one"]]}) + "\n", encoding="utf-8")
    with pytest.raises(RecordError,
                       match=r"chat.jsonl, line 1, field 'history': expected a list of \[query, response\]"):
        read_records(path, columns=DataColumns(prompt="prompt", response="response", history="history"))
    path.write_text(json.dumps({"content": "p"}) + "\n", encoding="utf-8")
    with pytest.raises(RecordError, match=r"line 1, field 'prompt': missing"):
        read_records(path, columns=DataColumns(prompt="prompt"))
    with pytest.raises(ValueError, match="need --prompt-column"):
        DataColumns(response="summary")
