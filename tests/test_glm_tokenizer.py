"""Tests of the tokenizers of `chatglm_tune.models.glm` (ChatGLM2, ChatGLM3, GLM-4): `sp_tokenizer`,
`glm4_tokenizer`, and finding and loading them (`versions`, `models.registry`).

Golden data: `fixtures/tokenizer-glm.json`, the official golden outputs (the official
tokenizers on the real files: ids, decodes and chat prompts per version). The real tokenizer files
are read from the shared assets when a checkout of them sits beside this one (`chatglm3/` SentencePiece,
`glm4/` tiktoken ranks); those tests skip when they are absent. The rest builds small tokenizers here
(a SentencePiece model trained on a few lines, a tiktoken rank file written by hand) and needs nothing
outside the repo.
"""

from __future__ import annotations

import base64
import io
import json
import random
import shutil
from pathlib import Path

import pytest
import regex
import sentencepiece as spm

from chatglm_tune.models import registry
from chatglm_tune.models.glm.glm4_tokenizer import GLM4_PATTERN, GLM4Tokenizer, read_tiktoken_ranks
from chatglm_tune.models.glm.sp_tokenizer import ChatGLM2Tokenizer, ChatGLM3Tokenizer
from chatglm_tune.models.glm.versions import detect_tokenizer, load_glm_tokenizer

FIXTURES = Path(__file__).parent / "fixtures"
ASSETS = Path(__file__).resolve().parents[2] / "shared" / "assets"
GOLDEN = json.loads((FIXTURES / "tokenizer-glm.json").read_text(encoding="utf-8"))
VERSIONS = ("chatglm2", "chatglm3", "glm4")
ASSET_DIRS = {"chatglm2": ASSETS / "chatglm3", "chatglm3": ASSETS / "chatglm3", "glm4": ASSETS / "glm4"}
# Record text that looks like control tokens of every version.
TRICKY_RECORD = "故障<|user|>风扇<|assistant|>[gMASK]<sop> sop eop <|observation|><|endoftext|></s>结束"
GLM4_SPECIALS = ["<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>",
                 "<|assistant|>", "<|observation|>"]


def _real_tokenizer(version: str):
    directory = ASSET_DIRS[version]
    if not (directory / "tokenizer.model").is_file():
        pytest.skip(f"{directory} is absent (it lives in shared/ beside the checkout)")
    return load_glm_tokenizer(directory, version=version)


@pytest.fixture(scope="module", params=VERSIONS)
def real(request):
    """(version, tokenizer over the real files)."""
    return request.param, _real_tokenizer(request.param)


@pytest.fixture(scope="module")
def glm4():
    return _real_tokenizer("glm4")


def _mismatches(tokenizer, records):
    bad = []
    for r in records:
        got = {"ids": tokenizer.encode(r["text"]), "decoded": tokenizer.decode(r["ids"]),
               "decoded_text_only": tokenizer.decode(r["ids"][2:])}
        bad += [(r["text"], key, got[key], r[key]) for key in got if got[key] != r[key]]
    return bad


def _chat_ids(version, tokenizer, chat):
    if version == "chatglm2":
        prompt = tokenizer.build_prompt(chat["query"], chat["history"])
        return prompt, tokenizer([prompt])["input_ids"][0]
    if version == "chatglm3":
        return None, tokenizer.build_chat_input(chat["query"], chat["history"], chat["role"])["input_ids"][0].tolist()
    text = tokenizer.apply_chat_template(chat["messages"], add_generation_prompt=True, tokenize=False)
    # transformers 5 returns a dict unless told otherwise (4.44 returned the list)
    return text, tokenizer.apply_chat_template(chat["messages"], add_generation_prompt=True, tokenize=True,
                                               return_dict=False)


# ----- golden parity on the real files ----------------------------------------------------------------
def test_golden_records(real):
    version, tokenizer = real
    records = GOLDEN[version]["records"]
    assert len(records) == 27
    assert _mismatches(tokenizer, records) == []
    assert tokenizer.encode("") == GOLDEN[version]["prefix_ids"]


def test_golden_chats(real):
    version, tokenizer = real
    chats = GOLDEN[version]["chats"]
    assert len(chats) == 3
    for chat in chats:
        text, ids = _chat_ids(version, tokenizer, chat)
        assert ids == chat["input_ids"]
        if version == "chatglm2":
            assert text == chat["prompt"]
        if version == "glm4":
            assert text == chat["text"]


@pytest.mark.parametrize("version", ["chatglm2", "chatglm3"])
def test_sentencepiece_special_ids(version):
    tokenizer = _real_tokenizer(version)
    expected = {"[MASK]": 64789, "[gMASK]": 64790, "[sMASK]": 64791, "sop": 64792, "eop": 64793}
    if version == "chatglm3":
        expected |= {"<|system|>": 64794, "<|user|>": 64795, "<|assistant|>": 64796, "<|observation|>": 64797}
    assert {t: tokenizer.get_command(t) for t in expected} == expected
    assert tokenizer.convert_tokens_to_ids(list(expected)) == list(expected.values())
    assert len(tokenizer) == tokenizer.vocab_size == 64789 + len(expected)
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id) == (2, 0)
    with pytest.raises(KeyError):
        tokenizer.get_command("<|user|>" if version == "chatglm2" else "<sop>")


def test_glm4_special_ids(glm4):
    expected = {"<|endoftext|>": 151329, "[gMASK]": 151331, "<sop>": 151333, "<|user|>": 151336,
                "<|assistant|>": 151337, "<|observation|>": 151338}
    assert {t: glm4.get_command(t) for t in expected} == expected
    assert glm4.convert_tokens_to_ids(list(expected)) == list(expected.values())
    assert (glm4.eos_token_id, glm4.pad_token_id, glm4.vocab_size) == (151329, 151329, 151329)
    assert glm4.stop_token_ids == [151329, 151336, 151338]


def test_glm4_bpe_equals_tiktoken_algorithm(glm4):
    """The converted BPE gives tiktoken's ids: a reference of tiktoken's rank-merge on the real ranks."""
    ranks = read_tiktoken_ranks(ASSET_DIRS["glm4"] / "tokenizer.model")
    rng = random.Random(0)
    alphabet = "abcxyz ABC  \n\n\t\r.,'!?-_0123456789" + "中文故障风扇你好的了éüß😀👋ひカ한Ωж"
    texts = [r["text"] for r in GOLDEN["glm4"]["records"]]
    texts += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40))) for _ in range(300)]
    for text in texts:
        assert glm4.encode_text(text) == _tiktoken_reference(text, ranks), text


# ----- behaviour on the real files ------------------------------------------------------------------------
def test_left_padding(real):
    version, tokenizer = real
    texts = ["你好", "Hello world. 故障现象"]
    rows = [tokenizer.encode(t) for t in texts]
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    width = max(map(len, rows))
    for i, row in enumerate(rows):
        n_pad = width - len(row)
        assert batch["input_ids"][i].tolist() == [tokenizer.pad_token_id] * n_pad + row
        assert batch["attention_mask"][i].tolist() == [0] * n_pad + [1] * len(row)
        assert batch["position_ids"][i].tolist() == [0] * n_pad + list(range(len(row)))
    assert min(map(len, rows)) < width  # something was padded
    padded = tokenizer.pad([{"input_ids": r} for r in rows], padding="max_length", max_length=width + 3)
    assert [len(r) for r in padded["input_ids"]] == [width + 3] * 2
    assert padded["position_ids"][0][-len(rows[0]):] == list(range(len(rows[0])))
    with pytest.raises(ValueError, match="left"):
        tokenizer(texts, padding=True, padding_side="right")


def test_typed_specials(real):
    """GLM-4's encode turns typed special text into the special ids (official); ChatGLM2/3's never do."""
    version, tokenizer = real
    ids = tokenizer.encode(TRICKY_RECORD)[2:]
    special = [i for i in ids if i in tokenizer.special_token_ids]
    if version == "glm4":
        assert [tokenizer.convert_ids_to_tokens(i) for i in special] == [
            "<|user|>", "<|assistant|>", "[gMASK]", "<sop>", "<|observation|>", "<|endoftext|>"]
    else:
        assert special == []


def test_data_text_never_special(real):
    version, tokenizer = real
    ids = tokenizer.encode_text(TRICKY_RECORD)
    assert not set(ids) & tokenizer.special_token_ids
    assert tokenizer.decode(ids) == TRICKY_RECORD
    if version == "glm4":
        assert tokenizer.encode_text(TRICKY_RECORD) != tokenizer.encode(TRICKY_RECORD, add_special_tokens=False)
        message = tokenizer.build_single_message("user", "", TRICKY_RECORD)
    elif version == "chatglm3":
        message = tokenizer.build_chat_input(TRICKY_RECORD)["input_ids"][0].tolist()[2:-1]
    else:
        message = tokenizer(tokenizer.build_prompt(TRICKY_RECORD))["input_ids"][2:]
    assert [i for i in message if i in tokenizer.special_token_ids] == (
        [] if version == "chatglm2" else [tokenizer.get_command("<|user|>")])


def test_glm4_encode_chat_keeps_structure(glm4):
    """The chat template's own tokens are special, a record's text is not."""
    def chat(content):
        return [{"role": "system", "content": "抽取三元组"}, {"role": "user", "content": content},
                {"role": "assistant", "content": "风扇_部件故障_低速"}, {"role": "user", "content": content}]

    plain, tricky = chat("故障现象：风扇低速"), chat(TRICKY_RECORD)
    specials = [i for i in glm4.encode_chat(plain) if i in glm4.special_token_ids]
    assert glm4.encode_chat(plain) == glm4.apply_chat_template(plain, add_generation_prompt=True, return_dict=False)
    assert [i for i in glm4.encode_chat(tricky) if i in glm4.special_token_ids] == specials
    official = glm4.apply_chat_template(tricky, add_generation_prompt=True, return_dict=False)
    assert len([i for i in official if i in glm4.special_token_ids]) > len(specials)  # the trap is real
    ids = glm4.encode_chat(tricky)
    last_user = len(ids) - 1 - ids[::-1].index(glm4.get_command("<|user|>"))
    assert ids[last_user + 1:-1] == glm4.encode_text("\n" + TRICKY_RECORD)
    assert TRICKY_RECORD in glm4.decode(ids)
    with pytest.raises(ValueError, match="role"):
        glm4.encode_chat([{"role": "tool", "content": "x"}])
    for golden in GOLDEN["glm4"]["chats"]:
        if not any("<|" in m["content"] for m in golden["messages"]):
            assert glm4.encode_chat(golden["messages"]) == golden["input_ids"]


def test_decode_special_rendering(real):
    version, tokenizer = real
    ids = tokenizer.encode("a") + [tokenizer.get_command("[gMASK]")] + tokenizer.encode_text("b")
    expected = {"chatglm2": "a b", "chatglm3": "[gMASK]sop a[gMASK] b", "glm4": "[gMASK] <sop> a [gMASK] b"}
    assert tokenizer.decode(ids) == expected[version]
    assert tokenizer.decode(ids, skip_special_tokens=True) == ("ab" if version == "glm4" else "a b")


def test_save_and_load_round_trip(real, tmp_path):
    version, tokenizer = real
    tokenizer.save_pretrained(tmp_path)
    assert registry.detect_tokenizer(tmp_path) == version
    loaded = registry.load_tokenizer(tmp_path)
    assert type(loaded) is type(tokenizer)
    assert _mismatches(loaded, GOLDEN[version]["records"]) == []
    for chat in GOLDEN[version]["chats"]:
        assert _chat_ids(version, loaded, chat) == _chat_ids(version, tokenizer, chat)
    assert loaded.encode_text(TRICKY_RECORD) == tokenizer.encode_text(TRICKY_RECORD)
    assert loaded.get_vocab() == tokenizer.get_vocab()


def test_detect_official_directories(tmp_path):
    if not (ASSETS / "glm4" / "tokenizer.model").is_file():
        pytest.skip(f"{ASSETS} is absent")
    assert registry.detect_tokenizer(ASSETS / "chatglm3") == "chatglm3"
    assert registry.detect_tokenizer(ASSETS / "glm4") == "glm4"
    assert isinstance(registry.load_tokenizer(ASSETS / "chatglm3"), ChatGLM3Tokenizer)
    chatglm2 = tmp_path / "chatglm2"
    chatglm2.mkdir()
    shutil.copy(ASSETS / "chatglm3" / "tokenizer.model", chatglm2)
    config = json.loads((ASSETS / "chatglm3" / "tokenizer_config.json").read_text())
    (chatglm2 / "tokenizer_config.json").write_text(json.dumps({**config, "name_or_path": "THUDM/chatglm2-6b"}))
    assert isinstance(registry.load_tokenizer(chatglm2), ChatGLM2Tokenizer)
    (chatglm2 / "tokenizer_config.json").write_text(json.dumps({**config, "name_or_path": "/data/my-model"}))
    with pytest.raises(ValueError, match="chatglm2.*chatglm3"):
        registry.detect_tokenizer(chatglm2)
    if (ASSETS / "ice_text.model").is_file():
        assert registry.detect_tokenizer(ASSETS) == "chatglm"
        assert detect_tokenizer(ASSETS) is None  # not a tokenizer of this family
        with pytest.raises(ValueError, match="no tokenizer.model"):
            load_glm_tokenizer(ASSETS, version="chatglm3")


def test_glm4_hf_directory(glm4, tmp_path):
    """A `glm-4-9b-chat-hf` style directory: `tokenizer.json` + transformers' tokenizer_config.json."""
    glm4.save_vocabulary(str(tmp_path))
    config = json.loads((ASSET_DIRS["glm4"] / "tokenizer_config.json").read_text(encoding="utf-8"))
    config.pop("auto_map")
    config |= {"tokenizer_class": "PreTrainedTokenizerFast", "extra_special_tokens": {},
               "model_input_names": ["input_ids", "attention_mask"]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False), encoding="utf-8")
    assert registry.detect_tokenizer(tmp_path) == "glm4"
    loaded = registry.load_tokenizer(tmp_path)
    assert _mismatches(loaded, GOLDEN["glm4"]["records"]) == []
    for chat in GOLDEN["glm4"]["chats"]:
        assert _chat_ids("glm4", loaded, chat)[1] == chat["input_ids"]


# ----- always-run checks on small tokenizers built here -----------------------------------------------
CORPUS = ["故障现象：发动机水温高，风扇始终是低速转动。", "Hello world, the fan turns slowly.",
          "user assistant system observation sop eop", "高速档不工作，开空调尤其如此。"] * 20


@pytest.fixture(scope="module")
def small_sp_dir(tmp_path_factory):
    """A SentencePiece model with the official layout (unk 0, <s> 1, </s> 2, byte fallback)."""
    directory = tmp_path_factory.mktemp("small_sp")
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS), model_writer=model, model_type="bpe", vocab_size=400,
        byte_fallback=True, character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        num_threads=1, minloglevel=2,
    )
    (directory / "tokenizer.model").write_bytes(model.getvalue())
    return directory


def test_small_sentencepiece_layout(small_sp_dir, tmp_path):
    chatglm3 = ChatGLM3Tokenizer(str(small_sp_dir / "tokenizer.model"))
    chatglm2 = ChatGLM2Tokenizer(str(small_sp_dir / "tokenizer.model"))
    n = chatglm3.sp_model.get_piece_size()
    names = ("[gMASK]", "sop", "<|user|>", "<|observation|>")
    assert [chatglm3.get_command(t) for t in names] == [n + 1, n + 3, n + 6, n + 8]
    assert chatglm2.vocab_size == n + 5 and chatglm3.vocab_size == n + 9
    ids = chatglm3.encode("风扇<|user|>sop")
    assert ids[:2] == [n + 1, n + 3] and not set(ids[2:]) & chatglm3.special_token_ids
    assert ids == chatglm2.encode("风扇<|user|>sop")
    assert chatglm3.decode(ids) == "[gMASK]sop 风扇<|user|>sop" and chatglm2.decode(ids) == "风扇<|user|>sop"
    chat = chatglm3.build_chat_input("风扇", [{"role": "system", "content": "抽取", "tools": [{"name": "风"}]},
                                           {"role": "assistant", "metadata": "track", "content": "好"}])
    expected = [n + 1, n + 3, n + 5, *chatglm3.encode_text("\n"),
                *chatglm3.encode_text("抽取\n" + json.dumps([{"name": "风"}], indent=4, ensure_ascii=False)),
                n + 7, *chatglm3.encode_text("track\n"), *chatglm3.encode_text("好"),
                n + 6, *chatglm3.encode_text("\n"), *chatglm3.encode_text("风扇"), n + 7]
    assert chat["input_ids"][0].tolist() == expected
    assert chat["position_ids"][0].tolist() == list(range(len(expected)))
    assert ChatGLM3Tokenizer(str(small_sp_dir / "tokenizer.model"), encode_special_tokens=True).encode(
        "风<|user|>扇")[2:] == [*chatglm3.encode_text("风"), n + 6, *chatglm3.encode_text("扇")]
    chatglm3.save_pretrained(tmp_path)
    loaded = registry.load_tokenizer(tmp_path)
    assert isinstance(loaded, ChatGLM3Tokenizer) and loaded.encode("风扇 sop") == chatglm3.encode("风扇 sop")


def _tiktoken_reference(text: str, ranks: dict[bytes, int]) -> list[int]:
    """tiktoken's algorithm: split with the regex; a piece in the vocabulary is one token, others merge."""
    ids = []
    for piece in regex.findall(GLM4_PATTERN, text):
        piece = piece.encode("utf-8")
        ids += [ranks[piece]] if piece in ranks else [ranks[p] for p in _merge(piece, ranks)]
    return ids


def _merge(word: bytes, ranks: dict[bytes, int]) -> list[bytes]:
    """Bytes merged pair by pair, the adjacent pair of lowest rank first (the leftmost on a tie)."""
    parts = [bytes([b]) for b in word]
    while len(parts) > 1:
        pairs = [(ranks.get(parts[i] + parts[i + 1]), i) for i in range(len(parts) - 1)]
        best = min((p for p in pairs if p[0] is not None), default=None)
        if best is None:
            break
        parts[best[1]:best[1] + 2] = [parts[best[1]] + parts[best[1] + 1]]
    return parts


@pytest.fixture(scope="module")
def small_tiktoken_dir(tmp_path_factory):
    """A tiktoken rank file: the 256 bytes, then merges of frequent pairs of a small corpus (learned
    here), then a few whole words with no merge path; GLM-4's special tokens after them."""
    directory = tmp_path_factory.mktemp("small_tiktoken")
    ranks = {bytes([b]): b for b in range(256)}
    words = [w.encode() for text in CORPUS for w in regex.findall(GLM4_PATTERN, text)]
    for _ in range(120):
        counts = {}
        for word in words:
            parts = _merge(word, ranks)
            for a, b in zip(parts, parts[1:]):
                counts[a + b] = counts.get(a + b, 0) + 1
        best = max(sorted(counts), key=counts.get)
        ranks[best] = len(ranks)
    for word in (" qqzx", "龘龘"):
        ranks[word.encode()] = len(ranks)
    lines = [f"{base64.b64encode(t).decode()} {r}" for t, r in ranks.items()]
    (directory / "tokenizer.model").write_text("\n".join(lines) + "\n")
    specials = {len(ranks) + i: t for i, t in enumerate(GLM4_SPECIALS)}
    template = ("[gMASK]<sop>{% for m in messages %}<|{{ m['role'] }}|>{{ m.get('metadata', '') }}\n"
                "{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    config = {"added_tokens_decoder": {str(i): {"content": t, "special": True} for i, t in specials.items()},
              "tokenizer_class": "ChatGLM4Tokenizer", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
              "chat_template": template}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory, ranks


def test_small_tiktoken_bpe_and_specials(small_tiktoken_dir, tmp_path):
    directory, ranks = small_tiktoken_dir
    assert registry.detect_tokenizer(directory) == "glm4"
    tokenizer = registry.load_tokenizer(directory)
    n = len(ranks)
    assert isinstance(tokenizer, GLM4Tokenizer) and tokenizer.vocab_size == n
    rng = random.Random(1)
    alphabet = "".join(sorted(set("".join(CORPUS)))) + "  \n\t😀é龘"
    texts = CORPUS[:4] + [" qqzx", "龘龘", "x qqzx龘龘 qqzxy"]
    texts += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30))) for _ in range(200)]
    for text in texts:
        assert tokenizer.encode_text(text) == _tiktoken_reference(text, ranks), text
        assert tokenizer.decode(tokenizer.encode_text(text)) == text
    # words with no merge path: tiktoken takes a piece found in the vocabulary whole
    assert tokenizer.encode_text("龘龘 qqzx") == [ranks["龘龘".encode()], ranks[b" qqzx"]]
    ids = tokenizer.encode("风扇<|user|>故障")
    assert ids == [n + 2, n + 4, *tokenizer.encode_text("风扇"), n + 7, *tokenizer.encode_text("故障")]
    assert tokenizer.decode(ids) == "[gMASK] <sop> 风扇 <|user|> 故障"
    assert tokenizer.decode([ranks[b"\xe9"]]) == "\ufffd"  # a broken UTF-8 sequence is replaced
    messages = [{"role": "user", "content": "风扇<|assistant|>"}]
    chat = tokenizer.encode_chat(messages)
    assert chat == [n + 2, n + 4, n + 7, *tokenizer.encode_text("\n风扇<|assistant|>"), n + 8]
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)[-2:] == [n + 8] * 2
    tokenizer.save_pretrained(tmp_path)
    loaded = registry.load_tokenizer(tmp_path)
    assert [loaded.encode(t) for t in texts] == [tokenizer.encode(t) for t in texts]
    assert loaded.encode_chat(messages) == chat


def test_small_tiktoken_bad_specials(small_tiktoken_dir, tmp_path):
    directory, ranks = small_tiktoken_dir
    shutil.copy(directory / "tokenizer.model", tmp_path)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"] = {str(len(ranks) + 5): {"content": "[gMASK]", "special": True}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="special token"):
        registry.load_tokenizer(tmp_path)


def test_not_a_tokenizer_directory(tmp_path):
    with pytest.raises(ValueError, match=str(tmp_path)):
        registry.load_tokenizer(tmp_path)
    for version in VERSIONS:
        with pytest.raises(ValueError, match="not a directory"):
            load_glm_tokenizer(tmp_path / "missing", version=version)
    with pytest.raises(ValueError, match="version"):
        load_glm_tokenizer(tmp_path, version="chatglm4")
