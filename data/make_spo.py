"""Generate the shipped synthetic SPO set: Chinese fault-diagnosis sentences and their triples.

    python data/make_spo.py                                  # writes data/spo_train.jsonl, data/spo_dev.jsonl
    python data/make_spo.py --relations 部件故障,性能故障 --prefix base --out-dir /tmp/x

Records have the `{"text", "answer"}` shape (answer: `subject_predicate_object` lines). The four
relations follow the industrial fault-extraction sets that ChatGLM SPO fine-tuning is known for:

    部件故障  component -> its fault            发动机_部件故障_异响
    性能故障  performance quantity -> its state   油压_性能故障_偏低
    组成      part -> the component it belongs to  叶轮_组成_水泵
    检测工具  tool -> the quantity it measures     万用表_检测工具_电压

The set is built to be learnable by a tiny model trained from scratch: every fact is a span copy
through a handful of templates per relation (with alternative wordings around the slots); two dozen
words a slot, disjoint lists where no word contains another and no template text contains a word
(checked by `check_vocabulary`); answers list the triples in text order, at most three a record. It also holds the hard
cases the toolkit must handle: records with no triple, duplicated triples (a fact stated twice is listed twice, as in
the reference data), several triples sharing a subject, and long texts (facts first, then filler with no fact, well over
256 tokens), so truncating the source never removes a fact. Deterministic for a seed (Python's `random.Random`).
"""

from __future__ import annotations

import argparse
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

RELATIONS = ("部件故障", "性能故障", "组成", "检测工具")

# Defaults: the one place for them (the CLI shows them in --help).
DEFAULT_SEED = 20240601
DEFAULT_TRAIN_SIZE = 10000  # each record seen ~3 times by the demo: it learns to copy, not to recall
DEFAULT_DEV_SIZE = 200
DEFAULT_PREFIX = "spo"
DATA_DIR = Path(__file__).resolve().parent

# Share of records of each special kind.
EMPTY_RATE = 0.08  # no triple at all
LONG_EVERY = 64  # every 64th record: facts followed by a long filler (few: they make every batch they are in long)
NEGATIVE_CLAUSE_RATE = 0.25  # a fact-free clause mixed into a record with facts
MAX_TRIPLES = 3  # per record, so that answers fit the default answer budget (30 tokens)

# fmt: off
COMPONENTS = (
    "发动机", "变速箱", "水泵", "油泵", "散热器", "压缩机", "发电机", "起动机", "节气门", "喷油嘴",
    "火花塞", "离合器", "传动轴", "差速器", "减振器", "制动盘", "制动钳", "转向机", "鼓风机", "冷凝器",
    "蒸发器", "空气滤清器", "机油滤清器", "燃油滤清器",
)
PARTS = (
    "叶轮", "皮带", "轴承", "活塞", "齿轮", "密封圈", "绕组", "电刷", "油封", "阀芯", "弹簧",
    "衬套", "接头", "护套", "垫片", "摩擦片", "转子", "定子", "滑环", "喉箍", "拉杆", "支架",
    "膜片", "柱塞",
)
COMPONENT_FAULTS = (
    "异响", "漏油", "水温高", "过热", "松动", "卡滞", "磨损", "断裂", "烧蚀", "抖动", "渗水",
    "漏气", "短路", "断路", "变形", "锈蚀", "堵塞", "开裂", "失灵", "打滑", "积碳", "老化",
    "烧坏", "不工作",
)
QUANTITIES = (
    "油压", "转速", "电压", "电流", "油耗", "胎压", "冷却液温度", "排气温度", "进气压力", "轨压",
    "怠速", "扭矩", "功率", "发电量", "空燃比", "真空度", "制动力", "车速信号", "点火提前角", "喷油脉宽",
    "机油液位", "压缩比", "电阻值", "频率",
)
QUANTITY_STATES = (
    "偏高", "偏低", "过大", "过小", "不稳", "波动大", "超标", "为零", "忽高忽低", "持续上升",
    "明显下降", "读数异常", "跳变", "无输出", "超限", "漂移", "不达标", "突然升高", "缓慢下降",
    "低于标准", "高于标准", "时有时无",
)
TOOLS = (
    "万用表", "示波器", "诊断仪", "压力表", "内窥镜", "红外测温仪", "钳形表", "真空表", "缸压表",
    "听诊器", "尾气分析仪", "兆欧表", "塞尺", "百分表", "扭力扳手", "频闪灯", "试电笔", "流量计",
    "测速仪", "烟雾检漏仪", "解码器", "电瓶检测仪", "比重计", "游标卡尺",
)
# fmt: on

# Templates: literal text with named slots `{c}` and alternatives `[a|b|]` (one is drawn; empty allowed).
# The alternatives vary the words next to each slot, so that a tokenizer trained on this data learns the
# slot words as pieces of their own rather than fused with a fixed neighbour (which would make copying
# them harder). Each template lists the triples it states, in text order, as (subject slot, relation,
# object slot). Slots: c/c2 component, p part, f/f2 fault, q/q2 quantity, v/v2 state, t tool.
TEMPLATES = (
    # 部件故障
    ("[|检查发现|客户反映|路试时|拆检后确认|试车发现|据车主反映|经检查]{c}[|出现|已经|存在|发生|有|偶尔]{f}[|现象|问题|的情况]",
     (("c", "部件故障", "f"),)),
    ("{c}[出现|发生|有]{f}[和|以及|并伴有]{f2}", (("c", "部件故障", "f"), ("c", "部件故障", "f2"))),
    ("{c}{f}[，同时|，并且|；另外|，此外]{c2}[|也|还]{f2}", (("c", "部件故障", "f"), ("c2", "部件故障", "f2"))),
    ("{c}{f}[，复查时|，再次检查|，试车后]{c}[仍然|依旧|还是]{f}", (("c", "部件故障", "f"), ("c", "部件故障", "f"))),
    # 性能故障
    ("[|仪表显示|测得|行驶中|数据流中|冷车时|检测到|热车后|加速时|读取发现]{q}[|一直|有时|略微|始终|偶尔]{v}",
     (("q", "性能故障", "v"),)),
    ("{q}{v}[并且|而且|，同时|，随后]{v2}", (("q", "性能故障", "v"), ("q", "性能故障", "v2"))),
    ("{q}{v}[，再次测量|，复测时|，重新检测后]{q}[依旧|仍然|还是]{v}",
     (("q", "性能故障", "v"), ("q", "性能故障", "v"))),
    # 组成
    ("{p}[是|属于]{c}的[组成部分|一部分|零部件]", (("p", "组成", "c"),)),
    ("{c}[内部装有|上装有|带有|配有|内含|总成包括]{p}", (("p", "组成", "c"),)),
    ("[拆开|分解|拆下|打开]{c}[检查其|查看其|更换其|清洁其]{p}", (("p", "组成", "c"),)),
    ("{c}由{p}等[零件|部件|元件]构成", (("p", "组成", "c"),)),
    ("{p}[安装在|固定在|位于]{c}[中|上|内部]", (("p", "组成", "c"),)),
    # 检测工具
    ("[用|使用|借助|通过|拿|利用|采用]{t}[测量|检测|读取|测试|确认|测定|复测|监测]{q}", (("t", "检测工具", "q"),)),
    ("{q}需要[用|使用|借助]{t}[检查|测量|确认]", (("t", "检测工具", "q"),)),
    ("{t}[可以测出|能够检测|用来测量]{q}", (("t", "检测工具", "q"),)),
    ("[用|使用|借助]{t}[先后测量了|依次检测了|分别读取了]{q}和{q2}", (("t", "检测工具", "q"), ("t", "检测工具", "q2"))),
    # two relations in one clause
    ("{c}的{p}[|出现|已经|存在]{f}", (("p", "组成", "c"), ("p", "部件故障", "f"))),
    ("[经|用|通过]{t}[检查|测量|检测]{q}，[结果|发现|显示]{q}{v}", (("t", "检测工具", "q"), ("q", "性能故障", "v"))),
)
# Clauses that state no fact (used for empty records and mixed into others).
NEGATIVE_TEMPLATES = (
    "{c}[工作正常|外观良好|运转平稳]", "[检查|拆检|复查]{c}[未见异常|没有问题]", "{q}[正常|在标准范围内]",
    "[已更换|清洗了|紧固了]{c}", "[准备了|找来了]{t}", "{t}[校准完毕|电量充足]",
)
OPENERS = ("", "", "故障现象：", "维修记录：", "{n}号车故障报告：", "客户描述：", "诊断过程：", "[一辆|某]{n}款轿车，")
JOINERS = ("，", "；", "。")
ALTERNATIVES = re.compile(r"\[([^\]]*)\]")
SLOT_WORDS = {
    "c": COMPONENTS, "c2": COMPONENTS, "p": PARTS, "f": COMPONENT_FAULTS, "f2": COMPONENT_FAULTS,
    "q": QUANTITIES, "q2": QUANTITIES, "v": QUANTITY_STATES, "v2": QUANTITY_STATES, "t": TOOLS,
}
# Filler for long texts: fact-free sentences made unique by numbers, so they stay many tokens long.
FILLER_TEMPLATES = (
    "第{a}次路试行驶了{b}公里", "工单编号为{a}{b}", "车辆于{y}年{m}月{d}日进站", "累计里程{a}{b}公里",
    "维修人员记录了第{a}项作业", "客户于{m}月{d}日电话回访", "本次保养用时{a}分钟", "上次进站是{y}年{m}月",
    "配件单号{b}{a}已归档", "试车{a}分钟后停放{b}分钟",
)


@dataclass(frozen=True)
class GeneratedRecord:
    text: str
    triples: tuple[tuple[str, str, str], ...]

    def to_json(self) -> dict:
        return {"text": self.text, "answer": "\n".join("_".join(t) for t in self.triples)}


def check_vocabulary() -> None:
    """Raise ValueError if a word contains '_', contains another word, or appears in template text."""
    words = sorted({w for ws in SLOT_WORDS.values() for w in ws})
    problems = [w for w in words if "_" in w]
    problems += [f"{a} in {b}" for a in words for b in words if a != b and a in b]
    patterns = [t for t, _ in TEMPLATES] + list(NEGATIVE_TEMPLATES) + list(OPENERS) + list(FILLER_TEMPLATES)
    for pattern in patterns:
        pieces = re.split(r"\{\w+\}|[\[\]|]", pattern)  # every literal piece and every alternative
        problems += [f"{w} in template {pattern!r}" for w in words for piece in pieces if w in piece]
    if problems:
        raise ValueError("vocabulary problems: " + "; ".join(problems))


def _expand(rng: random.Random, pattern: str) -> str:
    """Draw one alternative of every `[a|b|...]` group of a pattern."""
    return ALTERNATIVES.sub(lambda m: rng.choice(m.group(1).split("|")), pattern)


def generate_records(n: int, *, seed: int, relations=RELATIONS, exclude_texts=frozenset()) -> list[GeneratedRecord]:
    """`n` distinct records stating only facts of `relations` (a subset of RELATIONS: a template that
    states two relations is used only when both are in it); texts in `exclude_texts` are redrawn."""
    unknown = set(relations) - set(RELATIONS)
    if unknown or not relations:
        raise ValueError(f"relations must be a non-empty subset of {RELATIONS}, got {tuple(relations)}")
    templates = [t for t in TEMPLATES if {rel for _, rel, _ in t[1]} <= set(relations)]
    rng = random.Random(seed)
    records, seen = [], set(exclude_texts)
    while len(records) < n:
        record = _record(rng, templates, long=(len(records) + 1) % LONG_EVERY == 0)
        if record.text not in seen:
            seen.add(record.text)
            records.append(record)
    return records


def _record(rng: random.Random, templates, *, long: bool) -> GeneratedRecord:
    """One record: an opener, 0-3 fact clauses (<= MAX_TRIPLES triples; maybe a fact-free clause among them),
    maybe filler."""
    if rng.random() < EMPTY_RATE:
        clauses = [(_negative(rng), ()) for _ in range(rng.randint(1, 2))]
    else:
        clauses = [_fact_clause(rng, rng.choice(templates)) for _ in range(rng.choice((1, 1, 2, 2, 3)))]
        while sum(len(ts) for _, ts in clauses) > MAX_TRIPLES:
            clauses.pop()
        if rng.random() < NEGATIVE_CLAUSE_RATE:
            clauses.insert(rng.randint(0, len(clauses)), (_negative(rng), ()))
    text = _expand(rng, rng.choice(OPENERS)).format(n=rng.randint(100, 999))
    for i, (clause, _) in enumerate(clauses):
        text += clause + (rng.choice(JOINERS) if i < len(clauses) - 1 else "。")
    if long:
        text += _filler(rng)
    triples = tuple(t for _, ts in clauses for t in ts)
    return GeneratedRecord(text, triples)


def _fact_clause(rng: random.Random, template) -> tuple[str, tuple]:
    pattern, facts = template
    pattern = _expand(rng, pattern)
    values = _fill_slots(rng, pattern)
    return pattern.format(**values), tuple((values[s], rel, values[o]) for s, rel, o in facts)


def _fill_slots(rng: random.Random, pattern: str) -> dict[str, str]:
    """A word for every slot of the pattern; `x` and `x2` always differ."""
    values = {}
    for slot in sorted(SLOT_WORDS):
        if "{" + slot + "}" in pattern:
            choices = [w for w in SLOT_WORDS[slot] if w != values.get(slot.rstrip("2"))]
            values[slot] = rng.choice(choices)
    return values


def _negative(rng: random.Random) -> str:
    pattern = _expand(rng, rng.choice(NEGATIVE_TEMPLATES))
    return pattern.format(c=rng.choice(COMPONENTS), q=rng.choice(QUANTITIES), t=rng.choice(TOOLS))


def _filler(rng: random.Random) -> str:
    """Fact-free sentences: about 30 clauses, several hundred characters."""
    sentences = []
    for _ in range(rng.randint(28, 36)):
        pattern = rng.choice(FILLER_TEMPLATES)
        sentences.append(pattern.format(
            a=rng.randint(1, 999), b=rng.randint(1000, 99999), y=rng.randint(2015, 2023),
            m=rng.randint(1, 12), d=rng.randint(1, 28),
        ))
    return "，".join(sentences) + "。"


def make_splits(n_train: int, n_dev: int, *, seed: int, relations=RELATIONS) -> tuple[list[GeneratedRecord],
                                                                                      list[GeneratedRecord]]:
    """Train and dev records; dev is drawn with `seed + 1` and never repeats a train text."""
    train = generate_records(n_train, seed=seed, relations=relations)
    dev = generate_records(n_dev, seed=seed + 1, relations=relations, exclude_texts=frozenset(r.text for r in train))
    return train, dev


def write_jsonl(records: list[GeneratedRecord], path: Path) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for record in records:
            f.write(json.dumps(record.to_json(), ensure_ascii=False) + "\n")


def write_splits(out_dir: Path, *, n_train=DEFAULT_TRAIN_SIZE, n_dev=DEFAULT_DEV_SIZE, seed=DEFAULT_SEED,
                 relations=RELATIONS, prefix=DEFAULT_PREFIX) -> dict[Path, list[GeneratedRecord]]:
    """Write `<prefix>_train.jsonl` and `<prefix>_dev.jsonl` under `out_dir`; returns {path: records}."""
    check_vocabulary()
    train, dev = make_splits(n_train, n_dev, seed=seed, relations=relations)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = {out_dir / f"{prefix}_train.jsonl": train, out_dir / f"{prefix}_dev.jsonl": dev}
    for path, records in written.items():
        write_jsonl(records, path)
    return written


def statistics(records: list[GeneratedRecord]) -> dict:
    """Counts that describe a split (for the summary line and the README)."""
    triples = [t for r in records for t in r.triples]
    lengths = sorted(len(r.text) for r in records)
    return {
        "records": len(records),
        "triples": len(triples),
        "by_relation": {rel: sum(t[1] == rel for t in triples) for rel in RELATIONS},
        "empty": sum(not r.triples for r in records),
        "with_duplicates": sum(len(set(r.triples)) < len(r.triples) for r in records),
        "shared_subject": sum(len({t[0] for t in set(r.triples)}) < len(set(r.triples)) for r in records),
        "long_over_300_chars": sum(n > 300 for n in lengths),
        "median_chars": lengths[len(lengths) // 2] if lengths else 0,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--out-dir", type=Path, default=DATA_DIR, help="directory the two files are written to")
    parser.add_argument("--train-size", type=int, default=DEFAULT_TRAIN_SIZE, help="records in the train file")
    parser.add_argument("--dev-size", type=int, default=DEFAULT_DEV_SIZE, help="records in the dev file")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help="random seed (dev uses seed + 1)")
    parser.add_argument("--relations", default=",".join(RELATIONS),
                        help="comma-separated subset of the relations to generate")
    parser.add_argument("--prefix", default=DEFAULT_PREFIX,
                        help="file names are <prefix>_train.jsonl and <prefix>_dev.jsonl")
    args = parser.parse_args(argv)
    relations = tuple(r.strip() for r in args.relations.split(",") if r.strip())
    try:
        written = write_splits(args.out_dir, n_train=args.train_size, n_dev=args.dev_size, seed=args.seed,
                               relations=relations, prefix=args.prefix)
    except ValueError as err:
        parser.error(str(err))
    for path, records in written.items():
        print(f"{path}: {json.dumps(statistics(records), ensure_ascii=False)}")


if __name__ == "__main__":
    main()
