"""`train.py --dry-run`: the run's data as the model would see it, before any weight is loaded.

It builds the tokenizer (a tiny preset's is trained on the data and written to the output directory, as the run
would; a model directory's is read), encodes every training record into its row as training would (`encode_record`),
writes them to `examples.jsonl` in the output directory (one line a record: its source, `input_ids`, `labels` with
-100 where nothing is learned, whether the row was cut) and the report to `dry_run.json`, and prints the report and
the first example decoded with its trained spans marked. A record that cannot become a row stops it with its file
and line, as the run would stop.

`dry_run.json` is written first (`{"state": "building"}`) and last (the report): a directory holding it and no run
is a dry run's, finished or killed, which the next run or dry run into it replaces (`rundir.prepare_output_dir`).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from chatglm_tune.data.batches import IGNORE_INDEX, encode_record
from chatglm_tune.models import registry
from chatglm_tune.options import TINY_PRESETS, TrainOptions
from chatglm_tune.runs.rundir import DRY_RUN_REPORT, EXAMPLES_FILE
from chatglm_tune.runtime.checkpoint import atomic_write
from chatglm_tune.tuning.training import tiny_tokenizer

TRAINED_OPEN, TRAINED_CLOSE = "⟦", "⟧"  # around the trained spans of the example printed


def dry_run(model_arg: str, base: Path | None, train_records, dev_records, output_dir: Path,
            options: TrainOptions) -> dict:
    """Build the tokenizer and every training row, write `examples.jsonl` and `dry_run.json` into `output_dir`, print
    the report and the first example; the report."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    write_json(output_dir / DRY_RUN_REPORT, {"state": "building"})  # first: a killed dry run's files are known as such
    if model_arg in TINY_PRESETS:
        tokenizer = tiny_tokenizer(train_records, output_dir, options, model_arg)
    else:
        tokenizer = registry.of_directory(base).load_tokenizer(base)
    examples = [encode_record(record, tokenizer, options.encoding) for record in train_records]
    lines = "".join(json.dumps({"source": e.source, "input_ids": list(e.input_ids), "labels": list(e.labels),
                                "truncated": e.source_truncated or e.answer_truncated or e.row_truncated}) + "\n"
                    for e in examples)
    atomic_write(output_dir / EXAMPLES_FILE, lambda path: Path(path).write_text(lines, encoding="utf-8"))
    report = data_report(train_records, dev_records, examples, tokenizer, options)
    write_json(output_dir / DRY_RUN_REPORT, report)
    print(format_report(report))
    print(f"first example ({examples[0].source}), trained spans inside {TRAINED_OPEN} {TRAINED_CLOSE}:")
    print(marked_example(tokenizer, examples[0]))
    print(f"wrote {len(examples)} rows to {output_dir / EXAMPLES_FILE}; no weights were loaded")
    return report


def write_json(path: Path, value: dict) -> None:
    atomic_write(path, lambda tmp: Path(tmp).write_text(json.dumps(value, indent=2, ensure_ascii=False),
                                                         encoding="utf-8"))


def data_report(train_records, dev_records, examples, tokenizer, options: TrainOptions) -> dict:
    """Counts of the records, their turns and the rows: what a run on them trains."""
    turns = [t for r in train_records if r.dialogue for t in r.dialogue.turns]
    lengths = [len(e.input_ids) for e in examples]
    trained = [sum(label != IGNORE_INDEX for label in e.labels) for e in examples]
    shapes = Counter(r.dialogue.form if r.dialogue else "text" for r in train_records)
    return {
        "version": tokenizer.prompt_format.title,
        "train_records": len(train_records), "dev_records": len(dev_records), "shapes": dict(sorted(shapes.items())),
        "assistant_turns": sum(t.role == "assistant" for t in turns),
        "trained_turns": sum(t.role == "assistant" and t.loss for t in turns),
        "reasoning_turns": sum(bool(t.reasoning) for t in turns),
        "tool_calls": sum(len(t.all_calls) for t in turns), "tool_results": sum(t.role == "observation" for t in turns),
        "tokens": sum(lengths), "trained_tokens": sum(trained), "longest_row": max(lengths),
        "mean_row": round(sum(lengths) / len(lengths), 1), "max_len": options.encoding.max_len,
        "rows_cut": sum(e.row_truncated for e in examples), "sources_cut": sum(e.source_truncated for e in examples),
        "answers_cut": sum(e.answer_truncated for e in examples), "loss_on": options.encoding.loss_on,
        "enable_thinking": options.encoding.enable_thinking, "clear_thinking": options.encoding.clear_thinking,
        "reasoning_effort": options.encoding.reasoning_effort,
    }


def format_report(report: dict) -> str:
    """The report in a few lines."""
    shapes = ", ".join(f"{count} {shape}" for shape, count in report["shapes"].items())
    return "\n".join([
        f"dry run: {report['version']}, {report['train_records']} train records ({shapes}), "
        f"{report['dev_records']} dev",
        f"turns: {report['assistant_turns']} assistant ({report['trained_turns']} with a loss, --loss-on "
        f"{report['loss_on']}), {report['reasoning_turns']} reasoning, {report['tool_calls']} tool calls, "
        f"{report['tool_results']} tool results",
        f"rows: {report['tokens']} tokens, {report['trained_tokens']} trained; longest {report['longest_row']}, mean "
        f"{report['mean_row']} (max_len {report['max_len']}); cut: {report['rows_cut']} rows, {report['sources_cut']} "
        f"sources, {report['answers_cut']} answers",
    ])


def marked_example(tokenizer, example) -> str:
    """The example's ids decoded, each run of trained tokens inside `TRAINED_OPEN` ... `TRAINED_CLOSE`."""
    runs, current, trained = [], [], None
    for token, label in zip(example.input_ids, example.labels):
        learned = label != IGNORE_INDEX
        if learned != trained and current:
            runs.append((trained, current))
            current = []
        current.append(token)
        trained = learned
    runs.append((trained, current))
    return "".join(f"{TRAINED_OPEN}{tokenizer.decode(ids)}{TRAINED_CLOSE}" if learned else tokenizer.decode(ids)
                   for learned, ids in runs)
