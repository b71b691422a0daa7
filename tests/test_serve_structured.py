"""Constrained decoding: an answer held to a grammar (`chatglm_tune.decoding.grammar`), and what clients ask of it
through serve.py: `response_format` (the openai SDK's `chat.completions.parse`, LangChain's `with_structured_output`
by JSON schema or by function calling), and a `tool_choice` that names a function or requires one of several.

A tiny random model never closes a free JSON string by chance, so the schemas here bound their strings (`maxLength`)
and numbers: a grammar then ends every answer within its budget, and every one must parse and validate.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import pytest

pytest.importorskip("starlette", reason='the server needs its extra: pip install -e ".[serve]"')
pytest.importorskip("uvicorn", reason='the server needs its extra: pip install -e ".[serve]"')
pytest.importorskip("llguidance", reason='constrained decoding needs llguidance: pip install -e ".[serve]"')
openai = pytest.importorskip("openai", reason="the tests call the server with the official client: pip install openai")
pydantic = pytest.importorskip("pydantic", reason="the openai client's parse() takes a pydantic model")

from chatglm_tune.data.batches import SpecialIds  # noqa: E402
from chatglm_tune.decoding import grammar  # noqa: E402
from chatglm_tune.decoding.engine import Engine  # noqa: E402
from chatglm_tune.decoding.request import Request  # noqa: E402
from chatglm_tune.models import registry  # noqa: E402
from chatglm_tune.options import SamplingOptions  # noqa: E402
from serving import TEXTS, tiny_model  # noqa: E402
from test_serve import serving  # noqa: E402

PROMPTS = 20
SAMPLED = SamplingOptions(do_sample=True, temperature=0.9, top_p=0.9)


class Triple(pydantic.BaseModel):
    subject: str = pydantic.Field(max_length=6)
    relation: Literal["位于", "属于", "包含"]
    object: str = pydantic.Field(max_length=6)
    score: int = pydantic.Field(ge=0, le=9)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Tiny model directories by version, made once; `context`: their configs' context raised to it (a tool
    prompt of GLM-4's template outgrows the tiny 512 tokens)."""
    made = {}

    def directory(version, context: int | None = None):
        key = (version, context)
        if key not in made:
            path = tiny_model(version, tmp_path_factory.mktemp(version))
            if context:
                config = json.loads((path / "config.json").read_text())
                for name in ("seq_length", "max_position_embeddings", "max_sequence_length"):
                    if name in config:
                        config[name] = context
                (path / "config.json").write_text(json.dumps(config))
            made[key] = path
        return made[key]

    return directory


def asks(i: int) -> dict:
    """The i-th prompt, greedy for even i, sampled (seeded i) for odd."""
    text = TEXTS[i % len(TEXTS)][:30]
    return dict(model="tiny", messages=[{"role": "user", "content": f"抽取三元组：{text}"}], max_tokens=200, seed=i,
                temperature=0 if i % 2 == 0 else 0.9)


# ----------------------------------------------------------------------------------------------
# The grammar on the engine, every version


@pytest.mark.parametrize("version", sorted(registry.VERSIONS))
def test_token_bytes_spell_what_the_tokenizer_decodes(version, tmp_path):
    """Each version's `token_bytes`: the bytes of an answer's ids are the text the tokenizer decodes them to (a
    SentencePiece answer's first `▁` aside, which decoding drops)."""
    _, tokenizer = registry.VERSIONS[version].tiny(TEXTS, tmp_path)
    table = tokenizer.token_bytes()
    for text in [*TEXTS[:20], "a  b\n\tc 42, {\"k\": [1]}"]:
        ids = [i for i in tokenizer.encode(text, add_special_tokens=False) if table[i] is not None]
        spelled = b"".join(table[i] for i in ids).decode("utf-8", errors="replace")
        assert spelled.removeprefix(" ") == tokenizer.decode(ids).removeprefix(" "), (text, ids)


@pytest.mark.parametrize("version", sorted(registry.VERSIONS))
def test_a_grammar_of_one_sentence_is_the_answer_greedy_and_sampled(version, tmp_path):
    """A grammar that allows one text makes the engine's answer that text, then a stop id: whatever a random model
    prefers, greedy or sampled, for every tokenizer (CJK, spaces, newlines, digits, punctuation)."""
    model, tokenizer = registry.VERSIONS[version].tiny(TEXTS, tmp_path)
    text = TEXTS[0][:6] + " 是 42,\n好"
    lark = grammar.lark([(text, "")])
    engine = Engine(model, SpecialIds.of(tokenizer), vocab_limit=len(tokenizer))
    stop = tokenizer.prompt_format.stop_ids(tokenizer)
    answers = {}
    for i, sampling in enumerate((SamplingOptions(), SAMPLED)):
        ids = answers.setdefault(i, [])
        engine.submit(Request(tokenizer.encode("你好"), 60, on_token=ids.append, on_finish=lambda *_: None,
                              sampling=sampling, seed=i, stop_ids=stop,
                              constraint=grammar.Constraint(lark, tokenizer, model.config.vocab_size)))
    while not engine.idle:
        engine.step()
    for ids in answers.values():
        assert ids[-1] in stop and tokenizer.decode(ids[:-1]).removeprefix(" ") == text, tokenizer.decode(ids)


def test_a_schema_llguidance_cannot_use_is_a_grammar_error():
    tokenizer = registry.load_tokenizer(tiny_model("glm4", Path(pytest.importorskip("tempfile").mkdtemp())))
    with pytest.raises(grammar.GrammarError):
        grammar.check(grammar.lark([("", grammar.json_rule({"type": "strng"}))]), tokenizer, 1000)


# ----------------------------------------------------------------------------------------------
# response_format through the openai SDK


@pytest.mark.parametrize("version", ["chatglm", "chatglm2", "chatglm3", "glm4", "glm4-0414", "glm4-moe"])
def test_parse_returns_the_object_for_every_prompt(version, models):
    """`chat.completions.parse(response_format=<pydantic model>)`: a parsed object for 20 of 20 prompts, greedy
    and sampled; `json_object` gives a JSON object; a stream's text is the same JSON."""
    with serving(models(version)) as s:
        client = s.client()
        parsed = [client.chat.completions.parse(response_format=Triple, **asks(i)).choices[0].message.parsed
                  for i in range(PROMPTS)]
        assert all(isinstance(p, Triple) for p in parsed), parsed
        reply = client.chat.completions.create(response_format={"type": "json_object"}, **{**asks(0), "max_tokens": 8})
        content = reply.choices[0].message.content
        assert reply.choices[0].finish_reason == "length" or isinstance(json.loads(content), dict), content
        schema = {"type": "json_schema", "json_schema": {"name": "Triple", "schema": Triple.model_json_schema()}}
        whole = client.chat.completions.create(response_format=schema, **asks(1)).choices[0].message.content
        chunks = client.chat.completions.create(response_format=schema, stream=True, **asks(1))
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert streamed == whole and Triple.model_validate_json(streamed)


def test_bad_response_formats_are_400_naming_it(models):
    with serving(models("glm4")) as s:
        client = s.client()
        cases = [({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strng"}}},
                  "response_format"),
                 ({"type": "json_schema", "json_schema": {"name": "x", "schema": "{}"}}, "response_format.json_schema"),
                 ({"type": "yaml"}, "response_format")]
        for response_format, param in cases:
            with pytest.raises(openai.BadRequestError) as err:
                client.chat.completions.create(response_format=response_format, **asks(0))
            assert err.value.body["param"] == param, (response_format, err.value.body)
        tool = {"type": "function", "function": {"name": "w", "parameters": {"type": "object"}}}
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(response_format={"type": "json_object"}, tools=[tool], **asks(0))
        assert err.value.body["param"] == "response_format"


# ----------------------------------------------------------------------------------------------
# tool_choice: a named function, or one of several required


TOOLS = [{"type": "function", "function": {"name": "w", "parameters": {
             "type": "object", "properties": {"c": {"type": "string", "maxLength": 3},
                                              "d": {"type": "integer", "minimum": 0, "maximum": 9}},
             "required": ["c"]}}},
         {"type": "function", "function": {"name": "t", "parameters": {
             "type": "object", "properties": {"z": {"enum": ["u", "c"]}}, "required": ["z"]}}}]


def valid_arguments(call) -> bool:
    arguments = json.loads(call.function.arguments)
    if call.function.name == "t":
        return arguments in ({"z": "u"}, {"z": "c"})
    return (set(arguments) <= {"c", "d"} and isinstance(arguments["c"], str) and len(arguments["c"]) <= 3
            and (0 <= arguments.get("d", 0) <= 9))


@pytest.mark.parametrize("version", ["chatglm3", "glm4", "glm4-0414"])
def test_a_forced_tool_choice_is_a_call_with_arguments_of_its_schema(version, models):
    """A named function (ChatGLM3: Python keywords, GLM-4: JSON) and "required" among two: every answer is a call to
    a declared tool, its arguments those the schema allows, greedy and sampled."""
    with serving(models(version, context=2048)) as s:
        client = s.client()
        for choice in ({"type": "function", "function": {"name": "w"}}, "required"):
            for i in range(6):
                message = client.chat.completions.create(tools=TOOLS, tool_choice=choice, **asks(i)).choices[0].message
                assert message.tool_calls and len(message.tool_calls) == 1, (choice, message)
                call = message.tool_calls[0]
                assert (call.function.name == "w" or choice == "required") and valid_arguments(call), (choice, call)


# ----------------------------------------------------------------------------------------------
# LangChain


@pytest.mark.parametrize("version", ["chatglm3", "glm4"])
def test_langchain_with_structured_output(version, models):
    """LangChain's `with_structured_output`, by JSON schema (response_format) and by function calling (a named tool):
    the object for 20 of 20 prompts each."""
    chat_openai = pytest.importorskip("langchain_openai", reason="pip install langchain-openai").ChatOpenAI
    with serving(models(version, context=2048)) as s:
        for method in ("json_schema", "function_calling"):
            llm = chat_openai(model="tiny", base_url=f"{s.url}/v1", api_key="unused", max_retries=0, max_tokens=200,
                              temperature=0)
            structured = llm.with_structured_output(Triple, method=method)
            answers = [structured.invoke(asks(i)["messages"][0]["content"]) for i in range(PROMPTS)]
            assert all(isinstance(a, Triple) for a in answers), (method, answers)
