"""Benchmark: speculative extraction at full size, on a trained model's acceptance pattern, beside llama.cpp's plain
decoding of the same weights, in one run.

    python bench/peer/peer.py --version chatglm3 --step write      # a random ChatGLM3-6B checkpoint: /tmp/chatglm3-peer
    python bench/peer/peer.py --version chatglm3 --step gguf-q4_0  # its GGUF, for llama.cpp's side
    python bench/decode/speculative_full.py --threads 2            # needs checkpoints/tiny (the README main job)

A random full-size model extracts nothing worth checking, but a forward's cost does not depend on what its tokens
are. So the pattern comes from a trained model and the cost from the full-size one:
1. The pattern: the trained model (`--pattern`, default checkpoints/tiny) extracts the first `--records` records of
   `--input` at batch 1 with speculation (infer.py's drafts, the answer pool kept over the records): per record, each
   forward's guesses and how many the model kept.
2. The full-size model (`--model`; INT4 with the INT8 embedding / head, bf16 activations, by default), `--threads`:
   - the ms of one forward checking k = 0 (a plain step), 1, 2, 4, 8 guesses after the first record's prompt;
   - each record's prompt (this model's own ids of it) prefilled once, then decoded two ways from copies of that
     cache: plainly, one forward per token of the trained model's answer, and speculatively, the pattern's forwards
     with as many guesses each, keeping as many as the trained model kept. Decode tok/s of each (after the prefill),
     and their ratio.
3. llama.cpp (llama-cpp-python; skipped, saying how to install it, without it) decoding the same weights' q4_0 GGUF
   (`--gguf`) plainly after the first record's prompt: ms a token, tok/s.

Results: bench/results/speculative-full.json and .md; the last line printed is the JSON.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: chatglm_tune, bench.<room>.<module>

from bench.common.measure import RESULTS, ROOT, machine, made_by  # noqa: E402
from bench.decode.speculative import TARGETS, VERIFY_GUESSES, load, records_of  # noqa: E402

LLAMA_NEW_TOKENS = 32  # llama.cpp's plain tokens after the prompt
INSTALL_LLAMA = ('pip install llama-cpp-python (CPUs without AVX-512: bench/peer/peer_llama.py INSTALL_AVX2), or '
                 'LLAMA_CPP_LIB_PATH=<a llama.cpp build\'s lib dir> with the llama_cpp package on PYTHONPATH')


def recording_drafter(options):
    """infer.py's `Drafter`, recording per forward each live row's (guesses, kept) in `forwards` (a list the caller
    sets): `speculative_steps` drafts for every live row, runs the forward, then updates every live row."""
    from chatglm_tune.decoding.drafting import Drafter

    class Recording(Drafter):
        forwards: list[dict]
        drafting = False

        def draft(self, row: int, *args) -> list[int]:
            if not self.drafting:
                self.forwards.append({})
                self.drafting = True
            return super().draft(row, *args)

        def update(self, row: int, drafted: int, accepted: int) -> None:
            super().update(row, drafted, accepted)
            self.forwards[-1][row] = (drafted, accepted)
            self.drafting = False

    return Recording(options)


@torch.inference_mode()
def acceptance_patterns(pattern_dir: Path, records_path: Path, n: int, batch_sizes: list[int], threads: int | None,
                        drafts) -> dict[int, list[dict]]:
    """Per batch size, per batch of the first `n` records, as infer.py decodes them (left-padded, one answer pool
    over the run): each row's new tokens, and per speculative forward {row: (guesses, kept)} of its live rows."""
    source, model, tokenizer, _ = load(pattern_dir, threads)
    records = records_of(records_path, n, source)
    return {b: acceptance_pattern(model, tokenizer, source, records, b, drafts) for b in batch_sizes}


def left_padded(tokenizer, records, source) -> dict[str, torch.Tensor]:
    """The prompts of `records` as infer.py batches them: `input_ids` and `attention_mask`, left-padded."""
    from chatglm_tune.data.batches import SpecialIds, collate_prompts

    prompts = [tokenizer.prompt_format.prompt_ids(tokenizer, r, source.encoding)[0] for r in records]
    return collate_prompts(prompts, SpecialIds.of(tokenizer))


def acceptance_pattern(model, tokenizer, source, records, batch: int, drafts) -> list[dict]:
    from chatglm_tune.decoding.generation import generate

    drafter, out = recording_drafter(drafts), []
    for lo in range(0, len(records), batch):
        padded = left_padded(tokenizer, records[lo:lo + batch], source)
        drafter.forwards = []
        new = generate(model, padded["input_ids"], padded["attention_mask"],
                       max_new_tokens=source.encoding.answer_budget,
                       eos_token_id=tokenizer.prompt_format.stop_ids(tokenizer), vocab_limit=len(tokenizer),
                       drafts=drafter)
        for row, answer in enumerate(new):  # the first token is the prefill's
            if sum(f[row][1] + 1 for f in drafter.forwards if row in f) != len(answer) - 1:
                raise RuntimeError(f"batch at record {lo}, row {row}: the forwards do not add up to {len(answer)} "
                                   "tokens")
        out.append({"tokens": [len(answer) for answer in new], "forwards": drafter.forwards})
    return out


def prefilled(model, tokenizer, records, source):
    """The left-padded prompts of `records` prefilled: (their cache, each row's first token)."""
    from chatglm_tune.decoding.batch_cache import BatchCache

    padded = left_padded(tokenizer, records, source)
    batch, scores = BatchCache.prefill(model, padded["input_ids"], padded["attention_mask"])
    return batch, scores.argmax(dim=-1).tolist()


def timed(fn) -> float:
    began = time.perf_counter()
    fn()
    return time.perf_counter() - began


def forward(model, batch, tokens: list[int], checks: list[tuple[int, int]]) -> None:
    """One decoding forward: a plain step where no row guesses, else a check of each row's guesses keeping as many
    as `checks` [(guesses, kept)] says."""
    if not any(guesses for guesses, _ in checks):
        batch.step(model, torch.tensor(tokens))
    else:
        batch.verify(model, tokens, [[t] * guesses for t, (guesses, _) in zip(tokens, checks)])
        batch.accept([kept + 1 for _, kept in checks])


def play(model, batch, tokens: list[int], forwards: list[dict]) -> None:
    """`forwards` [{row: (guesses, kept)}] on `batch`, rows leaving as they finish (as `speculative_steps` does)."""
    live = list(range(len(tokens)))
    for checks in forwards:
        rows = sorted(checks)
        if rows != live:
            batch.select(torch.tensor([live.index(r) for r in rows]))
            live = rows
        forward(model, batch, [tokens[r] for r in live], [checks[r] for r in live])


def plain_forwards(tokens: list[int]) -> list[dict]:
    """The forwards of plain decoding of rows with `tokens` new tokens each (the first from the prefill)."""
    return [{row: (0, 0) for row, n in enumerate(tokens) if n - 1 > step} for step in range(max(tokens) - 1)]


@torch.inference_mode()
def verify_cost(model, tokenizer, record, source, reps: int) -> list[dict]:
    """ms of one forward checking k guesses after `record`'s prompt, each from a copy of the prefilled cache."""
    batch, tokens = prefilled(model, tokenizer, [record], source)
    out = []
    for k in VERIFY_GUESSES:
        times = [timed(lambda b=copy.deepcopy(batch): forward(model, b, tokens, [(k, k)])) for _ in range(reps + 1)]
        out.append({"guesses": k, "ms": round(1000 * statistics.median(times[1:]), 1)})
    for row in out:
        row["x_plain_step"] = round(row["ms"] / out[0]["ms"], 3)
    return out


@torch.inference_mode()
def replay(model, tokenizer, records, source, pattern: list[dict], batch_size: int) -> dict:
    """Plain and speculative decoding of each batch on the pattern (module docstring), alternating which goes first."""
    seconds = {"plain": 0.0, "speculative": 0.0}
    tokens = forwards = plain_steps = row_forwards = 0
    for i, run in enumerate(pattern):
        batch, first = prefilled(model, tokenizer, records[i * batch_size:(i + 1) * batch_size], source)
        sides = {"plain": plain_forwards(run["tokens"]), "speculative": run["forwards"]}
        for name in (("plain", "speculative") if i % 2 == 0 else ("speculative", "plain")):
            b = copy.deepcopy(batch)
            seconds[name] += timed(lambda b=b, f=sides[name]: play(model, b, first, f))
        tokens += sum(run["tokens"]) - len(run["tokens"])  # the first tokens come from the prefill either way
        forwards, plain_steps = forwards + len(run["forwards"]), plain_steps + len(sides["plain"])
        row_forwards += sum(len(checks) for checks in run["forwards"])
    return {"batch": batch_size, "records": len(records), "decoded_tokens": tokens, "plain_forwards": plain_steps,
            "speculative_forwards": forwards, "tokens_per_forward": round(tokens / row_forwards, 3),
            "plain_s": round(seconds["plain"], 2), "speculative_s": round(seconds["speculative"], 2),
            "plain_tok_s": round(tokens / seconds["plain"], 3),
            "speculative_tok_s": round(tokens / seconds["speculative"], 3),
            "speedup": round(seconds["plain"] / seconds["speculative"], 3)}


def llama_plain(gguf: Path, prompt: list[int], threads: int) -> dict:
    """llama.cpp's plain decoding of `gguf` after `prompt`, in a child process (bench/peer/peer_llama.py's)."""
    if not gguf.exists():
        return {"skipped": f"no {gguf}: python bench/peer/peer.py --version chatglm3 --step gguf-q4_0"}
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return {"skipped": f"llama-cpp-python is not installed: {INSTALL_LLAMA}"}
    work = {"warmup": prompt[:8], "warmup_new": 4, "prompts": [prompt], "new": LLAMA_NEW_TOKENS}
    done = subprocess.run([sys.executable, "-m", "bench.peer.peer_llama", "--child", "llama", "--gguf", str(gguf),
                           "--threads", str(threads), "--workload", json.dumps(work)], cwd=ROOT, capture_output=True,
                          text=True, check=True)
    record = json.loads(done.stdout.strip().splitlines()[-1])
    if "decode_ms" in record:
        record["tok_s"] = round(1000 / record["decode_ms"], 3)
    return record


def table(result: dict) -> str:
    llama = result["llama"]
    lines = ["| batch | plain tok/s | speculative tok/s | speedup | target | tokens / forward (a row's) | forwards: "
             "plain, speculative |", "|---|---|---|---|---|---|---|"]
    for r in result["replay"]:
        target = TARGETS.get(r["batch"])
        lines.append(f"| {r['batch']} | {r['plain_tok_s']} | {r['speculative_tok_s']} | {r['speedup']}x | "
                     f"{'-' if target is None else f'{target}x'} | {r['tokens_per_forward']} | {r['plain_forwards']}, "
                     f"{r['speculative_forwards']} |")
    lines.append("")
    lines.append(f"llama.cpp q4_0 of the same weights, plain, batch 1: {llama['tok_s']} tok/s "
                 f"({llama['decode_ms']:.1f} ms a token after the {llama['prompt_len']}-token prompt)"
                 if "tok_s" in llama else f"llama.cpp: skipped: {llama['skipped']}")
    lines += ["", "Cost of checking k guesses in one forward, batch 1:", "", "| k | ms | x plain step |",
              "|---|---|---|"]
    lines += [f"| {row['guesses']} | {row['ms']} | {row['x_plain_step']} |" for row in result["verify"]]
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=Path("/tmp/chatglm3-peer"),
                   help="the full-size model (default %(default)s)")
    p.add_argument("--gguf", type=Path, help="its q4_0 GGUF (default: where peer.py's gguf-q4_0 step writes it)")
    p.add_argument("--pattern", type=Path, default=ROOT / "checkpoints" / "tiny",
                   help="the trained model (default %(default)s)")
    p.add_argument("--input", type=Path, default=ROOT / "data" / "spo_dev.jsonl", help="records (default %(default)s)")
    p.add_argument("--records", type=int, default=8, help="records replayed at full size (default %(default)s)")
    p.add_argument("--batch-sizes", default="1,8", help="comma-separated (default %(default)s)")
    p.add_argument("--max-draft", type=int, help="guesses a forward at most (default: infer.py's, DraftOptions)")
    p.add_argument("--quantization-bit", type=int, choices=[4, 8, 0], default=4,
                   help="0: unquantized (default %(default)s)")
    p.add_argument("--dtype", default="bfloat16", help="the full-size model's activations (default %(default)s)")
    p.add_argument("--threads", type=int, default=2, help="torch and llama.cpp threads (default %(default)s)")
    p.add_argument("--reps", type=int, default=5, help="timed forwards per k (default %(default)s)")
    p.add_argument("--output", type=Path, default=RESULTS / "speculative-full.json",
                   help="results (default %(default)s)")
    args = p.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    for what, path in (("--model", args.model), ("--pattern", args.pattern)):
        if not (path / "config.json").exists() and not (path / "run_args.json").exists():
            p.error(f"{what}: no model in {path} (the module docstring says how each is made)")
    if args.gguf is None:
        from bench.peer.peer_llama import gguf_path

        args.gguf = gguf_path(args.model, "q4_0")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    from chatglm_tune.options import DEFAULT_DRAFTS

    drafts = DEFAULT_DRAFTS.capped(args.max_draft)
    patterns = acceptance_patterns(args.pattern, args.input, args.records, args.batch_sizes, args.threads, drafts)
    source, model, tokenizer, line = load(args.model, args.threads, bits=args.quantization_bit or None,
                                          dtype=args.dtype)
    records = records_of(args.input, args.records, source)
    result = {"pattern": str(args.pattern), "model": str(args.model), "loaded": line, "drafts": asdict(drafts),
              "verify": verify_cost(model, tokenizer, records[0], source, args.reps),
              "replay": [replay(model, tokenizer, records, source, patterns[b], b) for b in args.batch_sizes]}
    prompt = tokenizer.prompt_format.prompt_ids(tokenizer, records[0], source.encoding)[0]
    del model
    result["llama"] = llama_plain(args.gguf, prompt, args.threads)
    on = machine(args.threads)
    summary = {"bench": "speculative-full", "machine": on, **result}
    text = table(result)
    print(line)
    print(text)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(summary, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    args.output.with_suffix(".md").write_text(
        f"# Speculative extraction at full size\n\n{made_by('bench/decode/speculative_full.py', on)}; {line}; the "
        f"acceptance pattern of {args.pattern.name}.\n\n{text}\n", encoding="utf-8")
    print(json.dumps(summary, ensure_ascii=False))


if __name__ == "__main__":
    main()
