"""Tool-call accuracy: whether the model called the right tool with the right arguments.

A record's gold calls are its conversation's gold answer's calls (`dialogues.ToolCall`s: a ChatGLM3 tool turn, a
GLM-4 message with metadata or a `{"name", "arguments"}` content: one; an OpenAI-style message's `tool_calls`: one
or more); the predicted calls are what the version reads from the generated answer (`PromptFormat.read_calls`,
none for a text answer; a single `ToolCall` or None is read as one call or none).

- `exact_match`: over the records with a gold call, the share whose predicted calls are the gold ones in order:
  the same tool names and equal arguments (as JSON values: key order does not count, 100 and 100.0 are equal,
  "100" is not).
- `right_tool`: the share that call the right tools in order, whatever the arguments.
- `text_for_call`: records with a gold call answered in text; `call_for_text`: records with a text gold answer
  that got a call instead.
"""

from __future__ import annotations

from typing import Sequence

from chatglm_tune.data.dialogues import ToolCall


def gold_call(record) -> ToolCall | None:
    """The (first) call a record's gold answer makes, None where it answers in text (or has no conversation)."""
    calls = gold_calls(record)
    return calls[0] if calls else None


def gold_calls(record) -> tuple[ToolCall, ...]:
    """Every call a record's gold answer makes, in order; () where it answers in text (or has no conversation)."""
    answer = None if record.dialogue is None else record.dialogue.answer
    return () if answer is None else answer.all_calls


def record_tools(record) -> list | None:
    """The tools a record's conversation declares (an OpenAI-style record's, or its system turns'), whose schemas
    type the arguments read from an answer; None where it declares none."""
    dialogue = record.dialogue
    if dialogue is None:
        return None
    tools = [*(dialogue.tools or ()), *(tool for turn in dialogue.turns for tool in turn.tools or ())]
    return tools or None


def _calls(value) -> tuple[ToolCall, ...]:
    """A prediction as calls: a tuple of them, one `ToolCall`, or None (a text answer)."""
    return () if value is None else (value,) if isinstance(value, ToolCall) else tuple(value)


def score_calls(predicted: Sequence, records: Sequence) -> dict | None:
    """The tool-call scores (module docstring) of `predicted[i]` (calls, one call or None) against `records[i]`; None
    where no record's gold answer is a call (nothing to score)."""
    gold = [gold_calls(r) for r in records]
    predicted = [_calls(p) for p in predicted]
    pairs = [(p, g) for p, g in zip(predicted, gold) if g]
    if not pairs:
        return None
    right_tool = sum([c.name for c in p] == [c.name for c in g] for p, g in pairs)
    exact = sum(p == g for p, g in pairs)
    return {"calls": len(pairs), "exact_match": exact / len(pairs), "right_tool": right_tool / len(pairs),
            "text_for_call": sum(not p for p, _ in pairs),
            "call_for_text": sum(bool(p) and not g and r.dialogue is not None
                                 and r.dialogue.answer is not None for p, g, r in zip(predicted, gold, records))}


def format_calls(scores: dict) -> str:
    """One line: `tool calls: exact match 0.9500 (right tool 0.9800) of 100`."""
    return (f"tool calls: exact match {scores['exact_match']:.4f} (right tool {scores['right_tool']:.4f}) "
            f"of {scores['calls']}")
