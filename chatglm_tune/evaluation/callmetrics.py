"""Tool-call accuracy: whether the model called the right tool with the right arguments.

A record's gold call is its conversation's gold answer where that answer calls a tool (`dialogues.ToolCall`: a
ChatGLM3 tool turn, a GLM-4 message with metadata or a `{"name", "arguments"}` content); the predicted call is
what the version reads from the generated answer (`PromptFormat.read_call`), None for a text answer.

- `exact_match`: over the records with a gold call, the share whose predicted call has the same tool name and
  equal arguments (as JSON values: key order does not count, 100 and 100.0 are equal, "100" is not).
- `right_tool`: the share that call the right tool, whatever the arguments.
- `text_for_call`: records with a gold call answered in text; `call_for_text`: records with a text gold answer
  that got a call instead.
"""

from __future__ import annotations

from typing import Sequence

from chatglm_tune.data.dialogues import ToolCall


def gold_call(record) -> ToolCall | None:
    """The call a record's gold answer makes, None where it answers in text (or has no conversation)."""
    answer = None if record.dialogue is None else record.dialogue.answer
    return None if answer is None else answer.call


def score_calls(predicted: Sequence[ToolCall | None], records: Sequence) -> dict | None:
    """The tool-call scores (module docstring) of `predicted[i]` against `records[i]`; None where no record's gold
    answer is a call (nothing to score)."""
    gold = [gold_call(r) for r in records]
    pairs = [(p, g) for p, g in zip(predicted, gold) if g is not None]
    if not pairs:
        return None
    right_tool = sum(p is not None and p.name == g.name for p, g in pairs)
    exact = sum(p is not None and p.name == g.name and p.arguments == g.arguments for p, g in pairs)
    return {"calls": len(pairs), "exact_match": exact / len(pairs), "right_tool": right_tool / len(pairs),
            "text_for_call": sum(p is None for p, _ in pairs),
            "call_for_text": sum(p is not None and g is None and r.dialogue is not None
                                 and r.dialogue.answer is not None for p, g, r in zip(predicted, gold, records))}


def format_calls(scores: dict) -> str:
    """One line: `tool calls: exact match 0.9500 (right tool 0.9800) of 100`."""
    return (f"tool calls: exact match {scores['exact_match']:.4f} (right tool {scores['right_tool']:.4f}) "
            f"of {scores['calls']}")
