"""Tests of chatglm_tune.evaluation.metrics on hand-built cases: parsing generated text, micro / per-sample /
per-relation P/R/F1, and incremental accumulation."""

from __future__ import annotations

import pytest

from chatglm_tune.data.records import SPORecord, Triple
from chatglm_tune.evaluation.metrics import PRF, SPOScorer, parse_triples, score_answers, score_record


def score_texts(generated, gold):
    scorer = SPOScorer()
    for text, triples in zip(generated, gold, strict=True):
        scorer.add(text, triples)
    return scorer.result()

A = Triple("发动机", "部件故障", "异响")
B = Triple("水泵", "部件故障", "漏油")
C = Triple("油压", "性能故障", "偏低")
D = Triple("万用表", "检测工具", "电压")


def test_parse_strips_dedupes_and_counts_malformed_lines():
    text = (" 发动机 _ 部件故障 _异响 \n\n发动机_部件故障_异响\n水泵_部件故障\n"
            "水泵_部件故障_漏油_x\n_部件故障_漏油\n油压_性能故障_偏低\n")
    parsed = parse_triples(text)
    assert parsed.triples == (A, C)
    assert parsed.malformed == ("水泵_部件故障", "水泵_部件故障_漏油_x", "_部件故障_漏油")
    assert parse_triples("") == parse_triples("\n \n")
    assert parse_triples("").triples == () and parse_triples("").malformed == ()


def test_record_scores():
    assert score_record([A, B], [A, C]) == PRF(0.5, 0.5, 0.5, 1, 2, 2)
    assert score_record([A, A, B], [A, A]) == PRF(0.5, 1.0, pytest.approx(2 / 3), 1, 2, 1)  # set semantics
    assert score_record([], []).f1 == 1.0  # nothing to find, nothing claimed
    assert score_record([], [A]) == PRF(0.0, 0.0, 0.0, 0, 0, 1)
    assert score_record([A], []) == PRF(0.0, 0.0, 0.0, 0, 1, 0)


def test_nfkc_normalisation_matches_full_width_gold():
    assert score_record([Triple("1号缸", "部件故障", "失火")], [Triple("１号缸", "部件故障", "失火")]).f1 == 1.0


def test_micro_sample_and_per_relation():
    scorer = SPOScorer()
    first = scorer.add("发动机_部件故障_异响\n水泵_部件故障_漏油\n坏行", [A, C])  # tp 1, pred 2, gold 2
    second = scorer.add("", [])  # empty vs empty: F1 1.0, no counts
    third = scorer.add("万用表_检测工具_电压\n万用表_检测工具_电压", [D, D, B])  # tp 1, pred 1, gold 2
    fourth = scorer.add("油压_性能故障_偏低", None)  # no gold: counted, not scored
    assert (first.f1, second.f1, pytest.approx(third.f1), fourth) == (0.5, 1.0, pytest.approx(2 / 3), None)

    result = scorer.result()
    assert (result.records, result.scored_records, result.malformed_lines) == (4, 3, 1)
    assert result.micro == PRF(2 / 3, 0.5, pytest.approx(4 / 7), 2, 3, 4)
    assert result.sample_f1 == pytest.approx((0.5 + 1.0 + 2 / 3) / 3)
    assert set(result.per_relation) == {"部件故障", "性能故障", "检测工具"}
    assert result.per_relation["部件故障"] == PRF(0.5, 0.5, 0.5, 1, 2, 2)  # A hit, B predicted (1st), B missed (3rd)
    assert result.per_relation["性能故障"] == PRF(0.0, 0.0, 0.0, 0, 0, 1)  # the no-gold record is not scored
    assert result.per_relation["检测工具"] == PRF(1.0, 1.0, 1.0, 1, 1, 1)


def test_empty_predictions_and_empty_gold():
    all_missed = score_texts(["", ""], [[A], [B, C]])
    assert all_missed.micro == PRF(0.0, 0.0, 0.0, 0, 0, 3) and all_missed.sample_f1 == 0.0
    hallucinated = score_texts(["发动机_部件故障_异响"], [[]])
    assert hallucinated.micro == PRF(0.0, 0.0, 0.0, 0, 1, 0) and hallucinated.sample_f1 == 0.0
    all_empty = score_texts(["", "\n"], [[], []])
    assert all_empty.micro.f1 == 1.0 and all_empty.sample_f1 == 1.0 and all_empty.per_relation == {}


def test_malformed_only_output_scores_zero_without_crashing():
    result = score_texts(["发动机部件故障异响\n___\n发动机_部件故障"], [[A]])
    assert result.malformed_lines == 3
    assert result.micro.recall == 0.0 and result.sample_f1 == 0.0


def test_no_gold_at_all_gives_no_scores():
    result = score_texts(["发动机_部件故障_异响"], [None])
    assert (result.micro, result.sample_f1, result.records, result.scored_records) == (None, None, 1, 0)
    assert result.to_dict()["micro"] is None


def test_incremental_equals_batch_and_to_dict():
    generated = ["发动机_部件故障_异响", "", "水泵_部件故障_漏油\n油压_性能故障_偏低"]
    gold = [[A, B], [C], [B]]
    scorer = SPOScorer()
    for g, t in zip(generated, gold):
        scorer.add(g, t)
        scorer.result()  # may be read at any point
    d = scorer.result().to_dict()
    run = score_answers(generated, [SPORecord("文本", tuple(t)) for t in gold])  # the run-level scores
    assert run == {**d, "score": d["micro"]["f1"]}
    assert set(d) == {"records", "scored_records", "malformed_lines", "micro", "sample_f1", "per_relation"}
    assert d["micro"] == {"precision": 2 / 3, "recall": 0.5, "f1": pytest.approx(4 / 7), "tp": 2,
                          "n_pred": 3, "n_gold": 4}
    assert list(d["per_relation"]) == sorted(d["per_relation"])
