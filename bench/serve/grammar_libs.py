"""Benchmark: the two grammar libraries serve.py could constrain answers with, on the same vocabulary, schema and
answers, side by side: llguidance (what `chatglm_tune.decoding.grammar` uses) and xgrammar.

    python bench/serve/grammar_libs.py                 # a 151k-token vocabulary, 200 answers of a triple schema
    python bench/serve/grammar_libs.py --vocab 20000 --answers 20

The vocabulary: GLM-4's size (151,329 tokens), byte-level: the 256 single bytes, then the most frequent character
n-grams (n <= 8) of data/spo_*.jsonl's texts and of JSON text, as a BPE vocabulary holds the frequent pieces of its
corpus. The answers: each a random walk through the grammar (a seeded choice among the allowed tokens, stopping
when the answer may end), replayed through both libraries, so that each computes the same masks.
Per library: the time to build its view of the vocabulary (once a server), to compile the schema (once a request),
and per answer token the time to fill a step's bitmask and to advance past the token (the engine does both per
row and step, between forwards); every token of every answer must be one both masks allow. The masks may differ
where the grammar forces text: llguidance then allows only the forced text's own tokenization (greedy, longest
token first), xgrammar every token that spells a prefix of it; `masks_differing` counts those steps.
Ends with one line of JSON (results also in bench/results/grammar-libs.json).
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.common.measure import RESULTS  # noqa: E402

SCHEMA = {"type": "object", "properties": {"subject": {"type": "string", "maxLength": 12},
                                           "relation": {"enum": ["位于", "属于", "包含", "出生于"]},
                                           "object": {"type": "string", "maxLength": 12},
                                           "score": {"type": "integer", "minimum": 0, "maximum": 100}},
          "required": ["subject", "relation", "object", "score"], "additionalProperties": False}
EOS = 0  # the vocabulary's id 0 is the end token


def vocabulary(size: int) -> list[bytes]:
    """`size` tokens: an end token, the 256 bytes, then the most frequent character n-grams of the data's texts."""
    texts = [json.loads(line)["text"] for name in ("spo_train.jsonl", "spo_dev.jsonl")
             for line in (ROOT / "data" / name).read_text(encoding="utf-8").splitlines()]
    texts += [json.dumps({"subject": t[:8], "relation": "位于", "object": t[8:16], "score": 7}, ensure_ascii=False)
              for t in texts]
    counts = collections.Counter(text[i:i + n] for text in texts for n in range(2, 9) for i in range(len(text) - n + 1))
    tokens = [b"<eos>"] + [bytes([b]) for b in range(256)]
    seen = set(tokens)
    for piece, _ in counts.most_common():
        data = piece.encode("utf-8")
        if data not in seen:
            seen.add(data)
            tokens.append(data)
        if len(tokens) == size:
            break
    return tokens


def llguidance_side(tokens: list[bytes]):
    import llguidance

    from chatglm_tune.decoding.grammar import _Wrapper  # the engine's own view of a vocabulary

    start = time.perf_counter()
    wrapper = _Wrapper([None, *tokens[1:]], len(tokens))  # id 0 the end: a token of no text
    words = llguidance.LLTokenizer(llguidance.TokenizerWrapper(wrapper), n_vocab=len(tokens), eos_token=EOS)
    built = time.perf_counter() - start
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, overrides={
        "whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
    mask = torch.zeros((len(tokens) + 31) // 32, dtype=torch.int32)

    def new():
        return llguidance.LLMatcher(words, grammar)

    def fill(matcher):
        matcher.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4)
        return mask

    def take(matcher, token):
        assert matcher.consume_token(token), matcher.get_error()

    return built, new, fill, take


def xgrammar_side(tokens: list[bytes]):
    import xgrammar

    start = time.perf_counter()
    info = xgrammar.TokenizerInfo(tokens, xgrammar.VocabType.RAW, vocab_size=len(tokens), stop_token_ids=[EOS])
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
    built = time.perf_counter() - start
    mask = xgrammar.allocate_token_bitmask(1, len(tokens))

    def new():
        return xgrammar.GrammarMatcher(compiler.compile_json_schema(SCHEMA, any_whitespace=False,
                                                                    separators=(", ", ": ")))

    def fill(matcher):
        matcher.fill_next_token_bitmask(mask)
        return mask[0]

    def take(matcher, token):
        assert matcher.accept_token(token)

    return built, new, fill, take


def allowed_ids(mask: torch.Tensor, size: int) -> torch.Tensor:
    return ((mask[:, None] >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:size].nonzero().flatten()


def walks(side, answers: int, size: int, seed: int = 0) -> list[list[int]]:
    """`answers` random answers of the grammar (token ids, the end last), walked with `side`'s masks."""
    _, new, fill, take = side
    rnd, out = random.Random(seed), []
    for _ in range(answers):
        matcher, ids = new(), []
        while not ids or ids[-1] != EOS:
            allowed = allowed_ids(fill(matcher), size).tolist()
            token = (EOS if EOS in allowed and rnd.random() < 0.5
                     else rnd.choice([t for t in allowed if t != EOS] or allowed))
            take(matcher, token)
            ids.append(token)
        out.append(ids)
    return out


def timed(side, answers: list[list[int]], reference: list[list[torch.Tensor]] | None) -> tuple[dict, list]:
    """Per-token fill and advance times of `side` over `answers` (each token must be one its mask allows); its
    masks, and how many differ from `reference`'s."""
    _, new, fill, take = side
    compile_s, fill_s, take_s, masks, differ = [], [], [], [], 0
    for a, ids in enumerate(answers):
        start = time.perf_counter()
        matcher = new()
        compile_s.append(time.perf_counter() - start)
        kept = []
        for t, token in enumerate(ids):
            start = time.perf_counter()
            mask = fill(matcher)
            fill_s.append(time.perf_counter() - start)
            kept.append(mask.clone())
            assert token in allowed_ids(mask, mask.numel() * 32).tolist(), f"answer {a}: token {t} is not allowed"
            differ += reference is not None and not torch.equal(kept[-1], reference[a][t])
            start = time.perf_counter()
            take(matcher, token)
            take_s.append(time.perf_counter() - start)
        masks.append(kept)
    us = lambda xs, q: round(1e6 * sorted(xs)[int(q * (len(xs) - 1))], 1)  # noqa: E731
    return {"compile_ms_p50": round(1e3 * sorted(compile_s)[len(compile_s) // 2], 2), "fill_us_p50": us(fill_s, 0.5),
            "fill_us_p95": us(fill_s, 0.95), "take_us_p50": us(take_s, 0.5),
            "us_per_token": round(1e6 * (sum(fill_s) + sum(take_s)) / len(fill_s), 1), "tokens": len(fill_s),
            "masks_differing": differ if reference is not None else None}, masks


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=151329, help="vocabulary size (default %(default)s: GLM-4's)")
    p.add_argument("--answers", type=int, default=200, help="answers walked and timed (default %(default)s)")
    p.add_argument("--out", type=Path, default=RESULTS / "grammar-libs.json")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    tokens = vocabulary(args.vocab)
    sides = {"llguidance": llguidance_side(tokens)}
    try:
        sides["xgrammar"] = xgrammar_side(tokens)
    except ImportError as err:
        print(f"xgrammar is not installed ({err}): pip install xgrammar apache-tvm-ffi; its side is skipped")
    answers = walks(sides["llguidance"], args.answers, len(tokens))
    rows, reference = {}, None
    for name, side in sides.items():
        rows[name], masks = timed(side, answers, reference)
        rows[name]["vocabulary_s"] = round(side[0], 2)
        reference = reference or masks
    print(f"{'library':<12}{'vocabulary s':>14}{'compile ms':>12}{'fill us p50':>13}{'fill us p95':>13}"
          f"{'take us':>9}{'us/token':>10}")
    for name, row in rows.items():
        print(f"{name:<12}{row['vocabulary_s']:>14}{row['compile_ms_p50']:>12}{row['fill_us_p50']:>13}"
              f"{row['fill_us_p95']:>13}{row['take_us_p50']:>9}{row['us_per_token']:>10}")
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    summary = {"bench": "grammar-libs", "vocab": len(tokens), "answers": args.answers,
               "tokens": rows["llguidance"]["tokens"], "cpu": cpu, "results": rows,
               "when": time.strftime("%Y-%m-%d %H:%M:%S")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
