"""Tests of `chatglm_tune.models.chatglm6b.tokenizer`: parity with the official ChatGLM-6B tokenizer, and
`train_tokenizer`.

Golden data, produced by the official `tokenization_chatglm.py` under transformers 4.27.1 on the real
`ice_text.model`:
- `fixtures/tokenizer_golden.json`: the official golden tokenizer outputs (ids, ids with specials,
  decoded text per record);
- `fixtures/tokenizer_batch_golden.json`: the `batch_left_padded` case of the tiny golden model's cases
  (left-padded ids, position ids and the boolean GLM mask).
The real `ice_text.model` is read from the shared assets when a checkout of them sits beside this one;
those tests skip when it is absent. The `train_tokenizer` tests train a small model on a synthetic corpus
and need nothing outside the repo.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from chatglm_tune.models.chatglm6b.config import ChatGLMConfig
from chatglm_tune.models.chatglm6b.format import chat_prompt
from chatglm_tune.models.chatglm6b.tokenizer import (
    BLANK_PIECES,
    CONTROL_PIECES,
    NEWLINE_PIECE,
    TAB_PIECE,
    ChatGLMTokenizer,
    train_tokenizer,
)

FIXTURES = Path(__file__).parent / "fixtures"
ASSETS = Path(__file__).resolve().parents[2] / "shared" / "assets"
GOLDEN_RECORDS = json.loads((FIXTURES / "tokenizer_golden.json").read_text(encoding="utf-8"))["records"]
SPO_ANSWER = "发动机_部件故障_水温高\n风扇_部件故障_低速转动"


@pytest.fixture(scope="module")
def tok() -> ChatGLMTokenizer:
    """The real tokenizer, loaded from the official files (auto_map config, no trust_remote_code)."""
    if not (ASSETS / "ice_text.model").is_file():
        pytest.skip(f"the real ice_text.model is not at {ASSETS}")
    return ChatGLMTokenizer.from_pretrained(ASSETS)


@pytest.fixture(scope="module")
def plain_tok(tok) -> ChatGLMTokenizer:
    """The real tokenizer with the standard 2D attention mask."""
    return ChatGLMTokenizer(tok.vocab_file, glm_masks=False)


# ---------------------------------------------------------------------------------------------
# The real ice_text.model against the official tokenizer


@pytest.mark.parametrize("record", GOLDEN_RECORDS, ids=[repr(r["text"])[:30] for r in GOLDEN_RECORDS])
def test_golden_record(tok, record):
    assert tok.encode(record["text"], add_special_tokens=False) == record["ids"]
    assert tok.encode(record["text"]) == record["ids_with_special"]
    assert tok.decode(record["ids"]) == record["decoded"]


def test_special_ids_and_vocab(tok):
    assert tok.num_image_tokens == 0
    assert (tok.vocab_size, len(tok)) == (130344, 130344)
    assert (tok.mask_token_id, tok.gmask_token_id, tok.bos_token_id,
            tok.eos_token_id) == (130000, 130001, 130004, 130005)
    assert (tok.pad_token_id, tok.unk_token_id, tok.padding_side) == (3, 0, "left")
    assert tok.config_overrides() == {
        "vocab_size": 130368, "bos_token_id": 130004, "eos_token_id": 130005,
        "mask_token_id": 130000, "gmask_token_id": 130001, "pad_token_id": 3,
    }


def test_num_image_tokens_shifts_every_id(tok):
    """The official class default (20000) gives the pre-slim layout; ours must be asked for it."""
    shifted = ChatGLMTokenizer(tok.vocab_file, num_image_tokens=20000)
    assert shifted.encode("你好") == [20005, 94874, 150001, 150004]
    assert shifted.decode([20005, 94874, 150001, 150004]) == "你好"
    assert shifted.vocab_size == 150344


def test_build_inputs(tok):
    assert tok.build_inputs_with_special_tokens([7, 8]) == [7, 8, 130001, 130004]
    assert tok.build_inputs_with_special_tokens([7, 8], [9]) == [7, 8, 130001, 130004, 9, 130005]
    answer = tok.encode("再见", add_special_tokens=False)
    pair = tok("你好", "再见", return_special_tokens_mask=True)
    assert pair["input_ids"] == [5, 74874, 130001, 130004, *answer, 130005]
    assert pair["special_tokens_mask"] == [0, 0, 1, 1] + [0] * len(answer) + [1]


def test_special_tokens_in_raw_text(tok):
    # transformers 4.27 split these out and stripped the whitespace around them; [gMASK] stays text.
    assert tok.tokenize("a  <eop>  b<pad>x") == ["▁a", "<eop>", "▁b", "<pad>", "▁x"]
    assert tok.tokenize("[gMASK]") == ["▁[", "g", "MASK", "]"]


def test_decode_rules(tok):
    assert tok.decode([130001, 130004, 130005, 1, 2]) == ""  # CONTROL pieces decode to ""
    assert tok.decode([3, 3, 5, 74874, 3]) == "你好"  # pad ids are dropped
    assert tok.decode([19316, 398, 5, 7]) == "Hello world."  # 4.27 clean-up removes " ."
    assert tok.decode([19316, 398, 5, 7], clean_up_tokenization_spaces=False) == "Hello world ."
    assert tok.decode([[5, 74874], [19316, 398, 7]]) == ["你好", "Hello world."]


@pytest.mark.parametrize("bad_id", [130344, 150000, -1])
def test_out_of_range_id_is_a_clear_error(tok, bad_id):
    with pytest.raises(ValueError, match=str(bad_id)):
        tok.decode([5, bad_id])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.convert_ids_to_tokens([bad_id])


def test_padded_batch_matches_official(tok):
    golden = json.loads((FIXTURES / "tokenizer_batch_golden.json").read_text(encoding="utf-8"))
    prompts = [
        "你好",
        "故障现象：发动机水温高，风扇始终是低速转动。",
        chat_prompt("晚上睡不着应该怎么办", [("你好", "你好👋！")]),
    ]
    batch = tok(prompts, padding=True, return_tensors="np")
    np.testing.assert_array_equal(batch["input_ids"], golden["input_ids"])
    np.testing.assert_array_equal(batch["position_ids"], golden["position_ids"])
    assert batch["attention_mask"].dtype == np.bool_
    np.testing.assert_array_equal(batch["attention_mask"], np.array(golden["attention_mask"], dtype=bool))
    # Without padding the official tokenizer returns the ids alone; the model builds mask and positions.
    assert set(tok(prompts[0]).keys()) == {"input_ids"}


def test_padding_to_max_length_and_right_padding(tok):
    row = tok("你好", padding="max_length", max_length=6)
    assert row["input_ids"] == [3, 3, 5, 74874, 130001, 130004]
    np.testing.assert_array_equal(row["position_ids"], [[0, 0, 0, 1, 2, 2], [0, 0, 0, 0, 0, 1]])
    assert row["attention_mask"].shape == (1, 6, 6) and row["attention_mask"][0, :2].all()
    with pytest.raises(ValueError, match="left-padded"):
        tok(["你好", "再见吧"], padding=True, padding_side="right")


def test_padding_prefers_mask_over_gmask(tok):
    # The official `_pad` takes the [MASK] index for the positions after <sop> when a row has both.
    row = tok("a[MASK]b", padding=True)
    assert row["input_ids"][1:] == [130000, tok.convert_tokens_to_ids("▁b"), 130001, 130004]
    np.testing.assert_array_equal(row["position_ids"], [[0, 1, 2, 3, 1], [0, 0, 0, 0, 1]])


def test_standard_2d_mask(tok, plain_tok):
    prompts = ["你好", "故障现象：发动机水温高"]
    batch = plain_tok(prompts, padding=True, return_tensors="pt")
    glm = tok(prompts, padding=True, return_tensors="pt")
    n = len(plain_tok.encode(prompts[0]))
    s = batch["input_ids"].shape[1]
    assert batch["attention_mask"].tolist() == [[0] * (s - n) + [1] * n, [1] * s]
    assert batch["position_ids"].equal(glm["position_ids"])


def test_save_load_round_trip(tok, plain_tok, tmp_path):
    plain_tok.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert (config["tokenizer_class"], config["num_image_tokens"],
            config["glm_masks"]) == ("ChatGLMTokenizer", 0, False)
    assert "auto_map" not in config
    loaded = ChatGLMTokenizer.from_pretrained(tmp_path)
    assert loaded.glm_masks is False
    assert loaded.config_overrides() == tok.config_overrides()
    for record in GOLDEN_RECORDS:
        assert loaded.encode(record["text"]) == record["ids_with_special"]


def test_chat_prompt():
    # chat() without history; a P-tuning history column, even empty, has rounds
    assert chat_prompt("你好", None) == "你好"
    assert chat_prompt("你好", []) == "[Round 0]\n问：你好\n答："
    assert chat_prompt("再见", [("你好", "你好！"), ("在吗", "在")]) == (
        "[Round 0]\n问：你好\n答：你好！\n[Round 1]\n问：在吗\n答：在\n[Round 2]\n问：再见\n答："
    )


# ---------------------------------------------------------------------------------------------
# train_tokenizer on a small synthetic SPO corpus

SUBJECTS = ["发动机", "风扇", "空调", "刹车片", "变速箱", "水泵", "蓄电池", "转向机", "节气门", "火花塞"]
PREDICATES = ["部件故障", "性能故障", "检测工具", "组成"]
OBJECTS = ["水温高", "低速转动", "不工作", "异响", "抖动", "漏油", "无法启动", "噪音大"]


def spo_corpus() -> list[str]:
    """About 3000 short fault descriptions and their `subject_predicate_object` answers."""
    texts = []
    for i, (s1, o1, s2, o2) in enumerate(itertools.product(SUBJECTS, OBJECTS, SUBJECTS, OBJECTS[:4])):
        if i % 2:
            continue
        texts.append(f"故障现象：{s1}{o1}，{s2}{o2}，已行驶{i * 7}公里。")
        texts.append(f"{s1}_{PREDICATES[i % 4]}_{o1}\n{s2}_{PREDICATES[(i + 1) % 4]}_{o2}")
    return texts


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> ChatGLMTokenizer:
    return train_tokenizer(spo_corpus(), tmp_path_factory.mktemp("trained"), vocab_size=600)


def test_trained_special_pieces(trained):
    assert trained.convert_ids_to_tokens([0, 1, 2, 3]) == ["<unk>", "<s>", "</s>", "<pad>"]
    for piece in (*CONTROL_PIECES, NEWLINE_PIECE, TAB_PIECE, *BLANK_PIECES):
        assert trained.convert_ids_to_tokens(trained.convert_tokens_to_ids(piece)) == piece
    assert trained.sp_model.is_control(trained.gmask_token_id)
    assert trained.sp_model.is_byte(trained.convert_tokens_to_ids("<0xFF>"))


def test_trained_ids_match_config_overrides(trained):
    overrides = trained.config_overrides()
    assert overrides["vocab_size"] % 64 == 0 and len(trained) <= overrides["vocab_size"] < len(trained) + 64
    for name in ("bos_token_id", "eos_token_id", "mask_token_id", "gmask_token_id", "pad_token_id"):
        assert overrides[name] == getattr(trained, name)
    assert trained.convert_ids_to_tokens([overrides["gmask_token_id"],
                                          overrides["bos_token_id"]]) == ["[gMASK]", "<sop>"]
    ChatGLMConfig.from_name("tiny", **overrides)  # the config accepts them
    ids = trained.encode("故障现象：发动机异响", "发动机_部件故障_异响")
    assert ids[-1] == trained.eos_token_id and max(ids) < overrides["vocab_size"]


@pytest.mark.parametrize(
    "text, expected",
    [
        (SPO_ANSWER, SPO_ANSWER),
        ("故障现象：发动机水温高，已行驶120公里。", "故障现象:发动机水温高,已行驶120公里。"),  # NFKC
        ("unseen 字符 😀 9_8  x\ty", "unseen 字符 😀 9_8  x\ty"),  # byte fallback, whitespace codes
    ],
)
def test_trained_round_trip(trained, text, expected):
    ids = trained.encode(text, add_special_tokens=False)
    assert trained.unk_token_id not in ids
    assert trained.decode(ids) == expected


def test_trained_padded_batch(trained):
    batch = trained(["发动机", "故障现象：风扇异响"], padding=True, return_tensors="np")
    n = len(trained.encode("发动机"))
    s = batch["input_ids"].shape[1]
    pads = s - n
    assert batch["input_ids"][0, :pads].tolist() == [trained.pad_token_id] * pads
    # Positions of the unpadded prompt (context 0..n-2, then the [gMASK] index), left-padded with 0.
    assert batch["position_ids"][0].tolist() == [[0] * pads + list(range(n - 1)) + [n - 2], [0] * (s - 1) + [1]]


def test_training_is_deterministic(trained, tmp_path):
    again = train_tokenizer(spo_corpus(), tmp_path, vocab_size=600)
    assert again.sp_model.serialized_model_proto() == trained.sp_model.serialized_model_proto()
    assert [again.encode(t) for t in spo_corpus()[:50]] == [trained.encode(t) for t in spo_corpus()[:50]]


def test_trained_directory_loads_with_autotokenizer(trained, tmp_path):
    trained.save_pretrained(tmp_path)
    AutoTokenizer.register(ChatGLMConfig, tokenizer_class=ChatGLMTokenizer, exist_ok=True)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert isinstance(loaded, ChatGLMTokenizer)
    assert loaded.encode(SPO_ANSWER) == trained.encode(SPO_ANSWER)
