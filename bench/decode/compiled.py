"""Benchmark: decoding with each step one compiled forward over a static KV cache (`generate(..., compiled=True)`,
infer.py --compile) against the cached loop (`generate`), side by side in one run.

    python bench/decode/compiled.py          # tiny, small and mid GLM-4, ChatGLM3, ChatGLM-6B; batch 1, 8
    python bench/decode/compiled.py --sizes mid --versions glm4 --batch-sizes 1 --threads 1

Random models (the versions' tiny presets, and the serve bench's small and mid sizes: `serve_children.SIZES`), fp32,
random prompts of 24 to 48 tokens (left-padded batches), `--new-tokens` tokens a row (no stop). tok/s = generated
tokens / wall time of the call, prompt included: the median of `--rounds` calls of each, alternated. The compiled
side's first call (compiling, excluded from its tok/s) is timed on its own: `compile s`. The two sides' ids are
compared: where they part, the step and the cached side's top-2 logit margin there (a random model's near ties
part on float rounding). Results:
bench/results/compiled.json and .md; the last line printed is the JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: chatglm_tune, bench.<room>.<module>

from bench.common.measure import RESULTS, ROOT, machine, made_by  # noqa: E402

CORPUS = ROOT / "data" / "spo_dev.jsonl"


def build(version: str, size: str, directory: Path):
    from bench.serve.serve_children import SIZES
    from chatglm_tune.models import registry

    texts = [json.loads(line)["text"] for line in CORPUS.read_text(encoding="utf-8").splitlines()[:200]]
    torch.manual_seed(0)
    shape = {} if size == "tiny" else dict(SIZES[size])
    if version == "chatglm" and shape:  # ChatGLM-6B's names: every head its own keys, the MLP's width
        shape = {"hidden_size": shape["hidden_size"], "num_layers": shape["num_layers"],
                 "num_attention_heads": shape["num_attention_heads"], "inner_hidden_size": shape["ffn_hidden_size"]}
    model, _ = registry.VERSIONS[version].tiny(texts, directory, **shape)
    return model.eval()


def prompts(model, batch: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(24, 49, (batch,), generator=g).tolist()
    width = max(lengths)
    ids = torch.zeros(batch, width, dtype=torch.long)
    mask = torch.zeros(batch, width, dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, width - n:] = torch.randint(100, model.config.vocab_size - 100, (n,), generator=g)
        mask[row, width - n:] = 1
    if getattr(model.config, "gmask_token_id", None) is not None:  # ChatGLM-6B: a prompt ends with [gMASK] <sop>
        ids[:, -2:] = torch.tensor([model.config.gmask_token_id, model.config.bos_token_id])
    return ids, mask


def compare(model, batch: int, new_tokens: int, rounds: int) -> dict:
    from bench.gpu.gpu_models import agreement
    from chatglm_tune.decoding.generation import generate

    ids, mask = prompts(model, batch)
    sides = {"cached": {}, "compiled": {"compiled": True}}

    def call(name):
        began = time.perf_counter()
        out = generate(model, ids, mask, max_new_tokens=new_tokens, eos_token_id=None, **sides[name])
        return time.perf_counter() - began, out

    compile_s, compiled_ids = call("compiled")
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    outputs = {"compiled": compiled_ids}
    for r in range(rounds):
        for name in (sides if r % 2 == 0 else reversed(list(sides))):
            took, outputs[name] = call(name)
            seconds[name].append(took)
    tokens = batch * new_tokens
    cached, compiled = statistics.median(seconds["cached"]), statistics.median(seconds["compiled"])
    with torch.inference_mode():
        agreed = agreement(model, ids, outputs["cached"], outputs["compiled"], mask)
    return {"batch": batch, "new_tokens": new_tokens, **agreed,
            "cached_tok_s": round(tokens / cached, 1), "compiled_tok_s": round(tokens / compiled, 1),
            "speedup": round(cached / compiled, 3), "compile_s": round(compile_s, 1),
            "cached_s": seconds["cached"], "compiled_s": seconds["compiled"]}


def table(results: list[dict]) -> str:
    from bench.gpu.gpu_report import agreement_text

    lines = ["| model | params | batch | cached tok/s | compiled tok/s | speedup | compile s | same ids |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['version']} {r['size']} | {r['params'] / 1e6:.1f} M | {r['batch']} | {r['cached_tok_s']} | "
                     f"{r['compiled_tok_s']} | {r['speedup']}x | {r['compile_s']} | {agreement_text(r)} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--versions", default="glm4,chatglm3,chatglm", help="comma-separated (default %(default)s)")
    p.add_argument("--sizes", default="tiny,small,mid", help="comma-separated: tiny, small, mid (default %(default)s)")
    p.add_argument("--batch-sizes", default="1,8", help="comma-separated (default %(default)s)")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens a row (default %(default)s)")
    p.add_argument("--rounds", type=int, default=3, help="alternated calls of each side (default %(default)s)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default %(default)s)")
    p.add_argument("--output", type=Path, default=RESULTS / "compiled.json", help="results (default %(default)s)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    results = []
    for version in args.versions.split(","):
        for size in args.sizes.split(","):
            # each model compiles afresh (the step's compiled variants share one budget a process)
            torch._dynamo.reset()
            with tempfile.TemporaryDirectory() as directory:
                model = build(version, size, Path(directory))
            params = sum(t.numel() for t in model.parameters())
            for batch in (int(b) for b in args.batch_sizes.split(",")):
                row = compare(model, batch, args.new_tokens, args.rounds)
                results.append({"version": version, "size": size, "params": params, **row})
                print(table(results[-1:]).splitlines()[-1], flush=True)
    on = machine(args.threads)
    summary = {"bench": "compiled", "machine": on, "results": results}
    text = table(results)
    print(text)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    args.output.with_suffix(".md").write_text(
        "# Compiled decode steps on a static cache against the cached "
        f"loop\n\n{made_by('bench/decode/compiled.py', on)}, fp32.\n\n{text}\n",
        encoding="utf-8")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
