"""Extract SPO triples (or answer prompts) with a fine-tuned ChatGLM-6B, ChatGLM2/3 or GLM-4 model: batched
KV-cache decoding over a .jsonl/.json file, or one --text.

    python infer.py --model checkpoints/run1 --input data/spo_dev.jsonl --output out.jsonl
    python infer.py --model BASE --lora ADAPTER --input dev.jsonl --output out.jsonl --resume
    python infer.py --model checkpoints/run1 --text "故障现象：发动机异响。"

Writes one JSON line per record, in input order, batch by batch (fields: `chatglm_tune.evaluation.extraction`),
then prints a summary and saves it as `<output>.summary.json`. `--resume` continues a killed run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from chatglm_tune.cli.config import CommandParser
from chatglm_tune.options import (
    BAD_RECORD_MODES, DEFAULT_DRAFTS, DEFAULT_SAMPLING, LOAD_DTYPES, QUANTIZATION_BITS, SPECULATION, SPECULATION_MODES,
    THREADS_PER_CPU, ExtractionSettings,
    threads_problem,
)

DEFAULT_SETTINGS = ExtractionSettings()


def parse_args(argv=None) -> argparse.Namespace:
    p = CommandParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a ChatGLM-6B, ChatGLM2/3, GLM-4 (9B, 0414, Edge), GLM-4.5 / 4.6 / "
                   "4.7 or GLM-4.7-Flash model directory, or a train.py run directory (it names its base)")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--input", type=Path, help="records to extract from (.jsonl or .json; gold answers optional)")
    what.add_argument("--text", help="extract from this one text and print the result")
    p.add_argument("--output", type=Path, help="output .jsonl (required with --input)")
    adapter = p.add_mutually_exclusive_group()
    adapter.add_argument("--ptuning-checkpoint", type=Path, help="P-tuning v2 checkpoint directory to load on --model")
    adapter.add_argument("--lora", type=Path, help="peft LoRA adapter directory to merge into --model (ours, or one of "
                         "the official ChatGLM2/3 / GLM-4 code: query_key_value ...)")
    p.add_argument("--batch-size", type=int, default=DEFAULT_SETTINGS.batch_size,
                   help="prompts decoded together (default %(default)s)")
    p.add_argument("--max-new-tokens", type=int, help="generated tokens per record at most (default: the answer budget "
                   "the model was trained with, max_len - max_src_len of its run)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--greedy", dest="do_sample", action="store_false", help="greedy decoding (the default)")
    mode.add_argument("--do-sample", dest="do_sample", action="store_true", help="sample (temperature, top-k, top-p)")
    p.set_defaults(do_sample=DEFAULT_SAMPLING.do_sample)
    p.add_argument("--top-p", type=float,
                   help=f"with --do-sample: nucleus mass in (0, 1] (default {DEFAULT_SAMPLING.top_p})")
    p.add_argument("--temperature", type=float,
                   help=f"with --do-sample: > 0, or 0 for greedy (default {DEFAULT_SAMPLING.temperature})")
    p.add_argument("--top-k", type=int, help="with --do-sample: keep the k best tokens before top-p (default: off)")
    p.add_argument("--seed", type=int, help="with --do-sample: record i samples with seed + i (default: unseeded)")
    p.add_argument("--speculative", nargs="?", const="on", choices=SPECULATION_MODES, default=SPECULATION,
                   help="greedy decoding guesses each row's next tokens from its own text and earlier answers and "
                        "checks them in one forward: the same output in fewer forwards, faster where a forward of a "
                        "few tokens costs about one token's; on: every step guesses; auto: a step guesses where "
                        "guessing has been faster at its number of rows, as measured during the run (default "
                        "%(default)s; --speculative alone: on; sampling decodes plainly)")
    p.add_argument("--no-speculative", dest="speculative", action="store_const", const="off", help="--speculative off")
    p.add_argument("--max-draft", type=int, help="with --speculative: guesses checked a forward at most (default "
                   f"{DEFAULT_DRAFTS.max_draft}; 1 where each guess costs much of a token's forward, as with INT4 on "
                   "CPUs without AVX-512 VNNI)")
    p.add_argument("--compile", action="store_true", help="decode on a static KV cache, each step one compiled forward "
                   "(torch.compile: the same output with less Python overhead a step; compiling takes seconds to a "
                   "minute once; every version in float, INT8 / INT4 on a CUDA GPU; not with --speculative)")
    p.add_argument("--enable-thinking", action=argparse.BooleanOptionalAction, help="GLM-4.5 / 4.6 / 4.7, "
                   "GLM-4.7-Flash: prompt conversation records with thinking on or off where a record sets no "
                   "enable_thinking of its own (default: the run's, else on exactly for the records that hold "
                   "reasoning)")
    p.add_argument("--resume", action="store_true", help="continue after the records already in --output")
    p.add_argument("--prompt-column", help="prompt/response data: the field holding the prompt (default: the run's, "
                   "else the SPO shapes)")
    p.add_argument("--response-column",
                   help="with --prompt-column: the field holding the gold answer (default: the run's)")
    p.add_argument("--history-column",
                   help="with --prompt-column: earlier [query, response] turns (default: the run's)")
    p.add_argument("--on-bad-record", choices=BAD_RECORD_MODES, default=BAD_RECORD_MODES[0],
                   help="stop at an unusable record, or skip and count it (default %(default)s)")
    p.add_argument("--quantization-bit", type=int, choices=QUANTIZATION_BITS,
                   help="INT8/INT4 block Linears (default: as the model was trained: as stored, or quantized at load "
                        "as the run's base was)")
    p.add_argument("--quantize-embedding", action=argparse.BooleanOptionalAction,
                   help="hold the embedding and output head in INT8 (ChatGLM-6B's tied pair as one copy): half their "
                        "memory and the fastest CPU head, for a small logit error (beyond the official format; "
                        "default: as the run trained)")
    p.add_argument("--dtype", choices=(*LOAD_DTYPES, "auto"),
                   help="compute dtype (default: float32 on CPU, float16 on CUDA; auto = config.json's)")
    p.add_argument("--device", default="auto",
                   help="cpu, cuda, cuda:N, or auto: cuda when available (default %(default)s)")
    p.add_argument("--threads", type=int, help=f"torch CPU threads, at most {THREADS_PER_CPU} a CPU (default: "
                   "OMP_NUM_THREADS when set, else what the train.py run used, else torch's)")
    args = p.parse_args(argv)
    check_flags(p, args)
    return args


def check_flags(p: argparse.ArgumentParser, args) -> None:
    """What the parser cannot check alone (its error on the first): flags that do not combine, an --output that is a
    directory or the --input; --compile turns --speculative off."""
    if threads_problem(args.threads):
        p.error(threads_problem(args.threads))
    if args.output is not None:
        if args.output.is_dir():
            p.error(f"--output {args.output} is a directory: name a .jsonl file to write")
        if args.input is not None and args.output.resolve() == args.input.resolve():
            p.error(f"--output {args.output} is the --input file: name another file to write")
    given = [f"--{n.replace('_', '-')}" for n in ("top_p", "temperature", "top_k", "seed")
             if getattr(args, n) is not None]
    if args.max_draft is not None and (args.max_draft < 1 or args.speculative == "off"):
        p.error(f"--max-draft must be >= 1, got {args.max_draft}" if args.max_draft < 1
                else "--max-draft applies only with --speculative")
    if args.compile and args.speculative == "on":
        p.error("--compile and --speculative do not combine: choose one")
    if args.compile:  # compiled steps take no guesses
        args.speculative = "off"
    if given and not args.do_sample:
        p.error(f"{', '.join(given)} apply only with --do-sample")
    if args.input is not None and args.output is None:
        p.error("--input needs --output")
    if args.text is not None and (args.output is not None or args.resume):
        p.error("--text prints its result: --output and --resume do not apply")


def settings_from(args) -> ExtractionSettings:
    from dataclasses import replace

    from chatglm_tune.options import SamplingOptions

    chosen = {k: getattr(args, k) for k in ("top_p", "temperature", "top_k") if getattr(args, k) is not None}
    return ExtractionSettings(batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
                              sampling=SamplingOptions(do_sample=args.do_sample, **chosen), seed=args.seed,
                              drafts=None if args.speculative == "off" else
                              replace(DEFAULT_DRAFTS.capped(args.max_draft), auto=args.speculative == "auto"),
                              compiled=args.compile)


def load(args, source, settings):
    """(model, tokenizer) of `source` on the asked device, dtype and quantization; ValueError first where
    --max-new-tokens outruns the model's context, or --enable-thinking asks a version without thinking."""
    from chatglm_tune.runs import loading
    from chatglm_tune.runtime.checkpoint import read_config_file

    if args.enable_thinking is not None:
        from chatglm_tune.models import registry

        prompt_format = registry.of_directory(source.base).prompt_format_of(source.base)
        if not prompt_format.has_thinking:
            raise ValueError(f"--enable-thinking: {prompt_format.title}'s chat has no thinking (GLM-4.5 / 4.6 / 4.7 "
                             "and GLM-4.7-Flash have)")
    context = loading.context_length(read_config_file(source.base))
    if context and settings.max_new_tokens and settings.max_new_tokens > context:
        raise ValueError(f"--max-new-tokens must be at most the model's context of {context} tokens ({source.base}), "
                         f"got {settings.max_new_tokens}")
    model, tokenizer, line = loading.load_for_inference(
        source, device=args.device, dtype=args.dtype, threads=args.threads, quantization_bit=args.quantization_bit,
        quantize_embedding=args.quantize_embedding, note=lambda text: print(f"infer.py: note: {text}", file=sys.stderr))
    if settings.compiled:
        from chatglm_tune.decoding.static_decoding import unsupported

        why = unsupported(model)
        if why:
            raise ValueError(f"--compile: {why}")
        line += "; decode steps compiled on a static cache"
    print(f"{line}; {speculation_line(settings, model)}", file=sys.stderr)
    return model, tokenizer


def speculation_line(settings, model=None) -> str:
    """What decoding does with guesses; ValueError where --speculative on asks it of a model that cannot take them
    back (`speculative.refusal`: `auto` then decodes plainly)."""
    from chatglm_tune.decoding.speculative import refusal

    drafts = settings.drafts
    if drafts is None:
        return "speculative decoding off"
    if not settings.sampling.greedy:
        return "speculative decoding off (sampling decodes plainly)"
    why = None if model is None else refusal(model)
    if why and not drafts.auto:
        raise ValueError(f"--speculative on: {why}")
    if why:
        return f"speculative decoding off ({why})"
    when = "auto: steps guess where guessing has been faster at their number of rows" if drafts.auto else "on"
    return f"speculative decoding {when} (prompt lookup, up to {drafts.max_draft} guessed tokens checked a forward)"


def run_text(args, settings, source) -> None:
    from chatglm_tune.data.records import SPORecord
    from chatglm_tune.evaluation import extraction

    model, tokenizer = load(args, source, settings)
    record = SPORecord(text=args.text, triples=None, source="--text")
    row = next(r for rows in extraction.extract(model, tokenizer, [record], settings) for r in rows)
    if row["text_truncated"]:
        print(f"infer.py: note: the text was cut to fit max_src_len={settings.encoding.max_src_len} tokens",
              file=sys.stderr)
    print(row["generated"])
    for s, p, o in row["triples"] or ():
        print(f"  ({s}, {p}, {o})")


def run_file(args, settings, source) -> None:
    """Extract every record of --input into --output (one process), or this process's share of them (several:
    `shards`), then the summary of the whole."""
    from dataclasses import replace

    from chatglm_tune.data.records import read_records
    from chatglm_tune.evaluation.shards import World

    records, bad = read_records(args.input, on_bad_record=args.on_bad_record, columns=columns_of(args, source))
    if any(record.response is not None for record in records):  # conversations: free-text gold answers
        settings = replace(settings, free_text=True)
    if bad.total:
        print(bad.summary(), file=sys.stderr)
    identity = source.identity(args.quantization_bit, args.quantize_embedding)
    world = World.from_environment()
    if world.size > 1:
        return run_share(args, settings, source, records, bad, identity, world)
    rows, counts = extract_into(args, args.output, records, identity, settings, source)
    write_summary(args, rows, records, counts, identity, bad, settings)


def extract_into(args, output: Path, records, identity: str, settings, source) -> tuple[list[dict], dict]:
    """(every row of `output`, this run's counts): the records not in it yet extracted and appended as they come
    (`--resume` continues a file; the model loads only where a record is left)."""
    import time

    from tqdm import tqdm

    from chatglm_tune.decoding.speculative import DecodeStats
    from chatglm_tune.evaluation import extraction
    from chatglm_tune.runs import rundir
    from chatglm_tune.runtime.stopping import Stopped, signal_name

    try:  # the output's folder and the record of its model, before the model loads
        output.parent.mkdir(parents=True, exist_ok=True)
        rows = extraction.rows_to_resume(output, records, identity, resume=args.resume)
    except OSError as err:  # under a file, in a read-only folder
        raise rundir.cannot_create(output, err) from None
    start = len(rows)
    if start:
        print(f"resuming after {start} of {len(records)} records", file=sys.stderr)
    model, tokenizer = load(args, source, settings) if start < len(records) else (None, None)
    began, tokens, stats = time.perf_counter(), 0, DecodeStats()
    with open(output, "a", encoding="utf-8") as f, tqdm(total=len(records) - start, unit="rec", file=sys.stderr) as bar:
        if model is not None:
            try:
                for ready in extraction.extract(model, tokenizer, records, settings, start=start, stats=stats):
                    try:
                        extraction.append_rows(f, ready)
                    finally:  # counted even where Ctrl-C lands while they are pushed to disk: they are in the file
                        rows.extend(ready)
                    tokens += sum(r["new_tokens"] for r in ready)
                    bar.update(len(ready))
            except KeyboardInterrupt as interrupt:
                bar.close()
                raise Stopped(signal_name(interrupt), f"after {len(rows)} of {len(records)} records (in {output}); "
                              "the same command with --resume continues from there") from None
    return rows, {"new_rows": len(rows) - start, "new_tokens": tokens, "seconds": time.perf_counter() - began,
                  "stats": stats}


def run_share(args, settings, source, records, bad, identity: str, world) -> None:
    """This process's share of the records into its part file; the last process to finish merges the parts and writes
    the summary of the whole (`shards`)."""
    from chatglm_tune.evaluation import extraction, shards

    others = shards.parts_of_another_launch(args.output, world)
    if others:
        raise ValueError(f"{others[0]} is a part of a run over another number of processes: resume it with as many "
                         "processes, or choose another --output")
    if args.output.exists() and args.output.stat().st_size:
        if not args.resume:
            raise ValueError(f"{args.output} exists: pass --resume to continue it, or remove it")
        if len(extraction.rows_to_resume(args.output, records, identity, resume=True)) == len(records):
            print(f"infer.py: {args.output} holds every record already: nothing to do", file=sys.stderr)
            return
    if args.device == "auto":  # one GPU a process where there are GPUs (LOCAL_RANK: its place on this machine)
        import os

        import torch

        if torch.cuda.is_available():
            args.device = f"cuda:{int(os.environ.get('LOCAL_RANK', world.rank)) % torch.cuda.device_count()}"
    part = world.part(args.output)
    _, counts = extract_into(args, part, world.share(records), identity, settings, source)
    shards.mark_done(part, {k: v for k, v in counts.items() if k != "stats"})
    merged = shards.merge_if_last(args.output, world, len(records), identity)
    if merged is None:
        print(f"infer.py: process {world.rank} of {world.size} wrote its share ({part}); the last one to finish merges",
              file=sys.stderr)
        return
    rows, parts = merged
    total = {"new_rows": sum(c["new_rows"] for c in parts), "new_tokens": sum(c["new_tokens"] for c in parts),
             "seconds": max(c["seconds"] for c in parts), "stats": None, "processes": world.size}
    write_summary(args, rows, records, total, identity, bad, settings)


def write_summary(args, rows, records, counts: dict, identity: str, bad, settings) -> None:
    """`<output>.summary.json` (written whole) and its lines on the screen."""
    import json
    from dataclasses import asdict

    from chatglm_tune.evaluation import extraction
    from chatglm_tune.runtime.checkpoint import atomic_write

    summary = extraction.summarize(rows, records, new_rows=counts["new_rows"], new_tokens=counts["new_tokens"],
                                   seconds=counts["seconds"], stats=counts["stats"],
                                   processes=counts.get("processes", 1))
    summary.update(input=str(args.input), output=str(args.output), model=identity, bad_records=bad.to_dict(),
                   settings=asdict(settings))
    path = args.output.with_name(args.output.name + ".summary.json")
    atomic_write(path, lambda p: Path(p).write_text(json.dumps(summary, ensure_ascii=False, indent=2)))
    print(extraction.format_summary(summary))
    print(f"wrote {args.output} and {path}")


def columns_of(args, source):
    """The data shape: the prompt/response columns given, else the run's."""
    from chatglm_tune.options import DataColumns

    given = DataColumns(prompt=args.prompt_column, response=args.response_column, history=args.history_column)
    return given if given.active else source.columns


def main(argv=None) -> None:
    """Extract; SIGTERM and SIGUSR1 stop it as Ctrl-C does (the rows written stay; exit 128 + the signal's number)."""
    from dataclasses import replace

    from chatglm_tune.runtime.stopping import exit_status, signal_name, signals_stop

    args = parse_args(argv)
    try:
        with signals_stop():
            from chatglm_tune.runs import loading

            source = loading.resolve_run(args.model, ptuning_checkpoint=args.ptuning_checkpoint, lora=args.lora)
            # the prompt and budget it was trained with; free-text answers are not parsed as triples
            encoding = source.encoding if args.enable_thinking is None else replace(
                source.encoding, enable_thinking=args.enable_thinking)
            settings = replace(settings_from(args), encoding=encoding, free_text=columns_of(args, source).active)
            if args.text is not None:
                run_text(args, settings, source)
            else:
                run_file(args, settings, source)
    except (ValueError, FileNotFoundError) as err:  # bad input, settings or model directory; RecordError included
        print(f"infer.py: error: {err}", file=sys.stderr)
        sys.exit(2)  # as argparse's usage errors and train.py's
    except KeyboardInterrupt as interrupt:
        print(f"infer.py: interrupted by {signal_name(interrupt)} {getattr(interrupt, 'where', '')}".rstrip(),
              file=sys.stderr)
        sys.exit(exit_status(interrupt))


if __name__ == "__main__":
    main()
