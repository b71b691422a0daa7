"""The results of bench/gpu/gpu.py: merged with an earlier run's on the same GPU (`merged`), the headline figures
(`headline`) and the results page (`markdown`); and bench/serve/serve.py's run on that GPU as rows of it:

    python bench/gpu/gpu_report.py --serve SERVE_JSON [--model chatglm3-6b] [--precision bf16] [--out DIR]

reads serve.py's results (its `--device cuda` run) and merges them into DIR/gpu.json and gpu.md (default
bench/results) as rows `what: "serve"` (impl: the server, batch and streams: the concurrent clients, tok/s, TTFT and
inter-token percentiles); the device record is the GPU's from the earlier gpu.py run there.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVE_FIELDS = ("ttft_p50_ms", "ttft_p95_ms", "ttft_p95_later_ms", "itl_p50_ms", "itl_p95_ms", "tpot_p50_ms",
                "tpot_p95_ms", "requests", "failed", "tokens", "wall_s", "rows_per_step", "steps_per_s")


def agreement_text(row: dict) -> str:
    if "same_ids" not in row:
        return ""
    if row["same_ids"]:
        return "same ids"
    return (f"parts at step {row['first_diff_step']} ({row['rows_parting']} row(s); top-2 margin there "
            f"{row['margin']:.3g} = {row['margin_std']:.3g} std)")


def row_key(row: dict) -> tuple:
    return row["model"], row["precision"], row["impl"], row["what"], row.get("batch")


def merged(path: Path, info: dict, tests: dict | None, models: dict, rows: list, settings: dict) -> dict:
    """This run's results over an earlier run's on the same GPU: its rows replace only the rows of the same model,
    precision, impl, what and batch (each row keeps the time of its run), its model notes update theirs; the device
    record and the tests are the latest run's (the tests the earlier run's where this one ran none)."""
    old = json.loads(path.read_text()) if path.exists() else {}
    if old.get("device", {}).get("device") != info["device"]:
        old = {}
    when = time.strftime("%Y-%m-%d %H:%M:%S")
    new = [{**r, "run": r.get("run", when)} for r in rows]
    keys = {row_key(r) for r in new}
    kept = [{**r, "run": r.get("run", old.get("when"))} for r in old.get("rows", []) if row_key(r) not in keys]
    notes = {k: dict(v) for k, v in old.get("models", {}).items()}
    for name, fresh in models.items():
        mine = notes.setdefault(name, {})
        for k, v in fresh.items():  # dicts of precisions: updated, not replaced
            mine[k] = {**mine[k], **v} if isinstance(v, dict) and isinstance(mine.get(k), dict) else v
    return {"device": {**old.get("device", {}), **info}, "when": when, "settings": settings,
            "tests": tests if tests is not None else old.get("tests"), "models": notes, "rows": kept + new}


def headline(results: dict) -> dict:
    """Per model: bf16 decode tok/s at each batch, the toolkit's cached loop and compiled steps against transformers,
    and the compiled steps' share of the card's copy bandwidth at batch 1 (weight bytes a token reads x tok/s); the
    LoRA step, toolkit against transformers + peft; each precision's decode at batch 1 (and 32), cached and compiled."""
    out = {}
    copy = results["device"].get("copy_gb_s")
    for name, notes in results["models"].items():
        rows = [r for r in results["rows"] if r["model"] == name and "error" not in r and "tok_s" in r]

        def pick(precision, impl, what, batch=None, key="tok_s"):
            hit = [r for r in rows if (r["precision"], r["impl"], r["what"]) == (precision, impl, what)
                   and (batch is None or r["batch"] == batch)]
            return round(hit[0][key], 3) if hit else None

        batches = sorted({r["batch"] for r in rows if r["what"] == "decode"})
        entry = {f"bf16_decode_b{b}_tok_s": {impl: pick("bf16", impl, "decode", b)
                                             for impl in ("toolkit", "toolkit-compiled", "transformers")}
                 for b in batches}
        read = notes.get("read_gb_per_token", {}).get("bf16")
        compiled = pick("bf16", "toolkit-compiled", "decode", 1, key="decode_tok_s")
        if copy and read and compiled:
            entry["bf16_compiled_b1_bandwidth_share"] = round(compiled * read / copy, 3)
        entry["bf16_lora_step_s"] = {"toolkit": pick("bf16", "toolkit", "lora step", key="seconds"),
                                     "transformers+peft": pick("bf16", "transformers+peft", "lora step", key="seconds")}
        served = [r for r in rows if r["what"] == "serve"]
        if served:
            entry["serve_tok_s"] = {f"{r['impl']}@{r['streams']}": round(r["tok_s"], 1) for r in served}
        rows = [r for r in rows if r["what"] != "serve"]
        precisions = sorted({r["precision"] for r in rows})
        for b in batches:
            entry[f"decode_b{b}_tok_s"] = {p: {"cached": pick(p, "toolkit", "decode", b),
                                               "compiled": pick(p, "toolkit-compiled", "decode", b)}
                                           for p in precisions}
        out[name] = entry
    return out


def markdown(results: dict) -> str:
    info, tests = results["device"], results["tests"] or {}
    s = results["settings"]
    copy = f"{info['copy_gb_s']:.0f} GB/s" if info.get("copy_gb_s") else "not measured"
    lines = [f"# The toolkit on a CUDA GPU: {info['device']}", "",
             f"GPU: {info['device']} (compute capability {info['capability']}, {info['memory_gb']} GB); torch "
             f"{info['torch']}, CUDA {info['cuda']}, transformers {info['transformers']}, peft {info['peft']}, "
             f"bitsandbytes {info['bitsandbytes'] or 'not installed'}. Device-to-device copy (bytes read + written): "
             f"{copy}. Made by `python bench/gpu/gpu.py` (latest run {results['when']}; each row says its run); GB = "
             "1e9 bytes.", "",
             f"Tests (`pytest -m cuda tests/test_cuda.py`): {tests.get('summary', 'not run')}", ""]
    lines += [f"- not passed: `{line}`" for line in tests.get("not_passed", [])]
    lines += ["",
              f"Decode: {s['prompt_len']}-token prompt, {s['new_tokens']} greedy tokens, no early stop; tok/s over the "
              "whole call, decode tok/s of the steps after the first token. impl `toolkit`: the cached loop "
              "(`generate`); `toolkit-compiled`: `generate(compiled=True)` (static cache, the steps one compiled "
              "function, CUDA graphs); `transformers`: `GlmForCausalLM.generate`. \"same ids\": the compiled steps' "
              "ids against the cached loop's at the same batch, or the step where a row first parts and the top-2 "
              "logit margin there (in standard deviations of that step's logits). Steps: batch "
              f"{s['train_batch']} x {s['train_len']} tokens (half labelled), AdamW, median of {s['steps']} after a "
              "warm-up; P-tuning v2 pre_seq_len 128, LoRA r 8 on q/k/v. Peak = `torch.cuda.max_memory_allocated` "
              "(weights included). Random weights (bench/gpu/gpu_models.py).", ""]
    for name, notes in results["models"].items():
        lines += model_section(name, notes, [r for r in results["rows"] if r["model"] == name])
    return "\n".join(lines)


def model_section(name: str, notes: dict, rows: list) -> list[str]:
    lines = [f"## {name}: {notes['layers']} layers, hidden {notes['hidden']}, {notes['parameters'] / 1e9:.2f} B "
             "parameters", ""]
    if "skipped" in notes:
        return lines + [f"Skipped: {notes['skipped']}.", ""]
    lines += [f"Gradient checkpointing: {'on' if notes.get('gradient_checkpointing') else 'off'}. Weights on the GPU: "
              + ", ".join(f"{p} {gb:.2f} GB" for p, gb in notes.get("weights_gb", {}).items()) + "."]
    if notes.get("read_gb_per_token"):
        lines.append("Weight bytes a decode step reads: "
                     + ", ".join(f"{p} {gb:.2f} GB" for p, gb in notes["read_gb_per_token"].items()) + ".")
    if notes.get("kernel_vs_dequant_error"):
        lines.append("Logits of the INT8 / INT4 kernels against the dequantizing path, relative error: "
                     + ", ".join(f"{p} {e:.2g}" for p, e in notes["kernel_vs_dequant_error"].items()
                                 if e is not None) + ".")
    if notes.get("not_reached"):
        lines.append(f"Not reached before the run's deadline: {', '.join(notes['not_reached'])}.")
    served = [r for r in rows if r["what"] == "serve"]
    lines += ["", "| precision | impl | what | batch | seconds | tok/s | decode tok/s | peak GB | same ids | run |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in (r for r in rows if r["what"] != "serve"):
        if "error" in r:
            lines.append(f"| {r['precision']} | {r['impl']} | {r['what']} | | error: {r['error']} | | | | | "
                         f"{r.get('run', '')} |")
            continue
        decode = f"{r['decode_tok_s']:.1f}" if "decode_tok_s" in r else ""
        lines.append(f"| {r['precision']} | {r['impl']} | {r['what']} | {r['batch']} | {r['seconds']:.3f} | "
                     f"{r['tok_s']:.1f} | {decode} | {r['peak_gb']:.2f} | {agreement_text(r)} | {r.get('run', '')} |")
    return lines + [""] + (serve_table(served) if served else [])


def serve_table(rows: list) -> list[str]:
    """serve.py on the GPU (`--serve` rows): streaming clients against each server."""
    lines = ["serve.py on this GPU (bench/serve/serve.py --device cuda; the server named by its --max-batch, "
             "`-compiled`: --compile):", "",
             "| precision | server | streams | requests (failed) | tok/s | TTFT p50 / p95 ms | inter-token p50 / p95 "
             "ms | run |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['precision']} | {r['impl']} | {r['streams']} | {r.get('requests')} ({r.get('failed')}) | "
                     f"{r['tok_s']:.1f} | {r.get('ttft_p50_ms')} / {r.get('ttft_p95_ms')} | "
                     f"{r.get('itl_p50_ms')} / {r.get('itl_p95_ms')} | {r.get('run', '')} |")
    return lines + [""]


def serve_rows(serve: dict, model: str, precision: str) -> list[dict]:
    """serve.py's results as gpu.json rows (`what: "serve"`)."""
    return [{"model": model, "precision": precision, "impl": r["server"], "what": "serve", "batch": r["streams"],
             "streams": r["streams"], "seconds": r["wall_s"], "tok_s": r["tokens_per_s"],
             "server_peak_rss_gb": r.get("peak_rss_mb", 0) / 1e3, "run": serve.get("when"),
             **{k: r[k] for k in SERVE_FIELDS if k in r}} for r in serve["results"] if "tokens_per_s" in r]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--serve", type=Path, required=True, help="bench/serve/serve.py's results JSON of a GPU run")
    p.add_argument("--model", default="chatglm3-6b", help="the rows' model name (default %(default)s)")
    p.add_argument("--precision", default="bf16", help="the rows' precision (default %(default)s)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results",
                   help="where gpu.json is (default %(default)s)")
    args = p.parse_args(argv)
    path = args.out / "gpu.json"
    if not path.exists():
        p.error(f"{path}: no gpu.json to merge into (run bench/gpu/gpu.py on the GPU first)")
    if not args.serve.is_file():
        p.error(f"--serve {args.serve}: no such file")
    old = json.loads(path.read_text())
    serve = json.loads(args.serve.read_text())
    rows = serve_rows(serve, args.model, args.precision)
    notes = {args.model: {"serve": {"argv": serve.get("argv"), "model": serve.get("model"), "when": serve.get("when")}}}
    results = merged(path, old["device"], None, notes, rows, old.get("settings", {}))
    results["headline"] = headline(results)
    path.write_text(json.dumps(results, indent=1) + "\n")
    (args.out / "gpu.md").write_text(markdown(results) + "\n")
    print(f"merged {len(rows)} serve rows of {args.serve} into {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
