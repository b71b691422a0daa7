"""Triple extraction metrics: parse generated text into triples, score them against gold triples.

Parsing (`parse_triples`): the generated text is split into lines; each line is stripped, blank lines
are ignored, and a line must split on `_` into exactly three non-empty parts (each stripped) to be a
triple. Any other line is malformed: it is counted, never fatal. Triples are deduplicated within a
record, first occurrence kept.

Scoring (`SPOScorer`, one record at a time so inference can stream). Within a record, predictions and
gold are sets: a duplicated gold triple counts once. Triples are compared after Unicode NFKC
normalisation of each part, because the ChatGLM tokenizer normalises its input with NFKC (full-width
`：１` become `:1`) and so can never generate the gold's full-width form.

- micro P/R/F1: true positives, predictions and gold triples summed over the records, then
  P = tp / pred, R = tp / gold.
- per-sample F1 (`sample_f1`): F1 of each record, averaged over records; the score the well-known
  ChatGLM SPO fine-tuning repositories report (liucongg/ChatGLM-Finetuning `predict_*.py`: P = 0 when
  nothing was predicted, R = tp / gold, F1 = 0 when P + R = 0). Our convention where those scripts
  are undefined or odd: a record with no gold triple and no predicted triple scores F1 = 1.0 (the
  reference scores it 0, because it counts the empty answer line as a gold triple); no gold but some
  prediction scores 0.
- per relation: micro P/R/F1 restricted to the triples with that predicate.
The same convention holds for every P/R/F1 here: a ratio whose denominator is 0 is 1.0 when both
counts are 0 (nothing to find, nothing claimed) and 0.0 otherwise.
"""

from __future__ import annotations

import unicodedata
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Iterable, Sequence

from chatglm_tune.data.records import Triple, answer_lines


@dataclass(frozen=True)
class ParsedGeneration:
    """Triples parsed from generated text (deduplicated, in order) and the lines that were not triples."""

    triples: tuple[Triple, ...]
    malformed: tuple[str, ...]


def parse_triples(text: str) -> ParsedGeneration:
    """Generated answer text -> `ParsedGeneration` (rules in the module docstring)."""
    triples: dict[Triple, None] = {}  # an ordered set
    malformed = []
    for _, line, parts in answer_lines(text):
        if len(parts) == 3 and all(parts):
            triples.setdefault(Triple(*parts), None)
        else:
            malformed.append(line)
    return ParsedGeneration(tuple(triples), tuple(malformed))


@dataclass(frozen=True)
class PRF:
    """Precision, recall and F1 with the counts they come from."""

    precision: float
    recall: float
    f1: float
    tp: int
    n_pred: int
    n_gold: int

    @classmethod
    def from_counts(cls, tp: int, n_pred: int, n_gold: int) -> "PRF":
        p = _ratio(tp, n_pred, empty=n_gold == 0)
        r = _ratio(tp, n_gold, empty=n_pred == 0)
        f1 = 2 * p * r / (p + r) if p + r else 0.0
        return cls(p, r, f1, tp, n_pred, n_gold)


def _ratio(num: int, den: int, *, empty: bool) -> float:
    """num / den; when den is 0: 1.0 if the other side is empty too, else 0.0."""
    if den:
        return num / den
    return 1.0 if empty else 0.0


def _key(t: Triple) -> Triple:
    return Triple(*(unicodedata.normalize("NFKC", part).strip() for part in (t.subject, t.predicate, t.object)))


def score_record(predicted: Iterable[Triple], gold: Iterable[Triple]) -> PRF:
    """P/R/F1 of one record, set semantics."""
    pred_set, gold_set = {_key(t) for t in predicted}, {_key(t) for t in gold}
    return PRF.from_counts(len(pred_set & gold_set), len(pred_set), len(gold_set))


@dataclass
class SPOScores:
    """The result of a scoring run; `micro` and `sample_f1` are None when no record had a gold answer."""

    records: int  # records added
    scored_records: int  # of which had a gold answer
    malformed_lines: int  # generated lines that were not triples, over all records
    micro: PRF | None
    sample_f1: float | None  # mean per-record F1 over the scored records
    per_relation: dict[str, PRF] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "records": self.records,
            "scored_records": self.scored_records,
            "malformed_lines": self.malformed_lines,
            "micro": None if self.micro is None else asdict(self.micro),
            "sample_f1": self.sample_f1,
            "per_relation": {rel: asdict(prf) for rel, prf in sorted(self.per_relation.items())},
        }


class SPOScorer:
    """Accumulates records one at a time; `result()` may be called at any point."""

    def __init__(self):
        self.records = 0
        self.scored_records = 0
        self.malformed_lines = 0
        self.f1_sum = 0.0
        self.tp, self.n_pred, self.n_gold = Counter(), Counter(), Counter()  # by predicate

    def add(self, generated: str, gold: Iterable[Triple] | None) -> PRF | None:
        """Parse one generated answer and score it against `gold` (None: count the record, score nothing).

        Returns the record's P/R/F1, or None without gold.
        """
        parsed = parse_triples(generated)
        self.malformed_lines += len(parsed.malformed)
        return self.add_triples(parsed.triples, gold)

    def add_triples(self, predicted: Iterable[Triple], gold: Iterable[Triple] | None) -> PRF | None:
        """Like `add` for predictions that are already triples."""
        self.records += 1
        if gold is None:
            return None
        pred_set, gold_set = {_key(t) for t in predicted}, {_key(t) for t in gold}
        hits = pred_set & gold_set
        for counts, triples in ((self.n_pred, pred_set), (self.n_gold, gold_set), (self.tp, hits)):
            counts.update(t.predicate for t in triples)
        score = PRF.from_counts(len(hits), len(pred_set), len(gold_set))
        self.scored_records += 1
        self.f1_sum += score.f1
        return score

    def result(self) -> SPOScores:
        if not self.scored_records:
            return SPOScores(self.records, 0, self.malformed_lines, None, None, {})
        relations = set(self.n_pred) | set(self.n_gold)
        per_relation = {rel: PRF.from_counts(self.tp[rel], self.n_pred[rel], self.n_gold[rel])
                        for rel in sorted(relations)}
        micro = PRF.from_counts(sum(self.tp.values()), sum(self.n_pred.values()), sum(self.n_gold.values()))
        sample_f1 = self.f1_sum / self.scored_records
        return SPOScores(self.records, self.scored_records, self.malformed_lines, micro, sample_f1, per_relation)


def score_answers(generated: Sequence[str], records: Sequence, calls: Sequence | None = None) -> dict:
    """The scores of a run, `generated[i]` against the gold answer of `records[i]` (SPORecords).

    SPO records: the triple scores (`SPOScores.to_dict`). Records with a free-text `response`
    (prompt/response data): the official generation metrics (`textmetrics`), over the records that have
    one, and where gold answers call tools, `tool_calls`: the calls read from the answers (`calls[i]`, a
    `dialogues.ToolCall` or None) scored by `callmetrics.score_calls`. `score` is the number a best checkpoint
    is chosen by: micro F1; the tool-call exact match where every gold answer is a call (a dev set of calls:
    ROUGE-L of a call's text rises with its format long before its arguments come right); else ROUGE-L / 100
    (None without gold).
    """
    if len(generated) != len(records):
        raise ValueError(f"{len(generated)} generations for {len(records)} records")
    kind = score_kind(records)
    if kind != "triples":
        from chatglm_tune.evaluation.callmetrics import score_calls
        from chatglm_tune.evaluation.textmetrics import GenerationScorer

        scorer = GenerationScorer()
        pairs = [(g, r.response) for g, r in zip(generated, records) if r.response is not None]
        for prediction, reference in pairs:
            scorer.add(prediction, reference)
        result = scorer.result()
        tool_calls = score_calls(calls if calls is not None else [None] * len(records), records)
        return {**result, "records": len(records), "scored_records": len(pairs),
                "score": tool_calls["exact_match"] if kind == "calls" else result["rouge-l"] / 100,
                **({"tool_calls": tool_calls} if tool_calls is not None else {})}
    scorer = SPOScorer()
    for text, record in zip(generated, records):
        scorer.add(text, record.triples)
    scores = scorer.result().to_dict()
    return {**scores, "score": None if scores["micro"] is None else scores["micro"]["f1"]}


def score_kind(records: Sequence) -> str:
    """What a run's `score` over `records` is (`score_answers`): "triples" (micro F1) for SPO records, "calls"
    (the tool-call exact match) where every record with a free-text `response` has a call as its gold answer,
    else "text" (ROUGE-L / 100)."""
    answered = [r for r in records if r.response is not None]
    if not answered:
        return "triples"
    from chatglm_tune.evaluation.callmetrics import gold_call

    return "calls" if all(gold_call(r) is not None for r in answered) else "text"


def format_score(score: float, records: Sequence) -> str:
    """A best-checkpoint `score` of dev `records` as the evaluations print it: `micro F1 0.9760` for triples,
    `tool-call exact match 0.9600` for a dev set of calls, else `rouge-l 45.8712` (`score_kind`)."""
    kind = score_kind(records)
    if kind == "triples":
        return f"micro F1 {score:.4f}"
    return f"tool-call exact match {score:.4f}" if kind == "calls" else f"rouge-l {score * 100:.4f}"


def describe_scores(scores: dict) -> str:
    """One line of a run's scores: triple P/R/F1, or the generation metrics (`rouge-l`, `bleu-4`...)."""
    if "rouge-l" in scores:
        from chatglm_tune.evaluation.callmetrics import format_calls
        from chatglm_tune.evaluation.textmetrics import format as format_generation

        calls = scores.get("tool_calls")
        return format_generation(scores) + ("" if calls is None else f"; {format_calls(calls)}")
    if scores["micro"] is None:
        return "no gold answers: nothing scored"
    m = scores["micro"]
    return f"micro P/R/F1: {m['precision']:.4f} / {m['recall']:.4f} / {m['f1']:.4f}"
