"""The engines run what export.py writes (bench/export/export_engines.py measures; this asserts what it must reach):
llama.cpp on tiny ChatGLM3, GLM-4, GLM-4-0414 (llama.cpp's `glm4` architecture) and GLM-Edge runs, full and
LoRA-merged, and chatglm.cpp on a tiny ChatGLM-6B run; llama.cpp's own llama-server asks a run's GGUF as infer.py
does and answers greedily unless told otherwise.

llama-cpp-python, chatglm-cpp and llama-server are optional builds; without them these tests skip, saying how to
install them."""

from __future__ import annotations

import json
import urllib.request

import pytest

pytest.importorskip("gguf", reason='the export extra is not installed: pip install -e ".[export]"')
from bench.export import export_engines as engines  # noqa: E402
from bench.serve.serve_servers import LLAMA_SERVER_BUILD, find_llama_server, llama_server  # noqa: E402


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine-runs")
    return root, engines.make_runs(root)


@pytest.mark.skipif(not engines.installed("llama_cpp"),
                    reason=f"llama-cpp-python is not installed: {engines.LLAMA_INSTALL}")
@pytest.mark.parametrize("name", ["chatglm3-full", "chatglm3-lora", "glm4-full", "glm4-lora", "glm4-0414-full",
                                  "glm4-0414-lora", "glm-edge-full", "glm-edge-lora"])
def test_llama_cpp_runs_the_gguf_as_the_toolkit(runs, name):
    root, found = runs
    directory, lora = found[name]
    r = engines.check_llama(directory, lora, root, n_plain=250, n_chat=50, n_prompts=20)
    assert r["tokenization_equal"] == r["strings"] == 300, r
    assert r["f16_greedy_equal"] == r["prompts"] == 20, r
    assert r["toolkit_distinct_tokens"] > 3, r  # the runs answer, not one token over and over
    assert r["q8_0_steps_equal"] >= 0.9, r
    # every first token as the toolkit's, but where the toolkit's own top-2 are a near tie that q8_0 may reverse
    assert r["q8_0_first_top1_equal"] or r["q8_0_first_unequal_margin"] < engines.Q8_NEAR_TIE, r
    assert r["q4_0_generated"] == engines.NEW_TOKENS, r


@pytest.mark.skipif(not engines.installed("chatglm_cpp"), reason=f"chatglm-cpp is not installed: {engines.CPP_INSTALL}")
def test_chatglm_cpp_runs_the_chatglm6b_ggml_file_as_the_toolkit(runs):
    root, found = runs
    r = engines.check_chatglm_cpp(found["chatglm-full"][0], root, n_prompts=20)
    assert r["f16_greedy_equal"] == r["prompts"] == 20, r
    assert r["toolkit_distinct_tokens"] > 3, r


def post(base: str, path: str, body: dict) -> dict:
    request = urllib.request.Request(base + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


@pytest.mark.skipif(find_llama_server() is None,
                    reason=f"no llama-server ($LLAMA_SERVER or on PATH): {LLAMA_SERVER_BUILD}")
@pytest.mark.parametrize("name", ["chatglm3-lora", "glm4-lora", "glm4-0414-lora"])
def test_llama_server_asks_a_run_as_infer_and_answers_greedily_by_default(runs, tmp_path, name):
    """The GGUF's chat template puts the run's instruction before the user's text (the ids infer.py feeds), and its
    sampling defaults are greedy: requests with no temperature give one answer, whatever their seed."""
    from chatglm_tune.runs import loading

    root, found = runs
    run = found[name][0]
    gguf = engines.export_file(run, root / f"{name}-gguf-f16", "gguf", "f16")
    source = loading.resolve_run(run)
    tokenizer = loading.load_tokenizer(source)
    expected = engines.prompts(tokenizer, source, 3)  # infer.py's prompts of the last 3 dev records
    server = llama_server(find_llama_server(), gguf, 1, 1, 512, tmp_path, prompt_of=lambda text: text)
    server.start(timeout=120)
    try:
        texts = [json.loads(line)["text"] for line in
                 (engines.REPO / "data" / "spo_dev.jsonl").read_text(encoding="utf-8").splitlines()[-3:]]  # the same
        for text, ids in zip(texts, expected):
            prompt = post(server.base, "/apply-template", {"messages": [{"role": "user", "content": text}]})["prompt"]
            assert post(server.base, "/tokenize", {"content": prompt, "parse_special": True})["tokens"] == ids
        chat = {"messages": [{"role": "user", "content": texts[0]}], "max_tokens": 12}
        answers = {post(server.base, "/v1/chat/completions", {**chat, "seed": seed})["choices"][0]["message"]["content"]
                   for seed in (1, 2, 3)}
        greedy = post(server.base, "/v1/chat/completions",
                      {**chat, "temperature": 0})["choices"][0]["message"]["content"]
        assert answers == {greedy}
    finally:
        server.stop()


@pytest.mark.skipif(find_llama_server() is None,
                    reason=f"no llama-server ($LLAMA_SERVER or on PATH): {LLAMA_SERVER_BUILD}")
@pytest.mark.parametrize("version", ["chatglm3", "glm4", "glm4-0414"])
def test_llama_server_writes_openai_tool_conversations_as_serve_does(tmp_path, version):
    """Tool conversations in OpenAI's form (tools, an assistant's tool_calls with arguments as a JSON string, tool
    results), rendered by llama-server with the GGUF's template and tokenized with special tokens parsed, give
    serve.py's prompt ids for the same request body (llama-server parses the arguments into an object first)."""
    from serving import tiny_model
    from test_export import TOOL_BODIES, serve_prompt

    directory = tiny_model(version, tmp_path / version)
    gguf = engines.export_file(directory, tmp_path / "gguf", "gguf", "f16")
    server = llama_server(find_llama_server(), gguf, 1, 1, 512, tmp_path, prompt_of=lambda text: text)
    server.start(timeout=120)
    try:
        for body in TOOL_BODIES:
            prompt = post(server.base, "/apply-template", body)["prompt"]
            ids = post(server.base, "/tokenize", {"content": prompt, "parse_special": True})["tokens"]
            assert ids == serve_prompt(directory, body), (body, prompt)
    finally:
        server.stop()
