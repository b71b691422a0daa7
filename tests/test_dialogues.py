"""Conversation records in the official fine-tuning formats: ChatGLM3's `tools` + `conversations` (system, user,
assistant and tool turns) and GLM-4's `messages` (a system message with tools, assistant calls, observations),
with a loss on every assistant turn unless a turn says `"loss": false`.

The expected rows are written out by the official rules: ChatGLM3's fine-tuning demo builds
`[gMASK] sop` + `build_single_message(role, metadata, content)` for each turn (a tool turn as the assistant's
call, `tool_call(k=v)` in a Python code block under the tool's name, then an observation) + `</s>`; GLM-4's
script renders each message alone with the chat template and drops its `[gMASK] <sop>`, then appends
`<|user|>`. Both label token i with its id where token i-1 belongs to a turn with a loss."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from chatglm_tune.data.batches import IGNORE_INDEX, encode_record
from chatglm_tune.data.dialogues import TOOL_PROMPT, ToolCall
from chatglm_tune.data.records import RecordError, read_records
from chatglm_tune.models import registry
from chatglm_tune.options import EncodingOptions
from serving import TEXTS

ASSETS = Path(__file__).resolve().parents[2] / "shared" / "assets"
GOLDEN = json.loads((Path(__file__).parent / "fixtures" / "tokenizer-glm.json").read_text(encoding="utf-8"))
WIDE = EncodingOptions(prompt="", max_src_len=1000, max_len=2000)
TOOLS3 = [{"name": "get_weather", "description": "查询城市天气", "parameters": {"city": {"type": "string"}}}]
CHATGLM3_RECORD = {
    "tools": TOOLS3,
    "conversations": [
        {"role": "system", "content": "你是天气助手。"},
        {"role": "user", "content": "北京天气怎么样？"},
        {"role": "tool", "name": "get_weather", "parameters": {"city": "北京"}, "observation": {"temperature": 20}},
        {"role": "assistant", "content": "北京20度。", "loss": False},
        {"role": "user", "content": "上海呢？"},
        {"role": "assistant", "content": "我去查。"},
    ],
}


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    out = {}
    for name in ("chatglm3", "glm4", "chatglm2", "glm4-0414", "glm-edge"):
        _, out[name] = registry.VERSIONS[name].tiny(TEXTS + ["北京天气怎么样？上海呢？我去查。你是天气助手。"],
                                                    tmp_path_factory.mktemp(name))
    return out


def record_of(tmp_path: Path, raw: dict):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps(raw, ensure_ascii=False) + "\n", encoding="utf-8")
    (record,), _ = read_records(path)
    return record


def by_rule(prefix: list[int], blocks: list[tuple[list[int], bool]], end: int) -> tuple[list[int], list[int]]:
    """(ids, labels) of blocks (ids, whether trained) by the official rule."""
    ids, carried = list(prefix), [False] * len(prefix)
    for block, loss in blocks:
        ids += block
        carried += [loss] * len(block)
    ids.append(end)
    return ids, [IGNORE_INDEX] + [t if c else IGNORE_INDEX for t, c in zip(ids[1:], carried)]


def test_a_chatglm3_conversation_with_tools_is_the_finetune_demos_row(tokenizers, tmp_path):
    tok = tokenizers["chatglm3"]
    block = tok.build_single_message
    row = encode_record(record_of(tmp_path, CHATGLM3_RECORD), tok, WIDE)
    system = TOOL_PROMPT + json.dumps(TOOLS3, indent=4, ensure_ascii=False)
    ids, labels = by_rule(tok.get_prefix_tokens(), [
        (block("system", "", system), False),
        (block("system", "", "你是天气助手。"), False),
        (block("user", "", "北京天气怎么样？"), False),
        (block("assistant", "get_weather", "```python\ntool_call(city='北京')\n```"), True),
        (block("observation", "", '{"temperature": 20}'), False),
        (block("assistant", "", "北京20度。"), False),
        (block("user", "", "上海呢？"), False),
        (block("assistant", "", "我去查。"), True),
    ], tok.eos_token_id)
    assert (list(row.input_ids), list(row.labels)) == (ids, labels)
    command = tok.get_command
    at = [i for i, t in enumerate(ids) if t in (command("<|assistant|>"), command("<|observation|>"),
                                                command("<|user|>"))]
    trained = {ids[i] for i in at if labels[i] != IGNORE_INDEX}
    # the call is trained through the <|observation|> that ends it, the last answer through </s>; no <|assistant|>
    # and no token of the answer marked "loss": false (nor the <|user|> after it) is a label
    assert trained == {command("<|observation|>")} and labels[-1] == tok.eos_token_id
    call = block("assistant", "get_weather", "```python\ntool_call(city='北京')\n```")
    assert sum(label != IGNORE_INDEX for label in labels) == len(call) + len(block("assistant", "", "我去查。"))


def test_loss_on_last_trains_the_last_answer_only(tokenizers, tmp_path):
    tok = tokenizers["chatglm3"]
    record = record_of(tmp_path, CHATGLM3_RECORD)
    every, last = (encode_record(record, tok, EncodingOptions(prompt="", max_src_len=1000, max_len=2000, loss_on=on))
                   for on in ("all", "last"))
    assert every.input_ids == last.input_ids
    tail = len(tok.build_single_message("assistant", "", "我去查。"))
    assert [i for i, label in enumerate(last.labels) if label != IGNORE_INDEX] == list(range(len(last.labels) - tail,
                                                                                              len(last.labels)))


def test_a_plain_conversation_trains_every_answer_and_last_keeps_the_earlier_row(tokenizers, tmp_path):
    tok = tokenizers["chatglm3"]
    turns = [{"role": "user", "content": "你好"}, {"role": "assistant", "content": "你好！"},
             {"role": "user", "content": "北京天气怎么样？"}, {"role": "assistant", "content": "晴。"}]
    record = record_of(tmp_path, {"conversations": turns})
    every = encode_record(record, tok, WIDE)
    last = encode_record(record, tok, EncodingOptions(prompt="", max_src_len=1000, max_len=2000, loss_on="last"))
    block = tok.build_single_message
    assert (list(every.input_ids), list(every.labels)) == by_rule(
        tok.get_prefix_tokens(), [(block(t["role"], "", t["content"]), t["role"] == "assistant") for t in turns],
        tok.eos_token_id)
    # the history-and-query row as before: the same ids, the last answer trained
    assert last.input_ids == every.input_ids
    assert sum(label != IGNORE_INDEX for label in last.labels) == len(block("assistant", "", "晴。"))


def test_glm4_messages_are_each_rendered_alone_by_the_chat_template(tokenizers, tmp_path):
    tok = tokenizers["glm4"]
    messages = [{"role": "user", "content": "你好"}, {"role": "assistant", "content": "你好！", "loss": False},
                {"role": "user", "content": "上海呢？"}, {"role": "assistant", "content": "我去查。"}]
    row = encode_record(record_of(tmp_path, {"messages": messages}), tok, WIDE)
    alone = [(tok.encode_chat([{k: v for k, v in m.items() if k != "loss"}], add_generation_prompt=False)[2:],
              m["role"] == "assistant" and m.get("loss", True)) for m in messages]
    assert all(block[0] == tok.get_command(f"<|{m['role']}|>") for (block, _), m in zip(alone, messages))
    assert (list(row.input_ids), list(row.labels)) == by_rule(tok.get_prefix_tokens(), alone,
                                                              tok.get_command("<|user|>"))


def test_glm4_tools_and_calls_render_as_the_official_template_on_the_real_tokenizer(tmp_path):
    """The per-message rows of a conversation with tools, a call and an observation equal, up to the answer, the
    official template's render of the whole conversation (golden ids of GLM-4-9B's own tokenizer)."""
    from chatglm_tune.models.glm.versions import load_glm_tokenizer

    if not (ASSETS / "glm4" / "tokenizer.model").exists():
        pytest.skip(f"{ASSETS / 'glm4'} is absent (the real tokenizers live in shared/ beside the checkout)")
    tok = load_glm_tokenizer(ASSETS / "glm4", version="glm4")
    golden = next(c for c in GOLDEN["glm4"]["chats"] if "tools" in c["messages"][0])
    messages = [*golden["messages"], {"role": "assistant", "content": "北京20度。"}]
    row = encode_record(record_of(tmp_path, {"messages": messages}), tok, WIDE)
    asked = golden["input_ids"]  # [gMASK] <sop> ... <|assistant|>, the generation prompt
    assert list(row.input_ids[: len(asked)]) == asked
    answer = tok.encode_text("\n北京20度。")
    assert list(row.input_ids[len(asked):]) == answer + [tok.get_command("<|user|>")]
    call_end = asked.index(tok.get_command("<|observation|>"))
    trained = [i for i, label in enumerate(row.labels) if label != IGNORE_INDEX]
    assert call_end in trained and trained[-1] == len(row.input_ids) - 1


def test_a_call_is_held_as_its_tool_and_arguments_in_every_form(tmp_path):
    """ChatGLM3's tool turn, GLM-4's metadata call and the `{"name", "arguments"}` content of GLM-4's fine-tuning
    README are calls (an observation may follow each); a text answer is none."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    readme = {"messages": [{"role": "system", "content": "", "tools": tools}, {"role": "user", "content": "q"},
                           {"role": "assistant", "content": '{"name": "get_weather", "arguments": {"city": "北京"}}'},
                           {"role": "observation", "content": "晴"}, {"role": "assistant", "content": "晴天。"}]}
    metadata = {"messages": [*readme["messages"][:2],
                             {"role": "assistant", "metadata": "get_weather", "content": '{"city": "北京"}'}]}
    for raw in (readme, metadata, CHATGLM3_RECORD):
        calls = [t.call for t in record_of(tmp_path, raw).dialogue.turns if t.call is not None]
        assert calls == [ToolCall("get_weather", {"city": "北京"})], raw
    assert record_of(tmp_path, readme).dialogue.answer.call is None
    assert record_of(tmp_path, metadata).dialogue.answer.call == ToolCall("get_weather", {"city": "北京"})


BAD = [
    ({"messages": [{"role": "user", "content": "q"}, {"role": "observation", "content": "{}"}]},
     "observation_without_call", "messages[1].role"),
    ({"tools": TOOLS3, "conversations": [{"role": "user", "content": "q"},
                                         {"role": "tool", "name": "get_time", "parameters": {}, "observation": "1"}]},
     "undeclared_tool", "conversations[1].name"),
    ({"messages": [{"role": "system", "content": "", "tools": [{"type": "function", "function": {"name": "f"}}]},
                   {"role": "user", "content": "q"}, {"role": "assistant", "metadata": "f", "content": "city=北京"}]},
     "bad_arguments", "messages[2].content"),
    ({"messages": [{"role": "system", "content": "", "tools": [{"type": "function", "function": {"name": "f"}}]},
                   {"role": "user", "content": "q"},
                   {"role": "assistant", "content": '{"name": "g", "arguments": {}}'}]},
     "undeclared_tool", "messages[2].content"),
    ({"tools": TOOLS3, "conversations": [{"role": "user", "content": "q"},
                                         {"role": "tool", "name": "get_weather", "parameters": {"class": 1}}]},
     "bad_arguments", "conversations[1].parameters"),
    ({"conversations": [{"role": "user", "content": "q", "loss": True}, {"role": "assistant", "content": "a"}]},
     "bad_loss", "conversations[0].loss"),
    ({"conversations": [{"role": "user", "content": "q"}, {"role": "system", "content": "s"}]},
     "system_turn", "conversations[1].role"),
]


GLM4_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "查询城市天气",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
GLM4_MESSAGES = [
    {"role": "system", "content": "你是天气助手。", "tools": GLM4_TOOLS},
    {"role": "user", "content": "北京天气怎么样？"},
    {"role": "assistant", "metadata": "get_weather", "content": '{"city": "北京"}'},
    {"role": "observation", "content": '{"temperature": 20}'},
    {"role": "assistant", "content": "北京20度。", "loss": False},
    {"role": "user", "content": "上海呢？"},
    {"role": "assistant", "content": "我去查。"},
]


def test_a_glm4_0414_conversation_with_tools_is_its_chat_templates_form(tokenizers, tmp_path):
    """GLM-4-0414's template, written out: the tools (its `tools` argument) as a system block first, "# 可用工具" and
    each function as indented JSON under its name; then each message as `<|role|>` "\n" content, a call as
    `<|assistant|>` name "\n" arguments; rows as GLM-4's script builds them (each message alone, a loss on the
    assistant's, `<|user|>` last); the prompt of the last answer ends at `<|assistant|>`."""
    tok = tokenizers["glm4-0414"]
    command, text = tok.get_command, tok.encode_text
    record = record_of(tmp_path, {"messages": GLM4_MESSAGES})
    row = encode_record(record, tok, WIDE)
    tools = ("\n# 可用工具\n\n## get_weather\n\n" + json.dumps(GLM4_TOOLS[0]["function"], indent=4, ensure_ascii=False)
             + "\n在调用上述函数时，请使用 Json 格式表示调用的参数。")
    blocks = [
        ([command("<|system|>")] + text(tools), False),
        ([command("<|system|>")] + text("\n你是天气助手。"), False),
        ([command("<|user|>")] + text("\n北京天气怎么样？"), False),
        ([command("<|assistant|>")] + text('get_weather\n{"city": "北京"}'), True),
        ([command("<|observation|>")] + text('\n{"temperature": 20}'), False),
        ([command("<|assistant|>")] + text("\n北京20度。"), False),
        ([command("<|user|>")] + text("\n上海呢？"), False),
        ([command("<|assistant|>")] + text("\n我去查。"), True),
    ]
    ids, labels = by_rule(tok.get_prefix_tokens(), blocks, command("<|user|>"))
    assert (list(row.input_ids), list(row.labels)) == (ids, labels)
    prompt = tok.prompt_format.prompt_ids(tok, record, WIDE)[0]
    assert prompt == ids[: len(ids) - len(blocks[-1][0]) - 1] + [command("<|assistant|>")]
    # the chat prompt of the same conversation (tools offered as GLM-4 offers them) is that prompt too
    chat = [{k: v for k, v in m.items() if k != "loss"} for m in GLM4_MESSAGES[:-1]]
    assert tok.prompt_format.chat_ids(tok, chat) == prompt
    plain = tok.prompt_format.chat_ids(tok, [{"role": "user", "content": "上海呢？"}])
    assert plain[-2:] == [command("<|assistant|>")] + text("\n")  # no tools: the template's own generation prompt
    assert tok.prompt_format.tool_call_lead(tok, "get_weather") == text("get_weather\n")


def test_bad_conversations_are_named_by_file_line_and_field(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(json.dumps(raw, ensure_ascii=False) for raw, _, _ in BAD) + "\n", encoding="utf-8")
    _, report = read_records(path, on_bad_record="skip")
    assert report.total == len(BAD)
    for line, (raw, reason, field) in enumerate(BAD, 1):
        one = tmp_path / f"bad{line}.jsonl"
        one.write_text(json.dumps(raw, ensure_ascii=False) + "\n", encoding="utf-8")
        with pytest.raises(RecordError) as caught:
            read_records(one)
        assert (caught.value.reason, caught.value.field) == (reason, field)
        assert str(caught.value).startswith(f"{one}, line 1, field {field!r}: ")


def test_versions_without_a_tool_form_refuse_tool_conversations(tokenizers, tmp_path):
    record = record_of(tmp_path, CHATGLM3_RECORD)
    glm4_form = record_of(tmp_path, {"messages": GLM4_MESSAGES})
    with pytest.raises(ValueError, match="ChatGLM2-6B has no system, tool or observation turns"):
        encode_record(record, tokenizers["chatglm2"], WIDE)
    for each in (record, glm4_form):
        with pytest.raises(ValueError, match="GLM-Edge: its chat template has no tool form"):
            encode_record(each, tokenizers["glm-edge"], WIDE)


def test_the_prompt_of_a_conversation_is_its_turns_before_the_answer(tokenizers, tmp_path):
    """What infer / evaluation feed the model: every turn before the last answer, then `<|assistant|>`."""
    tok = tokenizers["chatglm3"]
    record = record_of(tmp_path, CHATGLM3_RECORD)
    row = encode_record(record, tok, WIDE)
    prompt = tok.prompt_format.prompt_ids(tok, record, WIDE)[0]
    answer = tok.build_single_message("assistant", "", "我去查。")
    assert prompt == list(row.input_ids[: len(row.input_ids) - len(answer) - 1]) + [tok.get_command("<|assistant|>")]


def test_a_conversation_cut_at_max_len_is_counted_and_one_cut_before_any_answer_is_refused(tokenizers, tmp_path):
    tok = tokenizers["chatglm3"]
    record = record_of(tmp_path, CHATGLM3_RECORD)
    full = encode_record(record, tok, WIDE)
    first_label = next(i for i, label in enumerate(full.labels) if label != IGNORE_INDEX)
    cut = encode_record(record, tok, EncodingOptions(prompt="", max_src_len=first_label - 1, max_len=first_label + 1))
    assert cut.row_truncated and not cut.answer_truncated and len(cut.input_ids) == first_label + 1
    assert not full.row_truncated
    with pytest.raises(ValueError,
                       match=f"the conversation is {len(full.input_ids)} tokens and max_len {first_label} cuts"):
        encode_record(record, tok, EncodingOptions(prompt="", max_src_len=first_label - 2, max_len=first_label))


def test_a_conversation_with_nothing_to_train_says_so(tokenizers, tmp_path):
    """GLM-4's template writes nothing for an empty assistant message (an SPO text without triples): the row has no
    trained token, whatever max_len; it was reported as cut by max_len."""
    record = record_of(tmp_path, {"messages": [{"role": "user", "content": "你好"},
                                               {"role": "assistant", "content": ""}]})
    with pytest.raises(ValueError, match="no token of the conversation is trained: its assistant turns with a loss are "
                                         "empty, and GLM-4's chat template writes nothing"):
        encode_record(record, tokenizers["glm4"], WIDE)


def test_the_shipped_tool_sets_are_the_scripts_output_in_both_forms(tmp_path):
    """data/make_tools.py writes data/tools_* (ChatGLM3's conversations) and data/tools_glm4_* (GLM-4's messages):
    the same conversations, every record valid, each dev record ending with its gold call."""
    import runpy

    script = Path(__file__).resolve().parents[1] / "data" / "make_tools.py"
    make = runpy.run_path(str(script))["main"]
    for form, prefix in (("conversations", "tools"), ("messages", "tools_glm4")):
        make(["--out-dir", str(tmp_path), "--form", form, "--train-size", "2000", "--dev-size", "100"])
        for part in ("train", "dev"):
            shipped = script.parent / f"{prefix}_{part}.jsonl"
            assert (tmp_path / shipped.name).read_bytes() == shipped.read_bytes(), shipped
        dev, _ = read_records(script.parent / f"{prefix}_dev.jsonl")
        assert len(dev) == 100 and all(r.dialogue.answer.call is not None for r in dev)
    chatglm3, glm4 = (read_records(script.parent / f"{p}_train.jsonl")[0][:50] for p in ("tools", "tools_glm4"))
    assert [[t.call for t in r.dialogue.turns] for r in chatglm3] == [[t.call for t in r.dialogue.turns] for r in glm4]
