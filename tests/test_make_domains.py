"""Tests of `data/make_domains.py`, the generator of SPO sets of other domains than the shipped one
(people, products, medicine), and of the sets it wrote under data/domains/."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from chatglm_tune.data.records import read_records

REPO = Path(__file__).resolve().parents[1]


def load(name: str):
    """A script of data/ as a module (they are scripts, not part of the package)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / "data" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    return sys.modules[name]


md = load("make_domains")
DOMAIN_NAMES = sorted(md.DOMAINS)


def test_there_are_three_domains_and_their_relations_differ_from_the_shipped_set():
    assert len(DOMAIN_NAMES) >= 3
    shipped = set(load("make_spo").RELATIONS)
    for domain in md.DOMAINS.values():
        assert len(domain.relations) >= 7
        assert not shipped & set(domain.relations), domain.name
        md.check_vocabulary(domain)


@pytest.mark.parametrize("name", DOMAIN_NAMES)
def test_generation_is_deterministic_valid_and_sized_as_asked(name, tmp_path):
    domain = md.DOMAINS[name]
    written = md.write_splits(domain, tmp_path, n_train=400, n_dev=60, seed=7)
    again_train, again_dev = md.make_splits(domain, 400, 60, seed=7)
    assert [r.text for r in written[tmp_path / "train.jsonl"]] == [r.text for r in again_train]
    assert [r.triples for r in written[tmp_path / "dev.jsonl"]] == [r.triples for r in again_dev]
    assert md.make_splits(domain, 50, 10, seed=8)[0] != again_train[:50]  # the seed matters

    train, report = read_records(tmp_path / "train.jsonl")  # raises on any bad record
    dev, _ = read_records(tmp_path / "dev.jsonl")
    assert (len(train), len(dev), report.total) == (400, 60, 0)
    assert not {r.text for r in dev} & {r.text for r in train}
    assert len({r.text for r in train}) == len(train)

    triples = [t for r in train + dev for t in r.triples]
    assert {t.predicate for t in triples} == set(domain.relations)  # every relation occurs
    words = set(domain.words())
    for record in train + dev:
        assert len(record.triples) <= md.MAX_TRIPLES
        for t in record.triples:
            assert t.subject in words and t.object in words and "_" not in t.subject + t.object
            assert t.subject in record.text and t.object in record.text  # a span copy
    counts = {k: sum(len(r.triples) == k for r in train) for k in range(md.MAX_TRIPLES + 1)}
    assert all(counts.values()), counts  # 0, 1, 2, 3 and 4 triples all occur
    assert any(len({t.subject for t in r.triples}) < len(set(r.triples)) for r in train)  # shared subjects
    assert any(len(r.text) > 300 for r in train)  # long texts


def test_long_texts_state_their_facts_first():
    train, _ = md.make_splits(md.PEOPLE, 200, 10, seed=1)
    long = [r for r in train if len(r.text) > 300]
    assert long
    for record in long:
        last_fact = max((record.text.find(x) + len(x) for t in record.triples for x in (t[0], t[2])), default=0)
        assert last_fact < 120  # so a 160-token source budget never cuts a fact


def test_a_new_domain_is_a_few_lines():
    books = md.Domain(
        name="books",
        pools={"w": ("围城", "边城", "活着", "平凡的世界"), "a": ("钱锺书", "沈从文", "余华", "路遥")},
        templates=(("《{w}》的作者是{a}", (("w", "作者", "a"),)), ("{a}[写了|创作了]《{w}》", (("w", "作者", "a"),))),
        negatives=("书店里有《{w}》",),
        openers=("", "书评："),
        fillers=("第{num}页",),
    )
    train, dev = md.make_splits(books, 20, 5, seed=0)
    assert len(train) == 20 and all(t[1] == "作者" for r in train for t in r.triples)


def test_check_vocabulary_rejects_a_word_inside_another():
    bad = md.Domain(name="bad", pools={"c": ("上海", "上海市")}, templates=(("{c}很大", (("c", "是", "c"),)),),
                    negatives=(), openers=("",), fillers=())
    with pytest.raises(ValueError, match="上海 in 上海市"):
        md.check_vocabulary(bad)


def test_cli_writes_the_asked_counts(tmp_path):
    md.main(["--domain", "products", "--out-dir", str(tmp_path / "p"), "--train", "30", "--dev", "7", "--seed", "3"])
    assert len(read_records(tmp_path / "p" / "train.jsonl")[0]) == 30
    assert len(read_records(tmp_path / "p" / "dev.jsonl")[0]) == 7


@pytest.mark.parametrize("name", DOMAIN_NAMES)
def test_the_shipped_sets_are_what_the_generator_writes(name, tmp_path):
    shipped = REPO / "data" / "domains" / name
    if not (shipped / "train.jsonl").exists():
        pytest.skip(f"{shipped} not generated")
    md.write_splits(md.DOMAINS[name], tmp_path)  # the defaults of `--all`
    for split in ("train.jsonl", "dev.jsonl"):
        assert (shipped / split).read_bytes() == (tmp_path / split).read_bytes(), (
            f"{name}/{split}: rerun make_domains.py --all")
    train, _ = read_records(shipped / "train.jsonl")
    assert 2000 <= len(train) + 200 <= 5000 and (shipped / "train.jsonl").stat().st_size < 2_000_000
