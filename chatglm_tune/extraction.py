"""Triple extraction over SPO records: load a model (+ adapter) for inference, run it, resume, score.

What `infer.py` does, as a library:

- `resolve_model_source` / `load_for_inference`: a `--model` directory is a model directory
  (config.json + weights: official, merged, quantized, or a full fine-tuning run), or a P-tuning or
  LoRA run written by `train.py` (`rundir`): its `run_args.json` says the `tuning` and names the base
  `model`; the run holds the prefix weights or the peft adapter. `--ptuning-checkpoint DIR` (official
  or ours: config.json with `pre_seq_len`/`prefix_projection`, prefix weights) or `--lora DIR` (a peft
  adapter) add an adapter to a model directory. The tokenizer comes from the tuned directory when it
  holds one, else from the base, and its special ids must equal the model config's. The prompt and
  length budget (`EncodingOptions`) are the run's `encoding` when the tuned directory is a run, so
  inference prompts are built exactly as the training ones were.
- `extract`: records -> output rows, in input order. Prompts are built as in training
  (`data.prompt_ids`); the records are taken `SORT_WINDOW_BATCHES * batch_size` at a time in input
  order, sorted by prompt length (longest first) inside that window to cut padding, decoded in
  left-padded batches, and released as soon as every earlier record is done. So rows come out batch
  by batch, in input order, and a killed run has written a prefix of the input.
- `completed_rows`: the rows an earlier (possibly killed) run wrote; a torn last line is cut off. The
  output must be a prefix of this input (same index and text per row), or resuming refuses.
- `summarize`: micro P/R/F1, per-sample average F1 and per-relation F1 over every row of the
  output (resumed ones included), plus this run's records/s and tokens/s.

A row: `index` (0-based, among the records read), `source` (file:line), `text`, `answer` (the gold
answer text, or null), `generated` (decoded, stripped), `triples` ([[s, p, o], ...]), `malformed`
(generated lines that are not triples), `new_tokens` (generated ids, `<eop>` included), `stopped`
("eos" or "length"), and `precision`/`recall`/`f1` of the record (null without gold). Rows hold no
timings, so a resumed greedy run writes the same file as an uninterrupted one.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from . import rundir
from .data import EncodingOptions, SpecialIds, SPORecord, collate_prompts, prompt_ids
from .generation import DEFAULT_SAMPLING, SamplingOptions, generate
from .lora import load_lora, merge_lora
from .metrics import SPOScorer, SPOScores, parse_triples, score_record
from .model import ChatGLMForConditionalGeneration
from .quantization import quantize_embedding as quantize_tied_embedding, quantize_model
from .tokenizer import VOCAB_FILE, ChatGLMTokenizer

SORT_WINDOW_BATCHES = 8  # records sorted by length within windows of this many batches
DEFAULT_BATCH_SIZE = 8


# ----------------------------------------------------------------------------------------------
# Loading


@dataclass(frozen=True)
class ModelSource:
    """What to load: a base directory, optionally a P-tuning prefix or a LoRA adapter, the tokenizer,
    and the prompt/length settings the model was trained with (the run's, else the defaults)."""

    base: Path
    tokenizer_dir: Path
    encoding: EncodingOptions = field(default_factory=EncodingOptions)
    pre_seq_len: int | None = None
    prefix_projection: bool = False
    prefix_dir: Path | None = None
    lora_dir: Path | None = None

    def describe(self) -> str:
        if self.prefix_dir is not None:
            adapter = f" + P-tuning prefix {self.prefix_dir} (pre_seq_len={self.pre_seq_len}, projection={self.prefix_projection})"
        elif self.lora_dir is not None:
            adapter = f" + LoRA {self.lora_dir}"
        else:
            adapter = ""
        return f"{self.base}{adapter}"


def resolve_model_source(model_dir, *, ptuning_checkpoint=None, lora=None) -> ModelSource:
    """Work out base, adapter, tokenizer and encoding from `--model` (+ `--ptuning-checkpoint` / `--lora`)."""
    model_dir = Path(model_dir)
    if ptuning_checkpoint is not None and lora is not None:
        raise ValueError("pass at most one of --ptuning-checkpoint and --lora")
    run_args = rundir.read_run_args(model_dir)
    tuning = (run_args or {}).get("tuning", "full")
    if tuning == "full" and (model_dir / rundir.ADAPTER_CONFIG).exists():
        raise FileNotFoundError(
            f"{model_dir} is a LoRA adapter without a {rundir.RUN_ARGS} naming its base: pass the base with --model "
            "and this directory with --lora"
        )
    if tuning == "full" and not (model_dir / "config.json").exists():
        raise FileNotFoundError(f"{model_dir}: not a model directory (no config.json)")
    base, prefix_dir, lora_dir = model_dir, None, None
    if tuning != "full":
        base = Path(run_args["model"])
        if not (base / "config.json").exists():
            raise FileNotFoundError(f"{model_dir / rundir.RUN_ARGS} names base model {base}, which is not a model directory here")
        prefix_dir, lora_dir = (model_dir, None) if tuning == "ptuning" else (None, model_dir)
    if (ptuning_checkpoint is not None or lora is not None) and tuning != "full":
        raise ValueError(f"{model_dir} already holds an adapter (a {tuning} run); do not add another")
    if ptuning_checkpoint is not None:
        prefix_dir = Path(ptuning_checkpoint)
        if not (prefix_dir / "config.json").exists():
            raise FileNotFoundError(f"{prefix_dir}: a P-tuning checkpoint needs its config.json (pre_seq_len, prefix_projection)")
    if lora is not None:
        lora_dir = Path(lora)
        if not (lora_dir / rundir.ADAPTER_CONFIG).exists():
            raise FileNotFoundError(f"{lora_dir}: not a peft adapter directory (no {rundir.ADAPTER_CONFIG})")
    pre_seq_len, projection = None, False
    if prefix_dir is not None:
        prefix_config = json.loads((prefix_dir / "config.json").read_text(encoding="utf-8"))
        pre_seq_len, projection = prefix_config.get("pre_seq_len"), bool(prefix_config.get("prefix_projection"))
        if not pre_seq_len:
            raise ValueError(f"{prefix_dir}/config.json has no pre_seq_len: not a P-tuning checkpoint")
    tuned = prefix_dir or lora_dir or model_dir  # the directory that was trained last
    candidates = list(dict.fromkeys([tuned, model_dir, base]))
    tokenizer_dir = next((d for d in candidates if (d / VOCAB_FILE).exists()), None)
    if tokenizer_dir is None:
        raise FileNotFoundError(f"no tokenizer ({VOCAB_FILE}) in {', '.join(map(str, candidates))}")
    trained_with = (rundir.read_run_args(tuned) or {}).get("encoding")
    encoding = EncodingOptions(**trained_with) if trained_with else EncodingOptions()
    return ModelSource(base, tokenizer_dir, encoding, pre_seq_len, projection, prefix_dir, lora_dir)


def load_for_inference(
    source: ModelSource, *, dtype: torch.dtype | str = torch.float32, device="cpu", quantization_bit: int | None = None,
    quantize_embedding: bool = False,
):
    """(model in eval mode, tokenizer) for `source`; `quantization_bit` 4/8 quantizes the block Linears,
    `quantize_embedding` holds the tied embedding / head as one INT8 copy (`quantization.quantize_embedding`).

    A LoRA adapter on a float base is merged into it (then quantized if asked): decoding pays nothing
    for it. On a base stored quantized it runs beside the integer weights (`lora.load_lora`).
    """
    prefix = {} if source.pre_seq_len is None else {"pre_seq_len": source.pre_seq_len, "prefix_projection": source.prefix_projection}
    if source.lora_dir is None:
        model = ChatGLMForConditionalGeneration.from_pretrained(
            source.base, dtype=dtype, device=device, quantization_bit=quantization_bit,
            quantize_embedding=quantize_embedding, **prefix,
        )
        if source.prefix_dir is not None:
            model.load_prefix(source.prefix_dir)
    else:
        model = ChatGLMForConditionalGeneration.from_pretrained(source.base, dtype=dtype, device=device)
        stored_bits = model.config.quantization_bit
        if quantization_bit and stored_bits and quantization_bit != stored_bits:
            raise ValueError(f"{source.base} holds INT{stored_bits} weights; cannot load them as INT{quantization_bit}")
        model = load_lora(model, source.lora_dir)
        if not stored_bits:
            model = merge_lora(model)
            if quantization_bit:
                quantize_model(model, quantization_bit)
                model.config.quantization_bit = quantization_bit
        if quantize_embedding:  # after the merge, which refuses integer weights (LoRA never targets the head)
            quantize_tied_embedding(model)
    tokenizer = ChatGLMTokenizer.from_pretrained(source.tokenizer_dir)
    check_tokenizer_matches(tokenizer, model.config)
    return model.eval(), tokenizer


def check_tokenizer_matches(tokenizer, config) -> None:
    """ValueError unless the tokenizer's special ids equal the config's and its vocabulary fits the model."""
    ours, theirs = SpecialIds.from_tokenizer(tokenizer), SpecialIds.from_config(config)
    problems = [f"{k}: tokenizer {v}, model {getattr(theirs, k)}" for k, v in asdict(ours).items() if v != getattr(theirs, k)]
    if len(tokenizer) > config.vocab_size:
        problems.append(f"vocabulary: tokenizer {len(tokenizer)} tokens, model {config.vocab_size} rows")
    if problems:
        raise ValueError("the tokenizer does not belong to this model: " + "; ".join(problems))


# ----------------------------------------------------------------------------------------------
# Running


@dataclass(frozen=True)
class ExtractionSettings:
    """Batching, length, sampling and prompt of an extraction run (defaults are infer.py's).

    `max_new_tokens` None: the answer budget the model was trained with, `encoding.max_len -
    encoding.max_src_len` (`<sop>`'s successors up to `<eop>`, as train.py's dev evaluation generates).
    """

    batch_size: int = DEFAULT_BATCH_SIZE
    max_new_tokens: int | None = None
    sampling: SamplingOptions = DEFAULT_SAMPLING
    seed: int | None = None  # record i samples with seed + i
    encoding: EncodingOptions = field(default_factory=EncodingOptions)

    def __post_init__(self):
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")

    @property
    def new_tokens(self) -> int:
        return self.max_new_tokens or self.encoding.max_len - self.encoding.max_src_len


def extract(
    model, tokenizer, records: Sequence[SPORecord], settings: ExtractionSettings, *, start: int = 0
) -> Iterator[list[dict]]:
    """Rows for `records[start:]`, yielded after each batch: the rows that became ready, in input order."""
    window = SORT_WINDOW_BATCHES * settings.batch_size
    for lo in range(start, len(records), window):
        indices = range(lo, min(lo + window, len(records)))
        prompts = {i: prompt_ids(records[i], tokenizer, settings.encoding) for i in indices}
        order = sorted(indices, key=lambda i: -len(prompts[i]))  # stable: ties keep input order
        done: dict[int, dict] = {}
        next_out = lo
        for b in range(0, len(order), settings.batch_size):
            batch = order[b : b + settings.batch_size]
            for i, new_ids in zip(batch, _decode_batch(model, tokenizer, [prompts[i] for i in batch], batch, settings)):
                done[i] = make_row(i, records[i], tokenizer, new_ids)
            ready = []
            while next_out in done:
                ready.append(done.pop(next_out))
                next_out += 1
            yield ready


def _decode_batch(model, tokenizer, prompts: list[list[int]], indices: list[int], settings: ExtractionSettings) -> list[list[int]]:
    batch = collate_prompts(prompts, SpecialIds.from_tokenizer(tokenizer))
    s = settings.sampling
    seeds = None if settings.seed is None else [settings.seed + i for i in indices]
    return generate(
        model, batch["input_ids"], batch["attention_mask"], max_new_tokens=settings.new_tokens,
        do_sample=s.do_sample, top_p=s.top_p, temperature=s.temperature, top_k=s.top_k,
        eos_token_id=tokenizer.eos_token_id, seed=seeds, vocab_limit=len(tokenizer),
    )


def make_row(index: int, record: SPORecord, tokenizer, new_ids: list[int]) -> dict:
    """The output row of one record (fields in the module docstring)."""
    generated = tokenizer.decode(new_ids).strip()
    parsed = parse_triples(generated)
    score = None if record.triples is None else score_record(parsed.triples, record.triples)
    return {
        "index": index,
        "source": record.source,
        "text": record.text,
        "answer": record.answer,
        "generated": generated,
        "triples": [[t.subject, t.predicate, t.object] for t in parsed.triples],
        "malformed": list(parsed.malformed),
        "new_tokens": len(new_ids),
        "stopped": "eos" if new_ids and new_ids[-1] == tokenizer.eos_token_id else "length",
        "precision": None if score is None else score.precision,
        "recall": None if score is None else score.recall,
        "f1": None if score is None else score.f1,
    }


# ----------------------------------------------------------------------------------------------
# Resuming and scoring


def completed_rows(output: Path, records: Sequence[SPORecord]) -> list[dict]:
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
            raise ValueError(f"{output}, line {number}: not valid JSON ({err.msg}); not an output of infer.py?") from None
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
        f.write("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
        f.flush()
        os.fsync(f.fileno())


def score_rows(rows: Sequence[dict], records: Sequence[SPORecord]) -> SPOScores:
    """Micro/per-sample/per-relation scores of output rows against their records' gold triples."""
    scorer = SPOScorer()
    for row in rows:
        scorer.add(row["generated"], records[row["index"]].triples)
    return scorer.result()


def summarize(rows: Sequence[dict], records: Sequence[SPORecord], *, new_rows: int, new_tokens: int, seconds: float) -> dict:
    """The run summary: scores over every row, throughput of this run's rows."""
    return {
        "records": len(rows),
        "this_run": {
            "records": new_rows,
            "new_tokens": new_tokens,
            "seconds": round(seconds, 3),
            "records_per_s": new_rows / seconds if seconds > 0 else None,
            "tokens_per_s": new_tokens / seconds if seconds > 0 else None,
        },
        "stopped_at_length": sum(row["stopped"] == "length" for row in rows),
        "scores": score_rows(rows, records).to_dict(),
    }


def format_summary(summary: dict) -> str:
    """A few human-readable lines of `summarize`'s result."""
    scores, run = summary["scores"], summary["this_run"]
    lines = [f"records: {summary['records']} ({run['records']} this run), cut at max_new_tokens: {summary['stopped_at_length']}"]
    if scores["micro"] is None:
        lines.append("no gold answers: nothing scored")
    else:
        m = scores["micro"]
        lines.append(
            f"micro P/R/F1: {m['precision']:.4f} / {m['recall']:.4f} / {m['f1']:.4f}   "
            f"per-sample F1: {scores['sample_f1']:.4f}   malformed lines: {scores['malformed_lines']}"
        )
        for relation, prf in scores["per_relation"].items():
            lines.append(f"  {relation}: P {prf['precision']:.4f}  R {prf['recall']:.4f}  F1 {prf['f1']:.4f}  (gold {prf['n_gold']})")
    if run["records_per_s"] is not None:
        lines.append(f"throughput: {run['records_per_s']:.2f} records/s, {run['tokens_per_s']:.1f} tokens/s")
    return "\n".join(lines)
