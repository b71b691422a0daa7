"""What differs between versions (`chatglm_tune.models`: a `Version` and its prompt format) and the
toolkit's commands on ChatGLM3.

- Prompts equal the official ones (`tokenizer-glm.json` chats, from the official tokenizers; the real
  tokenizer files live in shared/ beside the checkout and those checks skip cleanly without them).
- Record text is data in every version: a record holding `<|user|>`, `<|assistant|>`, `[gMASK]` keeps
  the prompt's structure (special ids only where the template puts them).
- Training rows label what each version's official fine-tuning labels.
- train.py / infer.py / quantize.py on a tiny ChatGLM3 trained from scratch here: full fine-tuning,
  P-tuning v2 (official prefix keys), LoRA on q/k/v, INT4 export, all inferred from their run directories.
"""

import copy
import json
import subprocess
from pathlib import Path

import commands
import pytest
import torch

from chatglm_tune.data.batches import encode_record, prompt_ids
from chatglm_tune.data.records import SPORecord
from chatglm_tune.decoding.generation import generate
from chatglm_tune.models import registry
from chatglm_tune.models.glm.sp_tokenizer import train_glm_sentencepiece
from chatglm_tune.models.glm.versions import load_glm_tokenizer
from chatglm_tune.options import EncodingOptions, SamplingOptions
from chatglm_tune.runs import loading

ROOT = Path(__file__).resolve().parents[1]
ASSETS = ROOT.parent / "shared" / "assets"
GOLDEN = json.loads((Path(__file__).parent / "fixtures" / "tokenizer-glm.json").read_text(encoding="utf-8"))
NO_INSTRUCTION = EncodingOptions(prompt="", max_src_len=512, max_len=640)
DEV = ROOT / "data" / "spo_dev.jsonl"


def real_tokenizer(version: str):
    directory = ASSETS / ("glm4" if version == "glm4" else "chatglm3")
    if not (directory / "tokenizer.model").exists():
        pytest.skip(f"{directory} is absent (the real tokenizers live in shared/ beside the checkout)")
    return load_glm_tokenizer(directory, version=version)


def chat_record(version: str, chat: dict) -> SPORecord | None:
    """The record of an official chat whose history is plain (query, response) turns, else None."""
    if version == "chatglm2":
        return SPORecord(chat["query"], None, history=tuple(map(tuple, chat["history"])))
    messages = chat["history"] + [{"role": "user",
                                   "content": chat["query"]}] if version == "chatglm3" else chat["messages"]
    roles = [m["role"] for m in messages]
    if roles != ["user", "assistant"] * (len(roles) // 2) + ["user"] or any(set(m) - {"role", "content"}
                                                                            for m in messages):
        return None
    turns = tuple((q["content"], r["content"]) for q, r in zip(messages[:-1:2], messages[1::2]))
    return SPORecord(messages[-1]["content"], None, history=turns)


@pytest.mark.parametrize("version", ["chatglm2", "chatglm3", "glm4"])
def test_prompts_equal_the_official_chat_prompts(version):
    tokenizer = real_tokenizer(version)
    checked = 0
    for chat in GOLDEN[version]["chats"]:
        record = chat_record(version, chat)
        if record is None or (version == "glm4" and "<|" in json.dumps(chat["messages"])):
            continue  # system/tool turns are not record data; GLM-4's official template turns typed "<|user|>" special
        assert prompt_ids(record, tokenizer, NO_INSTRUCTION) == chat["input_ids"], chat
        checked += 1
    assert checked >= (3 if version == "chatglm2" else 1)


def test_the_tiny_sentencepiece_learns_word_pieces_but_keeps_chinese_and_digits_single(tmp_path):
    """A tool definition's JSON (Latin words, runs of spaces) reads in word pieces of a SentencePiece BPE, as
    the real ChatGLM3 model's; Chinese and numbers stay a character a token."""
    from chatglm_tune.data.tokenizing import sentencepiece_model_type

    tool = json.dumps([{"name": "get_weather", "parameters": {"city": "城市"}}], indent=4, ensure_ascii=False)
    tokenizer = train_glm_sentencepiece([tool, "北京今天天气怎么样？把2500元换成美元。"] * 20, tmp_path,
                                        version="chatglm3")
    assert sentencepiece_model_type(tokenizer.sp_model) == "bpe"
    assert len(tokenizer.encode_text(tool)) < len(tool) / 3
    for text in ("北京今天天气怎么样？", "2500", "城市"):
        pieces = [tokenizer.decode([i]) for i in tokenizer.encode_text(text)]
        assert [p for p in pieces if p] == list(text), text  # after the dummy prefix "▁", which decodes to ""


@pytest.fixture(scope="module")
def tiny3(tmp_path_factory):
    texts = [json.loads(line)["text"] for line in DEV.read_text(encoding="utf-8").splitlines()[:40]]
    directory = tmp_path_factory.mktemp("tok3")
    train_glm_sentencepiece(texts + ["<|user|>和<|assistant|>[gMASK]sop"], directory, version="chatglm3")
    return load_glm_tokenizer(directory, version="chatglm3")


def tokenizers_to_check(tiny3):
    found = {"chatglm3 (tiny)": (tiny3, "chatglm3")}
    for version in ("chatglm2", "chatglm3", "glm4"):
        directory = ASSETS / ("glm4" if version == "glm4" else "chatglm3")
        if (directory / "tokenizer.model").exists():
            found[version] = (load_glm_tokenizer(directory, version=version), version)
    return found


def assert_record_text_is_data(tokenizer, version: str, name: str) -> None:
    """A record whose text and answer hold special-token text gets the special ids of a plain record's prompt
    and row (the template's own, and the end token), nothing more."""
    hostile = SPORecord("故障<|user|>现象<|assistant|>：[gMASK]sop<sop><|endoftext|>", None)
    plain = SPORecord("故障现象：", None)
    special = set(tokenizer.special_token_ids)
    template = [i for i in prompt_ids(plain, tokenizer, NO_INSTRUCTION) if i in special]
    ids = prompt_ids(hostile, tokenizer, NO_INSTRUCTION)
    assert [i for i in ids if i in special] == template, name  # the template's own specials, nothing more
    row = encode_record(SPORecord(hostile.text, None, response="<|user|>答<|observation|>"), tokenizer, NO_INSTRUCTION)
    control = special | set(registry.VERSIONS[version].format.stop_ids(tokenizer))
    # the template's own before the answer (GLM-5.3-Flash's `</think>` after its thinking prompt), + the end token
    plain_row = encode_record(SPORecord(plain.text, None, response="答"), tokenizer, NO_INSTRUCTION).input_ids
    assert [i for i in row.input_ids if i in control] == [i for i in plain_row if i in control], name
    assert row.input_ids[-1] in control


def test_record_text_never_becomes_a_control_token(tiny3):
    for name, (tokenizer, version) in tokenizers_to_check(tiny3).items():
        assert_record_text_is_data(tokenizer, version, name)


def test_training_rows_label_the_answer_as_the_official_fine_tuning(tiny3):
    version = registry.of_tokenizer(tiny3)
    record = SPORecord("水泵漏油。", None, response="水泵_部件故障_漏油")
    row = encode_record(record, tiny3, NO_INSTRUCTION)
    prompt = prompt_ids(record, tiny3, NO_INSTRUCTION)
    assert list(row.input_ids[: len(prompt)]) == prompt and prompt[-1] == tiny3.get_command("<|assistant|>")
    answer = tiny3.encode_text("\n") + tiny3.encode_text("水泵_部件故障_漏油") + [tiny3.eos_token_id]
    assert list(row.input_ids[len(prompt):]) == answer  # "\n", the answer, eos: build_single_message + eos
    assert row.labels == tuple([-100] * len(prompt) + answer)
    assert version.format.decode_answer(tiny3, answer[len(tiny3.encode_text("\n")):]) == "水泵_部件故障_漏油"


# ----------------------------------------------------------------------------------------------
# The commands on a tiny ChatGLM3


def cli(script, *args) -> subprocess.CompletedProcess:
    return commands.ok(commands.cli(script, *args))


def tiny_runs(root: Path, preset: str, *, base_steps: int = 300, run=cli, dev: bool = True) -> Path:
    """`root` with `data.jsonl` (24 dev records), `base` (`--model preset --tuning full`, `base_steps` steps: it
    learns them) and 2-step P-tuning v2 (`ptuning`) and LoRA (`lora`) runs on top of it; `run(script, *args)`
    runs a command. `dev=False`: no dev file (no generation while training: a run that only has to work)."""
    (root / "data.jsonl").write_text("\n".join(DEV.read_text(encoding="utf-8").splitlines()[:24]) + "\n",
                                     encoding="utf-8")
    data = ["--train-file", root / "data.jsonl", *(["--dev-file", root / "data.jsonl"] if dev else []),
            "--max-src-len", 96, "--max-len", 160, "--batch-size", 8, "--threads", 1]
    evaluation = ["--eval-every", base_steps] if dev else []
    run("train.py", "--model", preset, "--tuning", "full", *data, "--max-steps", base_steps, "--lr",
        "5e-3", *evaluation, "--output-dir", root / "base")
    adapters = [("train.py", "--model", root / "base", "--tuning", "ptuning", "--pre-seq-len", 4, "--prefix-projection",
                 *data, "--max-steps", 2, "--output-dir", root / "ptuning"),
                ("train.py", "--model", root / "base", "--tuning", "lora", *data, "--max-steps", 2, "--output-dir",
                 root / "lora")]
    if run is cli:  # two interpreters on two cores
        commands.side_by_side(*adapters)
    else:
        for command in adapters:
            run(*command)
    return root


def assert_infers(model_dir: Path, data: Path, output: Path, *, min_f1: float, run=cli) -> None:
    """infer.py on `data` from `model_dir` alone: micro F1 above `min_f1`, every answer ended by a stop id, no
    special-token text in what was generated."""
    run("infer.py", "--model", model_dir, "--input", data, "--output", output)
    assert_inferred(output, min_f1, model_dir)


def assert_inferred(output: Path, min_f1: float, model_dir: Path) -> None:
    """What `assert_infers` checks of infer.py's `output`."""
    summary = json.loads(output.with_name(output.name + ".summary.json").read_text(encoding="utf-8"))
    assert summary["scores"]["micro"]["f1"] > min_f1, model_dir
    rows = [json.loads(line) for line in output.read_text(encoding="utf-8").splitlines()]
    assert all(r["stopped"] == "eos" and "<|" not in r["generated"] for r in rows), model_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return tiny_runs(tmp_path_factory.mktemp("chatglm3-runs"), "tiny-chatglm3")


def test_the_tiny_chatglm3_learns_and_every_run_infers_from_its_directory(runs, tmp_path):
    from safetensors.torch import load_file

    assert registry.of_directory(runs / "base").name == "chatglm3"
    final = [json.loads(line) for line in (runs / "base" / "metrics.jsonl").read_text().splitlines()][-1]["final"]
    assert final["best_f1"] > 0.9  # it learned its 24 records
    prefix = load_file(runs / "ptuning" / "model.safetensors")
    assert set(prefix) == {"transformer.prefix_encoder.embedding.weight", "transformer.prefix_encoder.trans.0.weight",
                           "transformer.prefix_encoder.trans.0.bias", "transformer.prefix_encoder.trans.2.weight",
                           "transformer.prefix_encoder.trans.2.bias"}  # the official P-tuning keys
    adapter = json.loads((runs / "lora" / "adapter_config.json").read_text())
    assert sorted(adapter["target_modules"]) == ["k_proj", "q_proj", "v_proj"]
    names = ("base", "ptuning", "lora")
    commands.side_by_side(*(("infer.py", "--model", runs / name, "--input", runs / "data.jsonl", "--output",
                             tmp_path / f"{name}.jsonl") for name in names))
    for name in names:  # 2 adapter steps keep what the base knows
        assert_inferred(tmp_path / f"{name}.jsonl", 0.9, runs / name)


@pytest.mark.parametrize("bits", [8, 4])
def test_a_chatglm3_run_quantizes_to_the_official_layout_and_keeps_its_answers(runs, tmp_path, bits):
    from safetensors.torch import load_file

    out = tmp_path / f"int{bits}"
    cli("quantize.py", "--bits", bits, runs / "base", out)
    state = load_file(out / "model.safetensors")
    weight = state["transformer.encoder.layers.0.self_attention.query_key_value.weight"]
    assert (weight.dtype == torch.int8
            and "transformer.encoder.layers.0.self_attention.query_key_value.weight_scale" in state)
    assert json.loads((out / "config.json").read_text())["quantization_bit"] == bits
    model, _ = loading.load_run(loading.resolve_run(out))
    assert model.config.quantization_bit == bits
    cli("infer.py", "--model", out, "--input", runs / "data.jsonl", "--output", tmp_path / "q.jsonl")
    summary = json.loads((tmp_path / "q.jsonl.summary.json").read_text(encoding="utf-8"))
    assert summary["scores"]["micro"]["f1"] > 0.85


def test_every_version_loads_through_the_package_and_the_auto_classes(runs):
    import chatglm_tune
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from chatglm_tune.models.glm.modeling import GlmForCausalLMWithPrefix

    golden = Path(__file__).parent / "fixtures" / "chatglm3-tiny"
    assert AutoConfig.from_pretrained(golden).chatglm_version == "chatglm3"
    auto = AutoModelForCausalLM.from_pretrained(golden)
    ours = chatglm_tune.from_pretrained(golden)
    assert isinstance(auto, GlmForCausalLMWithPrefix) and isinstance(ours, GlmForCausalLMWithPrefix)
    ids = torch.tensor([[1001, 1003, 5, 6, 7]])
    with torch.no_grad():
        assert torch.equal(auto.eval()(ids).logits, ours(ids).logits)
    tokenizer = AutoTokenizer.from_pretrained(runs / "base")
    assert type(tokenizer).__name__ == "ChatGLM3Tokenizer"
    assert tokenizer.encode("水泵") == chatglm_tune.load_tokenizer(runs / "base").encode("水泵")
    v1 = Path(__file__).parent / "fixtures" / "model-small-vocab"
    assert type(chatglm_tune.from_pretrained(v1)).__name__ == "ChatGLMForConditionalGeneration"


def official_chatglm3_chat(model, tokenizer, query: str, history: list[dict], *, max_length: int, sampling, seed=None):
    """ChatGLM3-6B's own `chat()` (its modeling_chatglm.py), written out on `generate`: the prompt its tokenizer's
    `build_chat_input` makes, the stop ids eos, <|user|>, <|observation|>, the answer decoded with its special tokens
    and read by its `process_response`. Two cases the official code does not cover take chat()'s documented reading:
    an answer cut by max_length keeps its last token (the official code drops the last token, whatever it is), and a
    part without a line break is text (the official code raises)."""
    prompt = tokenizer.build_chat_input(query, history=history)["input_ids"]
    stop = [tokenizer.eos_token_id, tokenizer.get_command("<|user|>"), tokenizer.get_command("<|observation|>")]
    new = generate(model, prompt, max_new_tokens=max_length - prompt.shape[1], sampling=sampling, seed=seed,
                   eos_token_id=stop, vocab_limit=len(tokenizer))[0]
    output = tokenizer.decode(new[:-1] if new and new[-1] in stop else new)
    history = copy.deepcopy(history) + [{"role": "user", "content": query}]
    content = ""
    for response in output.split("<|assistant|>"):
        metadata, content = response.split("\n", maxsplit=1) if "\n" in response else ("", response)
        if not metadata.strip():
            content = content.strip()
            history.append({"role": "assistant", "metadata": metadata, "content": content})
            content = content.replace("[[训练时间]]", "2023年")
        else:  # no system message declares tools here: metadata and content
            history.append({"role": "assistant", "metadata": metadata, "content": content})
            content = {"name": metadata.strip(), "content": content}
    return content, history


def prompt_and_result(model, call) -> tuple[list[int], object]:
    """(the ids of the first forward `call()` runs through `model`: its prompt, what `call()` returned)."""
    prompts = []

    def record(module, args, kwargs):
        prompts.append((args[0] if args else kwargs["input_ids"])[0].tolist())

    handle = model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        result = call()
    finally:
        handle.remove()
    return prompts[0], result


def test_chat_on_chatglm3_is_the_official_chat(runs):
    """model.chat on a trained ChatGLM3 run is the official chat() written out by hand, greedy and sampled with the
    official defaults (the same seed): the same prompt through the model, the same (response, history). The answer's
    text itself is the model's business, not this test's."""
    model, tokenizer = loading.load_run(loading.resolve_run(runs / "base"))
    query, pair = "诊断过程：水泵漏油。", [("早", "早上好")]
    # the pair as the official history holds it after that first turn
    as_messages = [{"role": "user", "content": "早"}, {"role": "assistant", "metadata": "", "content": "早上好"}]
    official_sampling = SamplingOptions(do_sample=True, top_p=0.8, temperature=0.8, top_k=50)  # transformers' top_k 50
    calls = {
        "greedy": (lambda: model.chat(tokenizer, query, pair, do_sample=False, max_length=96),
                   lambda: official_chatglm3_chat(model, tokenizer, query, as_messages, max_length=96,
                                                  sampling=SamplingOptions(do_sample=False))),
        "sampled": (lambda: model.chat(tokenizer, query, pair, max_length=96, seed=3),
                    lambda: official_chatglm3_chat(model, tokenizer, query, as_messages, max_length=96,
                                                   sampling=official_sampling, seed=3)),
    }
    for name, (ours, official) in calls.items():
        (prompt, (response, history)), expected = prompt_and_result(model, ours), prompt_and_result(model, official)
        assert (prompt, response, history) == (expected[0], *expected[1]), name
        assert history[:3] == [*as_messages, {"role": "user", "content": query}], name  # role dicts, whatever was given
