"""Tests of chatglm_tune.evaluation.textmetrics: the official ChatGLM P-tuning generation metrics (ROUGE-1/2/L
over jieba words, BLEU-4 over characters, x100 rounded to 4 places) plus exact match, checked
against values computed here from the definitions."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from commands import HANG_S

jieba = pytest.importorskip("jieba")
pytest.importorskip("rouge_chinese")
pytest.importorskip("nltk")

from chatglm_tune.evaluation import textmetrics  # noqa: E402
from chatglm_tune.evaluation.textmetrics import KEYS, GenerationScorer, generation_scores  # noqa: E402

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "advertise_small.jsonl"


def words(text: str) -> list[str]:
    return list(jieba.cut(text))


def ngram_set(tokens: list[str], n: int) -> set[tuple[str, ...]]:
    return {tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)}


def f_score(overlap: int, n_hyp: int, n_ref: int) -> float:
    p, r = overlap / n_hyp, overlap / n_ref
    return 2 * p * r / (p + r) if p + r else 0.0


def lcs(a: list[str], b: list[str]) -> int:
    row = [0] * (len(b) + 1)
    for x in a:
        prev_diag, row = 0, row[:]
        for j, y in enumerate(b, start=1):
            prev_diag, row[j] = row[j], prev_diag + 1 if x == y else max(row[j], row[j - 1])
    return row[-1]


def rouge_by_definition(pred: str, ref: str) -> dict[str, float]:
    """ROUGE-1/2 from distinct word n-grams, ROUGE-L from the LCS of the word sequences (one sentence)."""
    h, r = words(pred), words(ref)
    scores = {}
    for n in (1, 2):
        hs, rs = ngram_set(h, n), ngram_set(r, n)
        scores[f"rouge-{n}"] = f_score(len(hs & rs), len(hs), len(rs)) * 100
    scores["rouge-l"] = f_score(lcs(h, r), len(h), len(r)) * 100
    return scores


def bleu4_by_definition(pred: str, ref: str) -> float:
    """Sentence BLEU-4 over characters: clipped n-gram precisions, NIST geometric smoothing of the
    zero ones (1 / (2^k * hyp n-grams), k = 1, 2, ... : nltk's method3), brevity penalty; x100."""
    hyp, r = list(pred), list(ref)
    logs, k = [], 1
    for n in range(1, 5):
        hc = Counter(tuple(hyp[i : i + n]) for i in range(len(hyp) - n + 1))
        rc = Counter(tuple(r[i : i + n]) for i in range(len(r) - n + 1))
        matches, total = sum(min(c, rc[g]) for g, c in hc.items()), max(1, sum(hc.values()))
        if n == 1 and matches == 0:
            return 0.0
        if matches == 0:
            logs.append(math.log(1 / (2**k * total)))
            k += 1
        else:
            logs.append(math.log(matches / total))
    bp = 1.0 if len(hyp) > len(r) else math.exp(1 - len(r) / len(hyp))
    return bp * math.exp(sum(logs) / 4) * 100


def test_identical_strings_score_100_and_exact_match_1():
    text = "这件白色上衣很适合夏天穿"
    assert generation_scores([text], [text]) == {"rouge-1": 100.0, "rouge-2": 100.0, "rouge-l": 100.0, "bleu-4": 100.0,
                                                 "exact_match": 1.0}


def test_disjoint_strings_score_0():
    scores = generation_scores(["蓝天白云"], ["高山流水"])
    assert scores == dict.fromkeys(KEYS, 0.0)


@pytest.mark.parametrize(
    "pred, ref",
    [
        ("这款连衣裙采用白色面料，简约大方", "这款上衣采用白色面料，时尚大方"),  # longer prediction: no brevity penalty
        ("简约的设计", "简约大方的设计风格"),  # shorter: brevity penalty, no 4-gram match (smoothing)
        ("宽松的版型搭配撞色条纹，显得很有活力", "撞色条纹搭配宽松版型，活力十足"),  # word order differs
    ],
)
def test_partial_overlap_matches_the_definitions(pred, ref):
    got = GenerationScorer().add(pred, ref)
    expected = rouge_by_definition(pred, ref) | {"bleu-4": bleu4_by_definition(pred, ref)}
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, abs=1e-3), key  # rouge_chinese's F has a 1e-8 in its denominator
        assert got[key] == round(got[key], 4)  # x100 rounded to 4 places, as official
    assert got["exact_match"] == 0.0


def test_partial_overlap_hand_values():
    # jieba: 这|款|连衣裙|采用|白色|面料|，|简约|大方  vs  这|款|上衣|采用|白色|面料|，|时尚|大方
    # 7 of 9 words shared; 4 of 8 bigrams (这款 采用白色 白色面料 面料，); LCS 7 words
    got = GenerationScorer().add("这款连衣裙采用白色面料，简约大方", "这款上衣采用白色面料，时尚大方")
    assert got["rouge-1"] == pytest.approx(100 * 7 / 9, abs=1e-3)
    assert got["rouge-2"] == pytest.approx(50.0, abs=1e-3)
    assert got["rouge-l"] == pytest.approx(100 * 7 / 9, abs=1e-3)


@pytest.mark.parametrize("pred, ref", [("", "一条参考答案"), ("   ", "一条参考答案"), ("一条预测", ""), ("", "")])
def test_a_side_without_words_scores_rouge_0_without_raising(pred, ref):
    got = GenerationScorer().add(pred, ref)
    assert [got[k] for k in ("rouge-1", "rouge-2", "rouge-l", "bleu-4")] == [0.0] * 4
    assert got["exact_match"] == float(pred.strip() == ref.strip())


def test_set_scores_are_means_of_the_pair_scores():
    pairs = [("这件白色上衣很适合夏天穿", "这件白色上衣很适合夏天穿"), ("", "有参考"),
             ("简约的设计", "简约大方的设计风格"), (" 一样 ", "一样")]
    per_pair = [GenerationScorer().add(p, r) for p, r in pairs]
    scores = generation_scores([p for p, _ in pairs], [r for _, r in pairs])
    assert set(scores) == set(KEYS)
    for key in KEYS:
        assert scores[key] == pytest.approx(sum(s[key] for s in per_pair) / len(pairs))
    assert scores["exact_match"] == 0.5  # the first pair, and the last once stripped


def test_format_names_rouge_l_and_bleu_4():
    line = textmetrics.format(generation_scores(["简约的设计"], ["简约大方的设计风格"]))
    assert "rouge-l" in line and "bleu-4" in line and "\n" not in line


def test_bad_inputs_raise():
    with pytest.raises(ValueError):
        generation_scores([], [])
    with pytest.raises(ValueError):
        generation_scores(["a", "b"], ["a"])


def test_missing_packages_raise_a_clear_import_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "rouge_chinese", None)  # makes `import rouge_chinese` fail
    with pytest.raises(ImportError, match="pip install jieba rouge-chinese nltk"):
        generation_scores(["a"], ["a"])


def test_jieba_prints_nothing():
    """jieba logs "Building prefix dict ..." to stderr on its first cut: a fresh process must stay silent."""
    module = Path(textmetrics.__file__)
    code = (
        "import importlib.util as u; s = u.spec_from_file_location('tm', %r); m = u.module_from_spec(s); "
        "s.loader.exec_module(m); m.generation_scores(['一条预测'], ['一条参考'])" % str(module)
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, done.stderr
    assert done.stderr == "" and done.stdout == ""


def test_advertise_fixture_has_the_official_shape():
    rows = [json.loads(line) for line in FIXTURE.read_text(encoding="utf-8").splitlines() if line.strip()]
    assert len(rows) == 12
    for row in rows:
        assert set(row) == {"content", "summary"} and row["summary"].strip()
        assert all("#" in pair for pair in row["content"].split("*"))  # key#value pairs joined by '*'
    scores = generation_scores([r["summary"] for r in rows], [r["summary"] for r in rows])
    assert scores["exact_match"] == 1.0 and scores["rouge-l"] == 100.0
