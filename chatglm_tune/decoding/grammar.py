"""Constrained decoding: an answer held to a grammar (a JSON schema, a tool call's form), through llguidance.

At each step a constrained request's row may only take the tokens that keep its answer a prefix of a sentence of
its grammar (`Constraint.allowed`); the others get -inf before sampling, so greedy and sampled decoding, log
probabilities aside, pick among them alone. Once the grammar is complete the stop ids alone are allowed, so the
answer ends there. llguidance (Rust, no dependencies) computes a step's mask from a token trie, on the engine's
thread, between forwards (its cost: bench/results/grammar-libs.json).

The vocabulary llguidance walks is each id's bytes in decoded text (the tokenizers' `token_bytes`); special and
unused ids are never allowed but where they stop the answer. Forced text (a schema's `{"key":`) is tokenized
greedily, longest token first, over the same bytes: a SentencePiece `encode` would add its leading `▁`.

Grammars are Lark text (`lark`) with JSON schemas embedded (`json_rule`) and ChatGLM3's Python call blocks
(`python_call_rules`).
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Mapping, Sequence

import torch

SPECIAL = b"\xff"  # llguidance's mark of a token that stands for no text
_BITS = torch.arange(32, dtype=torch.int32)
_VOCABULARIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> {rows: (LLTokenizer, eos id)}


class GrammarError(ValueError):
    """A grammar or schema llguidance cannot use (its message says why)."""


def llguidance():
    try:
        import llguidance
    except ImportError:
        raise GrammarError("constrained decoding needs llguidance: pip install 'chatglm_tune[serve]'") from None
    return llguidance


def vocabulary(tokenizer, rows: int) -> tuple:
    """(llguidance's view of `tokenizer` for a model of `rows` vocabulary rows, the id that stands for an end there);
    built once a tokenizer and kept while it lives."""
    built = _VOCABULARIES.setdefault(tokenizer, {})
    if rows not in built:
        lib = llguidance()
        wrapper = _Wrapper(tokenizer.token_bytes(), rows)
        built[rows] = (lib.LLTokenizer(lib.TokenizerWrapper(wrapper), n_vocab=rows, eos_token=wrapper.eos_token_id),
                       wrapper.eos_token_id)
    return built[rows]


class _Wrapper:
    """What `llguidance.TokenizerWrapper` reads: each id's bytes (`SPECIAL` and a name for the ids of no text), an eos
    id, and an encoder (greedy: longest token first)."""

    def __init__(self, token_bytes: list[bytes | None], rows: int):
        token_bytes = token_bytes[:rows]
        self.tokens = [b if b else SPECIAL + b"<[%d]>" % i for i, b in enumerate(token_bytes)]
        self.tokens += [SPECIAL + b"<[%d]>" % i for i in range(len(self.tokens), rows)]
        self.special_token_ids = [i for i, b in enumerate(self.tokens) if b.startswith(SPECIAL)]
        # a placeholder end (the first id of no text): `Constraint.allowed` swaps in the request's stop ids
        self.eos_token_id = next(i for i, b in enumerate(token_bytes) if not b)
        self.bos_token_id = None
        self._ids = {b: i for i, b in enumerate(token_bytes) if b}
        self._longest = max(map(len, self._ids))

    def __call__(self, text: str | bytes) -> list[int]:
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        ids, i = [], 0
        while i < len(data):
            for length in range(min(self._longest, len(data) - i), 0, -1):
                if data[i:i + length] in self._ids:
                    ids.append(self._ids[data[i:i + length]])
                    i += length
                    break
            else:
                raise ValueError(f"no token of the vocabulary begins with byte {data[i:i + 1]!r}")
        return ids


def json_rule(schema: Mapping) -> str:
    """The Lark rule body of JSON text valid under `schema`, written as `json.dumps` writes it (", " and ": ", no
    other whitespace: a model cannot pad its answer with spaces to the end of its budget)."""
    guidance = {**schema.get("x-guidance", {}), "whitespace_flexible": False, "item_separator": ", ",
                "key_separator": ": "}
    return "%json " + json.dumps({**schema, "x-guidance": guidance}, ensure_ascii=False)


# Python literals (what `repr` writes) of a JSON schema's scalar types, as Lark terms
_PYTHON_TERMS = {"string": r"""/'([^'\\\n]|\\.)*'|"([^"\\\n]|\\.)*"/""", "integer": r"/-?(0|[1-9][0-9]*)/",
                 "number": r"/-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?/", "boolean": '("True" | "False")',
                 "null": '"None"'}


def python_call_rules(schema: Mapping, name: str) -> list[str]:
    """Lark rules (the first named `name`) of ChatGLM3's call block for a tool of parameters `schema`:
    `tool_call(k=v, ...)` in a Python code block, the declared keywords in order, the required ones each there, a
    value a Python literal of its property's type: an enum's values, `True` / `False` / `None`, a string in either
    quotes, or, where the property's schema says more (bounds, a pattern, items), JSON text under it (JSON numbers,
    strings, lists and objects of them are Python literals too); where the schema declares no properties, any
    keywords."""
    if "properties" not in schema:  # no keywords declared: any, each with a literal of any type
        value = " | ".join([*_PYTHON_TERMS.values(), f"{name}_any"])
        keyword = f'/[A-Za-z_][A-Za-z0-9_]*/ "=" ({value})'
        return [" ".join([f"{name}:", json.dumps("```python\ntool_call("), f'({keyword} (", " {keyword})*)?',
                          json.dumps(")\n```")]), f"{name}_any: {json_rule({})}"]
    properties = list(schema["properties"].items())
    required = set(schema.get("required") or ())
    rules, terms = [], []
    for k, (key, spec) in enumerate(properties):
        spec = spec if isinstance(spec, Mapping) else {}
        if "enum" in spec:
            value = "(" + " | ".join(json.dumps(repr(v), ensure_ascii=False) for v in spec["enum"]) + ")"
        elif spec.get("type") in ("boolean", "null") or spec == {"type": "string"}:
            value = _PYTHON_TERMS[spec["type"]]
        else:  # JSON text, a Python literal too, under the property's own schema (its bounds, its pattern)
            value = f"{name}_{k}"
            rules.append(f"{value}: {json_rule(spec)}")
        terms.append((json.dumps(f"{key}=") + " " + value, key in required))
    firsts = []  # the keywords written, by the first one written (the ones before it all optional)
    for f, (term, _) in enumerate(terms):
        rest = " ".join(f'(", " {t})' + ("" if needed else "?") for t, needed in terms[f + 1:])
        firsts.append(f"{term} {rest}".strip())
        if terms[f][1]:
            break
    keywords = "(" + " | ".join(firsts) + ")" + ("" if any(n for _, n in terms) else "?") if firsts else ""
    return [" ".join([f"{name}:", json.dumps("```python\ntool_call("), *([keywords] if keywords else []),
                      json.dumps(")\n```")]), *rules]


def lark(alternatives: Sequence[tuple[str, str]], extra: Sequence[str] = ()) -> str:
    """A Lark grammar of `alternatives`, (literal text, rule body) each: the answer one of them. `extra`: rules the
    bodies name."""
    rules = [f"start: {' | '.join(f'a{i}' for i in range(len(alternatives)))}"]
    rules += [f"a{i}: {json.dumps(text, ensure_ascii=False) + ' ' if text else ''}{body}"
              for i, (text, body) in enumerate(alternatives)]
    return "\n".join([*rules, *extra]) + "\n"


def check(grammar: str, tokenizer, rows: int) -> None:
    """GrammarError with llguidance's reason where the Lark `grammar` cannot be used."""
    lib = llguidance()
    errors = lib.LLMatcher.validate_grammar_with_warnings(lib.LLMatcher.grammar_from_lark(grammar),
                                                          vocabulary(tokenizer, rows)[0])
    if errors[0]:
        raise GrammarError(errors[1][0])


class Constraint:
    """One answer's place in its grammar: the ids it may take next (`allowed`), moved on by each id it takes."""

    def __init__(self, grammar: str, tokenizer, rows: int):
        """`grammar`: Lark text (`lark`); `rows`: the model's vocabulary rows (its scores' width)."""
        lib = llguidance()
        words, self._eos = vocabulary(tokenizer, rows)
        self.rows = rows
        self._matcher = lib.LLMatcher(words, lib.LLMatcher.grammar_from_lark(grammar))
        if self._matcher.is_error():
            raise GrammarError(self._matcher.get_error())
        self._mask = torch.full(((rows + 31) // 32,), -1, dtype=torch.int32)

    def allowed(self, stop_ids: Sequence[int]) -> torch.Tensor:
        """[rows] bool: the ids that keep the answer in its grammar; where it may end there, `stop_ids`."""
        self._matcher.unsafe_compute_mask_ptr(self._mask.data_ptr(), self._mask.numel() * 4)
        allowed = ((self._mask[:, None] >> _BITS) & 1).flatten()[:self.rows].bool()
        may_end = bool(allowed[self._eos])
        allowed[self._eos] = False
        if may_end:
            allowed[list(stop_ids)] = True
        if not bool(allowed.any()):  # an error state: nothing fits (say so by ending the answer)
            allowed[list(stop_ids)] = True
        return allowed

    def take(self, token: int, stop_ids: Sequence[int]) -> None:
        """Move on past `token` (a stop id: the end)."""
        self._matcher.consume_token(self._eos if token in stop_ids else token)
