"""Check: the files export.py writes, run by the engines that deploy them (llama.cpp, chatglm.cpp), against the
toolkit on the same tiny train.py runs.

    python bench/export/export_engines.py          # results: bench/results/export-engines.{json,md}, then one JSON line
    python bench/export/export_engines.py --quick  # fewer strings and prompts, results into /tmp

The runs: tiny ChatGLM3, GLM-4, GLM-4-0414 and GLM-Edge full fine-tuning runs (train.py `--model tiny-chatglm3` /
`tiny-glm4` / `tiny-glm4-0414` / `tiny-glm-edge`, 300 steps on 64 SPO records: they answer in the triples' format,
token by token different ids, with confident logits as a trained model has), a LoRA run on each (100 steps on 64
other records, so the merge changes what the model answers), merged by export.py; a tiny ChatGLM-6B full run for
chatglm.cpp. GLM-4-0414 runs as llama.cpp's `glm4` architecture, the others as `chatglm`. Measured per run:
- llama.cpp (llama-cpp-python), GGUF f16: tokenization of 300 strings (250 plain texts, records and answers of the
  SPO data and edge cases, tokenized without special tokens against `encode_text`; 50 chat prompts, the GGUF's
  own chat template rendered and tokenized with special tokens against the toolkit's chat prompt ids), and greedy
  ids of 20 extraction prompts (the run's prompt format, ids fed directly, NEW_TOKENS tokens each, no stop)
  against the toolkit's greedy decoding of the float32 model;
- GGUF q8_0: the share of greedy steps equal to the toolkit's and whether every first step's top-1 is (where one
  is not, the toolkit's own top-1 / top-2 margin at that step: q8_0 moves these runs' first-step logits by up to
  0.12, so a margin under `Q8_NEAR_TIE` is a tie it may break either way); q4_0: that it loads and generates;
- chatglm.cpp 0.4.2, ChatGLM-6B's GGML f16 file: greedy ids of the same prompts (its `generate_next_token`).
llama-cpp-python and chatglm-cpp are optional (built from source; `LLAMA_INSTALL`, `CPP_INSTALL`): without one,
its checks are recorded as skipped, with the command that installs it. tests/test_export_engines.py asserts
the acceptance thresholds on these same functions.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # the repository: chatglm_tune, bench.<room>.<module>

LLAMA_INSTALL = 'CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python   # about 10-15 minutes on 2 cores'
CPP_INSTALL = 'CMAKE_ARGS="-DCMAKE_POLICY_VERSION_MINIMUM=3.5" pip install chatglm-cpp==0.4.2   # about 5 minutes'
NEW_TOKENS = 16
Q8_NEAR_TIE = 0.25  # a first-step top-1 / top-2 logit margin that q8_0's rounding may reverse
FULL_STEPS, LORA_STEPS = 300, 100
EDGE_STRINGS = ["", " ", "  two  spaces", "\n", "line\nbreak\n\n", "\ttab", "数字123456和English混合", "3.1415926",
                "émoji 😀 ü ß", "<|user|> typed", "[gMASK]sop as text", "</s>", "a_b_c", "ＡＢＣ全角",
                "  leading", "trailing  "]


def installed(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


def make_runs(root: Path) -> dict[str, tuple[Path, bool]]:
    """{name: (run directory, is LoRA)}: full runs of the five presets, LoRA runs on all but the ChatGLM-6B one
    (a run already in `root` is kept)."""
    import train as train_cli

    lines = (REPO / "data" / "spo_train.jsonl").read_text(encoding="utf-8").splitlines()
    sets = {}
    for name, part in (("full", lines[:64]), ("lora", lines[64:128])):
        sets[name] = root / f"{name}.jsonl"
        sets[name].write_text("\n".join(part) + "\n", encoding="utf-8")
    flags = ["--max-src-len", 96, "--max-len", 128, "--batch-size", 8, "--threads", 1]

    def train(directory: Path, *args) -> None:
        if not (directory / "run_args.json").exists():
            assert train_cli.main([str(a) for a in (*args, *flags, "--output-dir", directory)]) == 0

    runs = {}
    for version, preset in (("chatglm3", "tiny-chatglm3"), ("glm4", "tiny-glm4"), ("glm4-0414", "tiny-glm4-0414"),
                            ("glm-edge", "tiny-glm-edge"), ("chatglm", "tiny")):
        full = root / f"{version}-full"
        train(full, "--model", preset, "--tuning", "full", "--lr", "4e-3", "--max-steps", FULL_STEPS,
              "--train-file", sets["full"])
        runs[f"{version}-full"] = (full, False)
        if version != "chatglm":
            lora = root / f"{version}-lora"
            train(lora, "--model", full, "--tuning", "lora", "--lr", "1e-2", "--max-steps", LORA_STEPS,
                  "--train-file", sets["lora"])
            runs[f"{version}-lora"] = (lora, True)
    return runs


def export_file(run: Path, out: Path, fmt: str, kind: str) -> Path:
    """export.py RUN OUT --format fmt --type kind (in this process); the file written."""
    import export as export_cli

    if not out.exists():
        export_cli.main([str(run), str(out), "--format", fmt, "--type", kind, "--name", "m"])
    return out / f"m-{kind}.{fmt}"


def sample_strings(n_plain: int) -> list[str]:
    """`n_plain` strings to tokenize: the edge cases, then the dev records' texts and answers, shuffled (seed 0)."""
    lines = [json.loads(line) for line in (REPO / "data" / "spo_dev.jsonl").read_text(encoding="utf-8").splitlines()]
    texts = [r["text"] for r in lines] + [r["answer"] for r in lines]
    random.Random(0).shuffle(texts)
    return (EDGE_STRINGS + texts)[:n_plain]


def prompts(tokenizer, source, count: int) -> list[list[int]]:
    """The run's extraction prompts (what infer.py feeds) for `count` dev records."""
    from chatglm_tune.data.records import SPORecord

    lines = (REPO / "data" / "spo_dev.jsonl").read_text(encoding="utf-8").splitlines()[-count:]
    return [tokenizer.prompt_format.prompt_ids(tokenizer, SPORecord(json.loads(line)["text"], None), source.encoding)[0]
            for line in lines]


def toolkit_greedy(model, ids: list[int], new: int) -> list[int]:
    """The toolkit's greedy ids in float32, the whole sequence recomputed at each step (the plainest reference)."""
    x = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(new):
            x = torch.cat([x, model(x).logits[:, -1].argmax(-1, keepdim=True)], 1)
    return x[0, len(ids):].tolist()


def first_margin(model, ids: list[int]) -> float:
    """The toolkit's float32 top-1 minus top-2 logit at the first generated step."""
    with torch.no_grad():
        top = model(torch.tensor([ids])).logits[0, -1].topk(2).values
    return float(top[0] - top[1])


def llama_greedy(llm, ids: list[int], new: int) -> list[int]:
    llm.reset()
    out = []
    for token in llm.generate(ids, top_k=1, temp=0.0, reset=True):
        out.append(token)
        if len(out) == new:
            break
    return out


def check_llama(run: Path, lora: bool, work: Path, n_plain: int, n_chat: int, n_prompts: int) -> dict:
    """llama.cpp against the toolkit on one run (see the module docstring)."""
    import llama_cpp

    from chatglm_tune.export.source import open_export

    source = open_export(run)
    model, tokenizer = source.model, source.tokenizer
    files = {kind: export_file(run, work / f"{run.name}-{kind}", "gguf", kind) for kind in ("f16", "q8_0", "q4_0")}
    llm = llama_cpp.Llama(str(files["f16"]), n_ctx=512, n_threads=1, n_threads_batch=1, verbose=False)
    plain = sample_strings(n_plain)
    plain_equal = sum(llm.tokenize(t.encode(), add_bos=False, special=False) == tokenizer.encode_text(t) for t in plain)
    template = llm.metadata["tokenizer.chat_template"]
    from jinja2 import Template

    chats = [[{"role": "user", "content": t}] for t in plain[len(EDGE_STRINGS):][:n_chat]]
    chat_equal = sum(
        llm.tokenize(Template(template).render(messages=m, add_generation_prompt=True).encode(),
                     add_bos=False, special=True)
        == tokenizer.prompt_format.chat_ids(tokenizer, m) for m in chats)
    asks = prompts(tokenizer, source.source, n_prompts)
    expected = [toolkit_greedy(model, ids, NEW_TOKENS) for ids in asks]
    f16 = [llama_greedy(llm, ids, NEW_TOKENS) for ids in asks]
    del llm
    q8 = llama_cpp.Llama(str(files["q8_0"]), n_ctx=512, n_threads=1, n_threads_batch=1, verbose=False)
    q8_runs = [llama_greedy(q8, ids, NEW_TOKENS) for ids in asks]
    del q8
    q4 = llama_cpp.Llama(str(files["q4_0"]), n_ctx=512, n_threads=1, n_threads_batch=1, verbose=False)
    q4_ids = llama_greedy(q4, asks[0], NEW_TOKENS)
    del q4
    steps = [(a == b) for want, got in zip(expected, q8_runs) for a, b in zip(want, got)]
    return {
        "run": run.name, "lora_merged": lora, "strings": len(plain) + len(chats),
        "tokenization_equal": plain_equal + chat_equal, "plain_equal": f"{plain_equal}/{len(plain)}",
        "chat_equal": f"{chat_equal}/{len(chats)}", "prompts": len(asks), "new_tokens": NEW_TOKENS,
        "f16_greedy_equal": sum(w == g for w, g in zip(expected, f16)),
        "toolkit_distinct_tokens": len({t for w in expected for t in w}),
        "q8_0_steps_equal": sum(steps) / len(steps),
        "q8_0_first_top1_equal": all(g[0] == w[0] for w, g in zip(expected, q8_runs)),
        "q8_0_first_unequal_margin": max((first_margin(model, ids) for ids, w, g in zip(asks, expected, q8_runs)
                                          if g[0] != w[0]), default=None),
        "q4_0_generated": len(q4_ids), "q4_0_distinct": len(set(q4_ids)),
        "file_bytes": {k: f.stat().st_size for k, f in files.items()},
    }


def check_chatglm_cpp(run: Path, work: Path, n_prompts: int) -> dict:
    """chatglm.cpp 0.4.2 on ChatGLM-6B's GGML f16 file: greedy ids fed as ids, against the toolkit's."""
    import chatglm_cpp
    from chatglm_cpp import _C

    from chatglm_tune.export.source import open_export

    source = open_export(run)
    path = export_file(run, work / f"{run.name}-ggml", "ggml", "f16")
    asks = prompts(source.tokenizer, source.source, n_prompts)
    pipe = chatglm_cpp.Pipeline(str(path), max_length=512)
    config = _C.GenerationConfig(max_length=512, max_new_tokens=NEW_TOKENS, max_context_length=400, do_sample=False)

    def greedy(ids: list[int]) -> list[int]:
        ids, n_ctx, n_past, out = list(ids), len(ids), 0, []
        for _ in range(NEW_TOKENS):
            token = pipe.model.generate_next_token(ids, None, config, n_past, n_ctx)
            n_past = len(ids)
            ids.append(token)
            out.append(token)
        return out

    expected = [toolkit_greedy(source.model, ids, NEW_TOKENS) for ids in asks]
    equal = sum(greedy(ids) == want for ids, want in zip(asks, expected))
    return {"run": run.name, "prompts": len(asks), "new_tokens": NEW_TOKENS, "f16_greedy_equal": equal,
            "toolkit_distinct_tokens": len({t for w in expected for t in w})}


def run_all(work: Path, quick: bool) -> dict:
    n_plain, n_chat, n_prompts = (60, 10, 4) if quick else (250, 50, 20)
    torch.set_num_threads(1)
    start = time.perf_counter()
    runs = make_runs(work)
    result = {"quick": quick, "llama_cpp": [], "chatglm_cpp": [], "skipped": []}
    if installed("llama_cpp"):
        import llama_cpp

        result["llama_cpp_version"] = llama_cpp.__version__
        result["llama_cpp"] = [check_llama(d, lora, work, n_plain, n_chat, n_prompts)
                               for name, (d, lora) in runs.items() if not name.startswith("chatglm-")]
    else:
        result["skipped"].append(f"llama.cpp: llama-cpp-python is not installed ({LLAMA_INSTALL})")
    if installed("chatglm_cpp"):
        result["chatglm_cpp"] = [check_chatglm_cpp(runs["chatglm-full"][0], work, n_prompts)]
    else:
        result["skipped"].append(f"chatglm.cpp: chatglm-cpp is not installed ({CPP_INSTALL})")
    result["seconds"] = round(time.perf_counter() - start, 1)
    return result


def report(result: dict) -> str:
    lines = ["| engine | run | tokenization equal | greedy equal (f16) | q8_0 steps equal | q8_0 first top-1 "
             "| q4_0 generates |",
             "|---|---|---|---|---|---|---|"]
    for r in result["llama_cpp"]:
        first_top1 = ("yes" if r["q8_0_first_top1_equal"]
                      else "no (toolkit margin %.3f)" % r["q8_0_first_unequal_margin"])
        lines.append(f"| llama.cpp | {r['run']}{' (merged)' if r['lora_merged'] else ''} | "
                     f"{r['tokenization_equal']}/{r['strings']} (plain {r['plain_equal']}, chat {r['chat_equal']}) | "
                     f"{r['f16_greedy_equal']}/{r['prompts']} prompts x {r['new_tokens']} "
                     f"({r['toolkit_distinct_tokens']} distinct ids) | {r['q8_0_steps_equal']:.1%} | "
                     f"{first_top1} | {r['q4_0_generated']} tokens ({r['q4_0_distinct']} distinct) |")
    for r in result["chatglm_cpp"]:
        lines.append(f"| chatglm.cpp | {r['run']} (GGML) | ids fed | {r['f16_greedy_equal']}/{r['prompts']} prompts x "
                     f"{r['new_tokens']} ({r['toolkit_distinct_tokens']} distinct ids) | | | |")
    lines += [f"\nskipped: {s}" for s in result["skipped"]]
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer strings and prompts, results into /tmp")
    p.add_argument("--work", type=Path, default=Path("/tmp/export-engines"),
                   help="runs and files (default %(default)s)")
    args = p.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    result = run_all(args.work, args.quick)
    out = Path("/tmp") if args.quick else REPO / "bench" / "results"
    (out / "export-engines.json").write_text(json.dumps(result, indent=2) + "\n")
    table = report(result)
    (out / "export-engines.md").write_text(table + "\n")
    print(table)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
