"""Triple extraction over SPO records: prompts in, rows and scores out (what `infer.py` does, as a library).

- `extract`: records -> output rows, in input order. Prompts are built as in training
  (`batches.prompt_ids`); the records are taken `SORT_WINDOW_BATCHES * batch_size` at a time in input
  order, sorted by prompt length (longest first) inside that window to cut padding, decoded in
  left-padded batches, and released as soon as every earlier record is done. So rows come out batch
  by batch, in input order, and a killed run has written a prefix of the input.
- `rows_to_resume`: whether and where an output file continues. A new run refuses an output that
  holds rows; `--resume` takes the rows an earlier (possibly killed) run wrote, a torn last line cut
  off, and checks that they are a prefix of this input (same index and text per row) written by the
  same model (recorded beside the output in `<output>.model.json`).
- `summarize`: micro P/R/F1, per-sample average F1 and per-relation F1 over every row of the
  output (resumed ones included), plus this run's records/s and tokens/s.

Loading the model a `--model` directory describes is `loading.load_run`'s job.

A row: `index` (0-based, among the records read), `source` (file:line), `text`, `text_truncated` (the
prompt was cut to max_src_len tokens), `answer` (the gold answer text, or null), `generated` (decoded,
stripped), `triples` ([[s, p, o], ...]; null for free-text answers, which are not triples), `malformed`
(generated lines that are not triples; null for free text), `tool_call` (a conversation's answer that calls a
tool: {"name", "arguments"}, the first where it calls several; else null), `tool_calls` (all of them, in order),
`reasoning` (what a thinking model reasoned before its answer, `xml_calls.split_reasoning`; else null),
`call_match` (whether they are the gold calls: null where the gold answer calls no tool), `new_tokens`
(generated ids, `<eop>` included), `stopped` ("eos" or "length"), and `precision`/`recall`/`f1` of the record
(null without gold). Rows hold no timings, so a resumed greedy run writes the same file as an uninterrupted one.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

from chatglm_tune.data.batches import SpecialIds, collate_prompts
from chatglm_tune.data.dialogues import ToolCall
from chatglm_tune.data.xml_calls import THINK_CLOSE, split_reasoning
from chatglm_tune.data.records import SPORecord
from chatglm_tune.decoding.drafting import Drafter
from chatglm_tune.decoding.generation import generate
from chatglm_tune.decoding.speculative import DecodeStats
from chatglm_tune.evaluation.callmetrics import gold_calls, record_tools
from chatglm_tune.evaluation.metrics import describe_scores, parse_triples, score_answers, score_record
from chatglm_tune.options import ExtractionSettings
from chatglm_tune.runtime import crashpoints
from chatglm_tune.runtime.checkpoint import atomic_write

SORT_WINDOW_BATCHES = 8  # records sorted by length within windows of this many batches


# ----------------------------------------------------------------------------------------------
# Running


def extract(
    model, tokenizer, records: Sequence[SPORecord], settings: ExtractionSettings, *, start: int = 0,
    stats: DecodeStats | None = None,
) -> Iterator[list[dict]]:
    """Rows for `records[start:]`, yielded after each batch: the rows that became ready, in input order.
    `stats` counts the forwards and accepted guesses of speculative decoding (`settings.drafts`)."""
    window = SORT_WINDOW_BATCHES * settings.batch_size
    prompt_format = tokenizer.prompt_format
    drafter = None if settings.drafts is None else Drafter(settings.drafts)  # later batches guess from earlier answers
    for lo in range(start, len(records), window):
        indices = range(lo, min(lo + window, len(records)))
        encoded = {i: prompt_format.prompt_ids(tokenizer, records[i], settings.encoding) for i in indices}
        prompts = {i: ids for i, (ids, _) in encoded.items()}
        order = sorted(indices, key=lambda i: -len(prompts[i]))  # stable: ties keep input order
        done: dict[int, dict] = {}
        next_out = lo
        for b in range(0, len(order), settings.batch_size):
            batch = order[b : b + settings.batch_size]
            for i, new_ids in zip(batch, _decode_batch(model, tokenizer, [prompts[i] for i in batch], batch, settings,
                                                       drafter, stats)):
                done[i] = make_row(i, records[i], tokenizer, new_ids, text_truncated=encoded[i][1],
                                   free_text=settings.free_text)
            ready = []
            while next_out in done:
                ready.append(done.pop(next_out))
                next_out += 1
            yield ready


def _decode_batch(model, tokenizer, prompts: list[list[int]], indices: list[int], settings: ExtractionSettings,
                  drafter: Drafter | None, stats: DecodeStats | None) -> list[list[int]]:
    batch = collate_prompts(prompts, SpecialIds.of(tokenizer))
    seeds = None if settings.seed is None else [settings.seed + i for i in indices]
    return generate(model, batch["input_ids"], batch["attention_mask"], max_new_tokens=settings.new_tokens,
                    sampling=settings.sampling, eos_token_id=tokenizer.prompt_format.stop_ids(tokenizer), seed=seeds,
                    vocab_limit=len(tokenizer), drafts=drafter, stats=stats, compiled=settings.compiled)


def make_row(index: int, record: SPORecord, tokenizer, new_ids: list[int], *, text_truncated: bool = False,
             free_text: bool = False) -> dict:
    """The output row of one record (fields in the module docstring); a free-text answer is not parsed
    as triples."""
    prompt_format = tokenizer.prompt_format
    generated = prompt_format.decode_answer(tokenizer, new_ids)
    parsed = None if free_text else parse_triples(generated)
    score = None if record.triples is None or parsed is None else score_record(parsed.triples, record.triples)
    calls = prompt_format.read_calls(generated, record_tools(record)) if record.dialogue else ()
    gold = gold_calls(record)
    return {
        "index": index,
        "source": record.source,
        "text": record.text,
        "text_truncated": text_truncated,
        "answer": record.answer,
        "generated": generated,
        "triples": None if parsed is None else [[t.subject, t.predicate, t.object] for t in parsed.triples],
        "malformed": None if parsed is None else list(parsed.malformed),
        "reasoning": split_reasoning(generated, THINK_CLOSE in generated)[0] if prompt_format.has_thinking else None,
        "tool_call": calls[0].to_json() if calls else None,
        "tool_calls": [call.to_json() for call in calls],
        "call_match": calls == gold if gold else None,
        "new_tokens": len(new_ids),
        "stopped": "eos" if new_ids and new_ids[-1] in prompt_format.stop_ids(tokenizer) else "length",
        "precision": None if score is None else score.precision,
        "recall": None if score is None else score.recall,
        "f1": None if score is None else score.f1,
    }


# ----------------------------------------------------------------------------------------------
# Resuming and scoring


def _row_calls(row: dict) -> tuple[ToolCall, ...]:
    """The calls of an output row (`tool_calls`; a row written before it: its one `tool_call`)."""
    written = row.get("tool_calls", [row["tool_call"]] if row.get("tool_call") else [])
    return tuple(ToolCall(**call) for call in written)


def rows_to_resume(output: Path, records: Sequence[SPORecord], model: str, *, resume: bool) -> list[dict]:
    """The rows `output` already holds for this run to keep (none for a new file), after the checks in
    the module docstring; records `model` (a description of the model) beside a new output."""
    output = Path(output)
    identity = output.with_name(output.name + ".model.json")
    if not resume:
        if output.exists() and output.stat().st_size:
            raise ValueError(f"{output} exists: pass --resume to continue it, or remove it")
        atomic_write(identity, lambda p: Path(p).write_text(json.dumps({"model": model}, ensure_ascii=False)))
        return []
    if identity.exists():
        earlier = json.loads(identity.read_text(encoding="utf-8"))["model"]
        if earlier != model:
            raise ValueError(f"{output} was written by {earlier}; this run's model is {model}: resume it with the same "
                             "model, or choose another --output")
    elif output.exists() and output.stat().st_size:
        raise ValueError(f"{output} does not say which model wrote it (no {identity.name}): cannot resume it")
    else:
        atomic_write(identity, lambda p: Path(p).write_text(json.dumps({"model": model}, ensure_ascii=False)))
    return _completed_rows(output, records)


def _completed_rows(output: Path, records: Sequence[SPORecord]) -> list[dict]:
    """Rows already in `output` (a prefix of `records`); a torn last line (a killed write) is cut off."""
    if not output.exists():
        return []
    data = output.read_bytes()
    complete = data[: data.rfind(b"\n") + 1]  # drop a last line that has no newline yet
    if len(complete) != len(data):
        with open(output, "r+b") as f:
            f.truncate(len(complete))
    rows = []
    for number, line in enumerate(complete.decode("utf-8").splitlines(), start=1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{output}, line {number}: not valid JSON ({err.msg}); not an output of "
                             "infer.py?") from None
        i = len(rows)
        if row.get("index") != i or i >= len(records) or row.get("text") != records[i].text:
            raise ValueError(
                f"{output}, line {number}: expected the row of record {i} of the input in order; the output "
                "belongs to another input (or other --on-bad-record setting): remove it or choose another --output"
            )
        rows.append(row)
    return rows


def append_rows(f, rows: list[dict]) -> None:
    """Write rows as JSON lines and push them to disk (a killed run keeps every row it wrote)."""
    if rows:
        crashpoints.reached("append")
        f.write("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
        f.flush()
        os.fsync(f.fileno())


def summarize(rows: Sequence[dict], records: Sequence[SPORecord], *, new_rows: int, new_tokens: int, seconds: float,
              stats: DecodeStats | None = None, processes: int = 1) -> dict:
    """The run summary: scores over every row, throughput of this run's rows on its `processes` (and, where it
    guessed, speculative decoding's tokens a forward and acceptance)."""
    summary = {
        "records": len(rows),
        "this_run": {
            "processes": processes,
            "records": new_rows,
            "new_tokens": new_tokens,
            "seconds": round(seconds, 3),
            "records_per_s": new_rows / seconds if seconds > 0 else None,
            "tokens_per_s": new_tokens / seconds if seconds > 0 else None,
        },
        "stopped_at_length": sum(row["stopped"] == "length" for row in rows),
        "texts_truncated": sum(bool(row.get("text_truncated")) for row in rows),
        "scores": score_answers([row["generated"] for row in rows], [records[row["index"]] for row in rows],
                                [_row_calls(row) for row in rows]),
    }
    if stats is not None and stats.forwards:
        summary["this_run"]["speculative"] = {
            "forwards": stats.forwards, "tokens_per_forward": round(stats.tokens_per_forward, 3),
            "drafted": stats.drafted, "accepted": stats.accepted, "acceptance": round(stats.acceptance, 3)}
    return summary


def format_summary(summary: dict) -> str:
    """A few human-readable lines of `summarize`'s result."""
    scores, run = summary["scores"], summary["this_run"]
    shared = f", {run['processes']} processes" if run.get("processes", 1) > 1 else ""
    lines = [f"records: {summary['records']} ({run['records']} this run{shared}), cut at max_new_tokens: "
             f"{summary['stopped_at_length']}",
             describe_scores(scores)]
    if summary.get("texts_truncated"):
        max_src_len = summary.get("settings", {}).get("encoding", {}).get("max_src_len", "max_src_len")
        lines.insert(1, f"texts cut to fit max_src_len={max_src_len} tokens: {summary['texts_truncated']} "
                        "(their rows say text_truncated: true)")
    if scores.get("micro") is not None:
        lines[-1] += f"   per-sample F1: {scores['sample_f1']:.4f}   malformed lines: {scores['malformed_lines']}"
        for relation, prf in scores["per_relation"].items():
            lines.append(f"  {relation}: P {prf['precision']:.4f}  R {prf['recall']:.4f}  F1 {prf['f1']:.4f}  (gold "
                         f"{prf['n_gold']})")
    if run["records_per_s"] is not None:
        lines.append(f"throughput: {run['records_per_s']:.2f} records/s, {run['tokens_per_s']:.1f} tokens/s")
    if run.get("speculative"):
        spec = run["speculative"]
        lines.append(f"speculative decoding: {spec['tokens_per_forward']:.2f} tokens a row a forward, "
                     f"{spec['accepted']} of {spec['drafted']} guessed tokens taken ({spec['acceptance']:.0%})")
    return "\n".join(lines)
