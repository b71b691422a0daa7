"""The tiny GLM-4 (`--model tiny-glm4`): its tokenizer, written here in GLM-4's own files, and the commands on it.

- `train_glm4_bpe` writes a tiktoken rank file and tokenizer_config.json that the normal loader reads as a
  GLM-4 directory: ranks 0..n-1 with every byte, the official special tokens at their official offsets
  after the ranks, an encoding that is tiktoken's algorithm on those ranks, every corpus character one token.
- Record text is data (`test_versions.assert_record_text_is_data`), and a training row is GLM-4's.
- train.py `--model tiny-glm4 --tuning full`, P-tuning v2 and LoRA on that run, infer.py on each, quantize.py
  --bits 4 and infer.py on that: GLM-4's prompt (`[gMASK] <sop> <|user|> \\n text <|assistant|>`) and stop ids.
The commands run in this process (their `main`): one import of torch instead of one a command.
"""

import importlib
import json
from pathlib import Path

import pytest

from chatglm_tune.data.batches import encode_record, prompt_ids
from chatglm_tune.data.records import SPORecord
from chatglm_tune.models import registry
from chatglm_tune.models.glm.glm4_tokenizer import GLM4Tokenizer, read_tiktoken_ranks, train_glm4_bpe
from chatglm_tune.models.glm.versions import load_glm_tokenizer
from chatglm_tune.runs import loading
from test_glm_tokenizer import _tiktoken_reference
from test_versions import ASSETS, DEV, NO_INSTRUCTION, assert_infers, assert_record_text_is_data, tiny_runs

# The official offsets of GLM-4's special tokens from its last rank (151329 + offset in glm-4-9b-chat).
OFFICIAL_OFFSETS = {"<|endoftext|>": 0, "[MASK]": 1, "[gMASK]": 2, "[sMASK]": 3, "<sop>": 4, "<eop>": 5,
                    "<|system|>": 6, "<|user|>": 7, "<|assistant|>": 8, "<|observation|>": 9, "<|begin_of_image|>": 10,
                    "<|end_of_image|>": 11, "<|begin_of_video|>": 12, "<|end_of_video|>": 13}
RECORDS = [json.loads(line) for line in DEV.read_text(encoding="utf-8").splitlines()[:60]]
TEXTS, ANSWERS = [r["text"] for r in RECORDS], [r["answer"] for r in RECORDS]


def in_process(script: str, *args) -> None:
    """`python script args` through the script's `main` (the repository root is on pytest's pythonpath)."""
    code = importlib.import_module(Path(script).stem).main([str(a) for a in args])
    assert not code, f"{script} exited with {code}"


@pytest.fixture(scope="module")
def tiny4_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tok4")
    train_glm4_bpe(TEXTS + ANSWERS + ["Hello world, the tiny GLM-4 says: 42."], directory)
    return directory


@pytest.fixture(scope="module")
def tiny4(tiny4_dir):
    return load_glm_tokenizer(tiny4_dir, version="glm4")


def test_the_tiny_tokenizer_is_a_glm4_directory(tiny4_dir, tiny4):
    assert sorted(p.name for p in tiny4_dir.iterdir()) == ["tokenizer.model", "tokenizer_config.json"]
    assert (registry.detect_tokenizer(tiny4_dir) == "glm4"
            and isinstance(registry.load_tokenizer(tiny4_dir), GLM4Tokenizer))
    ranks = read_tiktoken_ranks(tiny4_dir / "tokenizer.model")
    n = len(ranks)
    assert sorted(ranks.values()) == list(range(n)) and all(bytes([b]) in ranks for b in range(256))
    assert tiny4.vocab_size == n and len(tiny4) == n + len(OFFICIAL_OFFSETS) and 256 < n <= 2000
    assert {t: tiny4.get_command(t) for t in OFFICIAL_OFFSETS} == {t: n + k for t, k in OFFICIAL_OFFSETS.items()}
    assert (tiny4.eos_token_id, tiny4.pad_token_id, tiny4.stop_token_ids) == (n, n, [n, n + 7, n + 9])
    with pytest.raises(Exception, match="function tools only"):  # its chat template: the official one's function tools
        tiny4.apply_chat_template([{"role": "system", "content": "", "tools": [{"type": "python"}]}], tokenize=False)
    real = ASSETS / "glm4" / "tokenizer_config.json"
    if real.exists():  # the offsets, and the chat template (function tools, calls, observations) are the real GLM-4's
        official = json.loads(real.read_text(encoding="utf-8"))
        assert {t["content"]: int(i) - 151329 for i, t in official["added_tokens_decoder"].items()} == OFFICIAL_OFFSETS
        tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"city": "城市"}}}]
        messages = [{"role": "system", "content": "", "tools": tools}, {"role": "user", "content": "你好"},
                    {"role": "assistant", "content": "水泵_部件故障_漏油"}, {"role": "user", "content": "北京天气"},
                    {"role": "assistant", "metadata": "get_weather", "content": '{"city": "北京"}'},
                    {"role": "observation", "content": "晴"}]
        for shown in (messages, messages[1:3]):
            ours = tiny4.apply_chat_template(shown, tokenize=False, add_generation_prompt=True)
            assert ours == tiny4.apply_chat_template(shown, chat_template=official["chat_template"], tokenize=False,
                                                     add_generation_prompt=True)


def test_the_tiny_tokenizer_encodes_as_tiktoken_and_round_trips(tiny4_dir, tiny4):
    ranks = read_tiktoken_ranks(tiny4_dir / "tokenizer.model")
    unseen = "未见过的字：鑫龘 ünïcode\n\n  x"  # characters outside the corpus: bytes
    for text in TEXTS[:20] + ANSWERS[:20] + ["Hello world, the tiny GLM-4 says: 42.", unseen]:
        assert tiny4.encode_text(text) == _tiktoken_reference(text, ranks), text  # the loader's BPE is the rank file's
        assert tiny4.decode(tiny4.encode_text(text)) == text
        assert tiny4.encode(text) == [tiny4.get_command("[gMASK]"), tiny4.get_command("<sop>"),
                                      *tiny4.encode_text(text)]
    assert all(len(tiny4.encode_text(char)) == 1 for char in set("".join(TEXTS + ANSWERS)))  # a character is a token
    assert len(tiny4.encode_text(TEXTS[0])) == len(TEXTS[0])  # the preset's size: no merges past the characters
    merged = train_glm4_bpe(TEXTS + ANSWERS, tiny4_dir.parent / "merged", vocab_size=2000)
    assert len(merged.encode_text(TEXTS[0])) < len(TEXTS[0])  # a larger size merges characters into words
    ranks = read_tiktoken_ranks(tiny4_dir.parent / "merged" / "tokenizer.model")
    assert merged.encode_text(TEXTS[0]) == _tiktoken_reference(TEXTS[0], ranks)


def test_every_character_of_a_corpus_is_a_token_whatever_the_size(tmp_path):
    chars = "".join(chr(0x4E00 + i) for i in range(300))  # more characters than the ranks asked for
    tokenizer = train_glm4_bpe([chars, chars[::-1]], tmp_path / "tok", vocab_size=300)
    assert all(len(tokenizer.encode_text(c)) == 1
               for c in chars) and tokenizer.decode(tokenizer.encode_text(chars)) == chars
    with pytest.raises(ValueError, match="vocab_size must be >= 256"):
        train_glm4_bpe(["abc"], tmp_path / "small", vocab_size=100)


def test_record_text_stays_data_and_rows_are_glm4s(tiny4):
    assert_record_text_is_data(tiny4, "glm4", "glm4 (tiny)")
    record = SPORecord("水泵<|user|>漏油。", None, response="水泵_部件故障_漏油")
    row, prompt = encode_record(record, tiny4, NO_INSTRUCTION), prompt_ids(record, tiny4, NO_INSTRUCTION)
    command = tiny4.get_command
    assert prompt == [command("[gMASK]"), command("<sop>"), command("<|user|>"),
                      *tiny4.encode_text("\n水泵<|user|>漏油。"), command("<|assistant|>")]
    answer = tiny4.encode_text("\n水泵_部件故障_漏油") + [command("<|user|>")]  # GLM-4's finetune.py ends on <|user|>
    assert list(row.input_ids) == prompt + answer and row.labels == tuple([-100] * len(prompt) + answer)


# ----------------------------------------------------------------------------------------------
# The commands on a tiny GLM-4


@pytest.fixture(scope="module")
def runs4(tmp_path_factory):
    return tiny_runs(tmp_path_factory.mktemp("glm4-runs"), "tiny-glm4", base_steps=200, run=in_process)


def test_the_tiny_glm4_trains_tunes_and_infers_on_glm4s_prompt(runs4, tmp_path):
    base = runs4 / "base"
    assert registry.of_directory(base).name == "glm4"
    model, tokenizer = loading.load_run(loading.resolve_run(base))
    assert isinstance(tokenizer, GLM4Tokenizer) and model.config.eos_token_id == tokenizer.stop_token_ids
    ids = prompt_ids(SPORecord("水泵漏油。", None), tokenizer, loading.resolve_run(base).encoding)
    command = tokenizer.get_command
    assert ids[:3] == [command("[gMASK]"), command("<sop>"),
                       command("<|user|>")] and ids[-1] == command("<|assistant|>")
    # the run keeps GLM-4's chat template (transformers 5 saves it apart, as chat_template.jinja)
    chat = [{"role": "user", "content": "水泵漏油。"}]
    assert tokenizer.encode_chat(chat) == load_glm_tokenizer(runs4 / "base", version="glm4").encode_chat(chat)
    assert tokenizer.encode_chat(chat)[-1] == command("<|assistant|>")
    adapter_config = json.loads((runs4 / "lora" / "adapter_config.json").read_text())
    assert sorted(adapter_config["target_modules"]) == ["k_proj", "q_proj", "v_proj"]
    for name in ("base", "ptuning", "lora"):
        assert_infers(runs4 / name, runs4 / "data.jsonl", tmp_path / f"{name}.jsonl", min_f1=0.9, run=in_process)


def test_a_tiny_glm4_run_quantizes_to_int4_and_infers(runs4, tmp_path):
    out = tmp_path / "int4"
    in_process("quantize.py", "--bits", 4, runs4 / "base", out)
    assert json.loads((out / "config.json").read_text())["quantization_bit"] == 4
    model, tokenizer = loading.load_run(loading.resolve_run(out))
    assert model.config.quantization_bit == 4 and isinstance(tokenizer, GLM4Tokenizer)
    assert_infers(out, runs4 / "data.jsonl", tmp_path / "q.jsonl", min_f1=0.85, run=in_process)


# A tool definition as a system prompt holds it: Latin words, runs of spaces, JSON punctuation.
TOOL_JSON = json.dumps([{"name": "get_weather", "description": "查天气", "parameters": {"city": "城市"}}], indent=4,
                       ensure_ascii=False)


def test_word_pieces_shorten_the_json_and_keep_chinese_and_digits_single(tmp_path):
    corpus = [TOOL_JSON, "北京今天天气怎么样？把2500元换成美元。"] * 20
    plain = train_glm4_bpe(corpus, tmp_path / "plain")
    pieces = train_glm4_bpe(corpus, tmp_path / "pieces", word_pieces=64)
    assert len(plain.encode_text(TOOL_JSON)) == len(TOOL_JSON)
    assert len(pieces.encode_text(TOOL_JSON)) < len(TOOL_JSON) / 3
    for text in ("北京今天天气怎么样？", "2500", "城市"):
        assert len(pieces.encode_text(text)) == len(text), text
    ranks = read_tiktoken_ranks(tmp_path / "pieces" / "tokenizer.model")
    assert pieces.encode_text(TOOL_JSON) == _tiktoken_reference(TOOL_JSON, ranks)
