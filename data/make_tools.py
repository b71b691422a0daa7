"""Generate the shipped synthetic tool-calling set: Chinese requests that a tool answers, in ChatGLM3's fine-tuning
format (`tools` + `conversations`, read by chatglm_tune/data/dialogues.py).

    python data/make_tools.py                         # writes data/tools_train.jsonl, data/tools_dev.jsonl
    python data/make_tools.py --form messages         # GLM-4's form: data/tools_glm4_train.jsonl, ..._dev.jsonl
    python data/make_tools.py --form agent            # OpenAI-style, thinking: data/tools_agent_train.jsonl, ...
    python data/make_tools.py --train-size 200 --out-dir /tmp/x

Three tools, every record declaring all three:

    get_weather(city)                 北京今天天气怎么样？     -> tool_call(city='北京')
    get_time(city)                    现在东京几点了？          -> tool_call(city='东京')
    convert_currency(amount, to)      把100元换成美元。         -> tool_call(amount=100, to='美元')

A train record is the whole exchange: the user's request, the tool turn (the call and the tool's result), then
the assistant's answer built from the result; one in five asks something no tool serves and is answered in
plain text ("loss" on every assistant turn, as the official demo trains). A dev record ends with the call (a
last tool turn with no observation): its gold answer is the call, which a tool-call exact match scores (right
tool, right arguments). The set is built to be learnable by a tiny model trained from scratch: every argument
is a span copy from the request, through a handful of templates a tool. Deterministic for a seed.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

# Defaults: the one place for them (the CLI shows them in --help).
DEFAULT_SEED = 20261128
DEFAULT_TRAIN_SIZE = 2000
DEFAULT_DEV_SIZE = 100
# the data formats, each with its files' default prefix
FORMS = {"conversations": "tools", "messages": "tools_glm4", "agent": "tools_agent"}
DATA_DIR = Path(__file__).resolve().parent

# Short definitions: every record carries all three in its system prompt (the official JSON, 4-space indent),
# and a tiny model reads that prompt at every step.
TOOLS = [
    {"name": "get_weather", "description": "查天气", "parameters": {"city": "城市"}},
    {"name": "get_time", "description": "查时间", "parameters": {"city": "城市"}},
    {"name": "convert_currency", "description": "换算人民币", "parameters": {"amount": "金额", "to": "货币"}},
]
CITIES = ["北京", "上海", "广州", "深圳", "杭州", "成都", "武汉", "西安", "南京", "重庆", "东京", "纽约",
          "伦敦", "巴黎"]
CURRENCIES = ["美元", "欧元", "日元", "英镑", "港币", "韩元"]
WEATHER = ["晴", "多云", "小雨", "阴", "大风", "雷阵雨"]
ASKS = {
    "get_weather": ["{city}今天天气怎么样？", "帮我查一下{city}的天气。", "{city}下雨吗？",
                    "明天去{city}，那边天气如何？"],
    "get_time": ["现在{city}几点了？", "{city}现在是什么时间？", "帮我看看{city}的当地时间。"],
    "convert_currency": ["把{amount}元换成{to}。", "{amount}块人民币能换多少{to}？",
                         "帮我算一下{amount}元等于多少{to}。"],
}
CHATS = [("你好", "你好！我可以帮你查天气、查时间和换算货币。"), ("谢谢你", "不客气！"),
         ("你会做什么？", "我可以查询城市天气、当地时间，也能换算人民币。"), ("再见", "再见，祝你愉快！")]


def call_of(rng: random.Random) -> tuple[str, dict, str]:
    """(tool, arguments, the user's request)."""
    tool = rng.choice(list(ASKS))
    if tool == "convert_currency":
        arguments = {"amount": rng.choice([10, 50, 100, 200, 500, 1000, 2500]), "to": rng.choice(CURRENCIES)}
    else:
        arguments = {"city": rng.choice(CITIES)}
    return tool, arguments, rng.choice(ASKS[tool]).format(**arguments)


def result_of(tool: str, arguments: dict, rng: random.Random) -> tuple[dict, str]:
    """(what the tool returns, the assistant's answer from it)."""
    if tool == "get_weather":
        result = {"weather": rng.choice(WEATHER), "temperature": rng.randint(-5, 35)}
        return result, f"{arguments['city']}今天{result['weather']}，气温{result['temperature']}度。"
    if tool == "get_time":
        result = {"time": f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}"}
        return result, f"{arguments['city']}现在是{result['time']}。"
    result = {"result": round(arguments["amount"] * rng.uniform(0.01, 20), 2)}
    return result, f"{arguments['amount']}元约等于{result['result']}{arguments['to']}。"


def record(rng: random.Random, *, dev: bool) -> dict:
    if not dev and rng.random() < 0.2:
        query, answer = rng.choice(CHATS)
        return {"tools": TOOLS, "conversations": [{"role": "user", "content": query},
                                                  {"role": "assistant", "content": answer}]}
    tool, arguments, query = call_of(rng)
    call = {"role": "tool", "name": tool, "parameters": arguments}
    if dev:
        return {"tools": TOOLS, "conversations": [{"role": "user", "content": query}, call]}
    result, answer = result_of(tool, arguments, rng)
    return {"tools": TOOLS, "conversations": [{"role": "user", "content": query}, {**call, "observation": result},
                                              {"role": "assistant", "content": answer}]}


def as_messages(record: dict) -> dict:
    """The same conversation in GLM-4's fine-tuning format: the tools (each `{"type": "function", "function": ...}`)
    in a first system message, a call as an assistant message whose metadata names the tool and whose content is
    the arguments as JSON, the tool's result as an observation."""
    messages = [{"role": "system", "content": "",
                 "tools": [{"type": "function", "function": t} for t in record["tools"]]}]
    for turn in record["conversations"]:
        if turn["role"] != "tool":
            messages.append(turn)
            continue
        messages.append({"role": "assistant", "metadata": turn["name"],
                         "content": json.dumps(turn["parameters"], ensure_ascii=False)})
        if "observation" in turn:
            messages.append({"role": "observation", "content": json.dumps(turn["observation"], ensure_ascii=False)})
    return {"messages": messages}


# The agent form's tools: OpenAI functions with JSON-schema parameters (what a call's arguments are checked and
# typed by).
AGENT_TOOLS = [{"type": "function", "function": {
    "name": t["name"], "description": t["description"],
    "parameters": {"type": "object", "properties": {k: {"type": "integer" if k == "amount" else "string",
                                                        "description": v} for k, v in t["parameters"].items()},
                   "required": list(t["parameters"])}}} for t in TOOLS]
REASONS = {"get_weather": "用户问天气，查{city}。", "get_time": "用户问时间，查{city}。",
           "convert_currency": "换算{amount}元到{to}。"}


def as_agent(record: dict) -> dict:
    """The same conversation as the agent GLMs (GLM-4.5 / 4.7, GLM-4.7-Flash) are tuned on: OpenAI-style messages
    with thinking on, the tools at the top with JSON-schema parameters; each assistant turn reasons first (a short
    sentence), a call is `tool_calls` and its result a `tool` message."""
    messages = []
    for turn in record["conversations"]:
        if turn["role"] == "user":
            messages.append(turn)
        elif turn["role"] == "assistant":
            after_result = messages[-1]["role"] == "tool"
            reasoning = "根据结果回答。" if after_result else "闲聊，直接回答。"
            messages.append({"role": "assistant", "reasoning_content": reasoning, "content": turn["content"]})
        else:
            messages.append({"role": "assistant", "content": "",
                             "reasoning_content": REASONS[turn["name"]].format(**turn["parameters"]),
                             "tool_calls": [{"type": "function", "function": {"name": turn["name"],
                                                                              "arguments": turn["parameters"]}}]})
            if "observation" in turn:
                messages.append({"role": "tool", "content": json.dumps(turn["observation"], ensure_ascii=False)})
    return {"tools": AGENT_TOOLS, "messages": messages}


def write(path: Path, records: list[dict]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    tmp.replace(path)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--out-dir", type=Path, default=DATA_DIR, help="directory the two files are written to")
    parser.add_argument("--train-size", type=int, default=DEFAULT_TRAIN_SIZE, help="records in the train file")
    parser.add_argument("--dev-size", type=int, default=DEFAULT_DEV_SIZE, help="records in the dev file")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help="random seed (dev uses seed + 1)")
    parser.add_argument("--form", choices=FORMS, default="conversations",
                        help="conversations: ChatGLM3's tools + conversations; messages: GLM-4's messages; agent: "
                             "OpenAI-style messages with reasoning (GLM-4.5 / 4.7, GLM-4.7-Flash)")
    parser.add_argument("--prefix", help="file names are <prefix>_train.jsonl and <prefix>_dev.jsonl (default: "
                                         + ", ".join(f"{prefix} for {form}" for form, prefix in FORMS.items()) + ")")
    args = parser.parse_args(argv)
    prefix = args.prefix or FORMS[args.form]
    shape = {"messages": as_messages, "agent": as_agent}.get(args.form, dict)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for part, size, seed in (("train", args.train_size, args.seed), ("dev", args.dev_size, args.seed + 1)):
        rng = random.Random(seed)
        path = args.out_dir / f"{prefix}_{part}.jsonl"
        write(path, [shape(record(rng, dev=part == "dev")) for _ in range(size)])
        print(f"wrote {size} records to {path}")


if __name__ == "__main__":
    main()
