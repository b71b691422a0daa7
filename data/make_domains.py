"""Generate synthetic SPO sets of other domains than the shipped car-repair set (`make_spo.py`).

    python data/make_domains.py --domain people --out-dir data/domains/people --train 3000 --dev 200 --seed 0
    python data/make_domains.py --all                # every domain, its default sizes, data/domains/<name>/
    python data/make_domains.py --list               # the domains and their relations

A domain is data, not code: entity pools (slot kind -> words) plus relation templates, fact-free
clauses, openers and filler (`Domain`); a new domain of the same kind is one more `Domain(...)` in
DOMAINS. Records have the shipped `{"text", "answer"}` shape (answer: `subject_predicate_object`
lines, in text order) and the variety of `make_spo.py`:

- 0 to MAX_TRIPLES (4) triples a record; EMPTY_RATE of the records state no fact at all, and fact-free
  clauses that still name entities are mixed into others (an entity mentioned is not a fact);
- templates with the object before the subject (`{org}由{person}创立` gives `org_创始人_person`), two
  facts about one subject in a clause, a fact stated twice (listed twice, as in the reference data);
- every LONG_EVERY-th record a long text: the facts first, then several hundred characters of
  fact-free filler, so truncating the source never removes a fact.

Learnability rules, checked by `check_vocabulary`: no word contains '_' or another word of the domain,
and no template/opener/filler text contains a word; so every fact is a span copy. Filler sentences
that happen to contain a word (numbers) are redrawn. Deterministic for a seed (`random.Random`); dev
is drawn with seed + 1 and never repeats a train text.

Template syntax (as in make_spo.py): `{kind}` or `{kind2}` is a word of pool `kind` (slots of one
pool in a clause always differ), `[a|b|]` draws one alternative (empty allowed); each template lists
the triples it states as (subject slot, relation, object slot).
"""

from __future__ import annotations

import argparse
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

DATA_DIR = Path(__file__).resolve().parent
DEFAULT_OUT_ROOT = DATA_DIR / "domains"
DEFAULT_SEED = 0
DEFAULT_DEV_SIZE = 200

EMPTY_RATE = 0.08  # records with no triple at all
LONG_EVERY = 50  # every 50th record: facts, then a long filler
NEGATIVE_CLAUSE_RATE = 0.3  # a fact-free clause mixed into a record with facts
MAX_TRIPLES = 4  # per record
CLAUSE_COUNTS = (1, 1, 2, 2, 2, 3, 3)  # fact clauses a record draws (then cut to MAX_TRIPLES triples)

SLOT = re.compile(r"\{([a-z]+)(\d?)\}")
ALTERNATIVES = re.compile(r"\[([^\]]*)\]")
NUMBER_FIELDS = dict(num=(1, 999), big=(1000, 99999), month=(1, 12), day=(1, 28))  # slots drawn as numbers, not words


@dataclass(frozen=True)
class Domain:
    """Everything that makes a domain. `pools`: slot kind -> words; `templates`: (pattern, triples)."""

    name: str
    pools: Mapping[str, tuple[str, ...]]
    templates: tuple[tuple[str, tuple[tuple[str, str, str], ...]], ...]
    negatives: tuple[str, ...]  # fact-free clauses (slots allowed)
    openers: tuple[str, ...]  # text before the first clause (NUMBER_FIELDS slots allowed)
    fillers: tuple[str, ...]  # fact-free sentences for long texts (NUMBER_FIELDS slots: numbers)
    train_size: int = 3000  # the default size of its train split

    @property
    def relations(self) -> tuple[str, ...]:
        """The relation names, in template order."""
        return tuple(dict.fromkeys(rel for _, facts in self.templates for _, rel, _ in facts))

    def words(self) -> list[str]:
        return sorted({w for ws in self.pools.values() for w in ws})


@dataclass(frozen=True)
class GeneratedRecord:
    text: str
    triples: tuple[tuple[str, str, str], ...]

    def to_json(self) -> dict:
        return {"text": self.text, "answer": "\n".join("_".join(t) for t in self.triples)}


# ----------------------------------------------------------------------------------------------
# Pools shared by several domains

# fmt: off
CITIES = (
    "上海", "深圳", "杭州", "成都", "武汉", "南京", "西安", "重庆", "苏州", "天津", "长沙", "青岛",
    "厦门", "郑州", "合肥", "昆明", "大连", "宁波", "济南", "福州", "沈阳", "哈尔滨", "贵阳", "南昌",
)
NUMBERED_FILLERS = (
    "全文共{big}字", "本文已被转载{num}次", "阅读量超过{big}", "编号为{big}的稿件已归档", "责任编辑核对了第{num}处引文",
    "评论区收到{num}条留言", "稿件于{month}月{day}日更新", "附图共{num}张", "页面访问{big}人次",
    "第{num}条读者反馈已回复",
)

# ----------------------------------------------------------------------------------------------
# people: persons and organisations

PEOPLE = Domain(
    name="people",
    pools={
        "p": ("张伟明", "李静怡", "王建国", "刘思远", "陈晓峰", "杨丽华", "赵子涵", "黄志强", "周雨桐", "吴俊杰",
              "徐慧敏", "孙浩然", "马文博", "朱嘉欣", "胡天宇", "郭美玲", "何家豪", "林婉清", "高振东", "罗佳琪",
              "梁宏伟", "宋雅婷", "郑凯文", "谢晓雯"),
        "o": ("星河科技", "远航集团", "蓝海传媒", "华信银行", "天成医药", "云图软件", "金石资本", "启明教育",
              "东方汽车", "万象地产", "博雅出版社", "青松物流", "长风航空", "中联电气", "瑞丰食品", "鼎盛证券",
              "新锐游戏", "盛世影业", "恒通能源", "德润化工", "海纳通信", "致远咨询", "宏图建设", "嘉禾农业"),
        "s": ("清华大学", "复旦大学", "浙江大学", "中山大学", "同济大学", "南开大学", "四川大学", "山东大学",
              "吉林大学", "中南大学", "东南大学", "湖南大学", "兰州大学", "北京大学", "暨南大学", "北京师范大学",
              "华中科技大学", "西北工业大学", "电子科技大学", "北京航空航天大学", "华南理工大学", "云南大学",
              "宁夏大学", "广西大学"),
        "c": CITIES,
        "n": ("中国", "美国", "英国", "法国", "德国", "日本", "韩国", "加拿大", "澳大利亚", "新加坡", "意大利",
              "西班牙", "荷兰", "瑞士", "瑞典", "俄罗斯", "巴西", "印度", "泰国", "马来西亚", "新西兰", "爱尔兰",
              "挪威", "丹麦"),
        "y": tuple(f"{y}年" for y in range(1984, 2024, 5)) + tuple(f"{y}年" for y in range(1986, 2024, 5))
             + tuple(f"{y}年" for y in range(1988, 2024, 5)),
    },
    templates=(
        ("{o}[由|是由]{p}[创立|创办|一手创建]的", (("o", "创始人", "p"),)),
        ("{p}[创办了|创立了|一手创建了]{o}", (("o", "创始人", "p"),)),
        ("{o}的创始人[是|为]{p}", (("o", "创始人", "p"),)),
        ("{p}[毕业于|本科毕业于|博士毕业于]{s}", (("p", "毕业院校", "s"),)),
        ("{p}[曾|早年|]就读于{s}", (("p", "毕业院校", "s"),)),
        ("{s}[校友|毕业生]{p}[回到了母校|获得了表彰|作了报告]", (("p", "毕业院校", "s"),)),
        ("{p}[现任职于|目前就职于|任职于]{o}", (("p", "任职于", "o"),)),
        ("{p}[加入了|入职了]{o}", (("p", "任职于", "o"),)),
        ("{o}[高管|总经理|首席工程师]{p}[表示|透露|介绍说]", (("p", "任职于", "o"),)),
        ("{p}[出生于|生于|出生在]{c}", (("p", "出生地", "c"),)),
        ("{p}[是土生土长的|是地道的]{c}人", (("p", "出生地", "c"),)),
        ("{p}[拥有|持有]{n}国籍", (("p", "国籍", "n"),)),
        ("{p}[是|为]{n}[籍|公民]", (("p", "国籍", "n"),)),
        ("{p}的[妻子|丈夫|配偶]是{p2}", (("p", "配偶", "p2"),)),
        ("{p}与{p2}[结婚|结为夫妻|喜结连理]", (("p", "配偶", "p2"),)),
        ("{o}[总部位于|总部设在|将总部迁至]{c}", (("o", "总部位于", "c"),)),
        ("总部位于{c}的{o}[发布了新品|宣布扩张|业绩增长]", (("o", "总部位于", "c"),)),
        ("{o}[成立于|创建于|注册于]{y}", (("o", "成立时间", "y"),)),
        ("{y}，{o}[正式成立|宣告成立]", (("o", "成立时间", "y"),)),
        # two facts about one subject
        ("{p}[出生于|生于]{c}，[毕业于|就读于]{s}", (("p", "出生地", "c"), ("p", "毕业院校", "s"))),
        ("{o}成立于{y}，总部[位于|设在]{c}", (("o", "成立时间", "y"), ("o", "总部位于", "c"))),
        ("{p}毕业于{s}[后|之后|，随后]加入{o}", (("p", "毕业院校", "s"), ("p", "任职于", "o"))),
        ("{o}由{p}于{y}[创立|创办]", (("o", "创始人", "p"), ("o", "成立时间", "y"))),
        ("{p}，{n}国籍，[生于|出生于]{c}", (("p", "国籍", "n"), ("p", "出生地", "c"))),
        # a fact stated twice
        ("{p}任职于{o}，[至今仍在|目前还在]{o}工作", (("p", "任职于", "o"), ("p", "任职于", "o"))),
    ),
    negatives=(
        "{p}[出席了|参加了]发布会", "{p}[曾到访|考察了|路过]{c}", "{p}[参观了|访问了]{s}", "{p}[会见了|拜访了]{p2}",
        "{o}[发布了年报|召开了股东大会|股价上涨]", "[据报道|有消息称]{o}业绩稳定", "{p}[接受了记者采访|发表了演讲]",
    ),
    openers=("", "", "", "人物简介：", "新闻摘要：", "资料显示，", "百科词条：", "第{num}期访谈：", "据悉，"),
    fillers=NUMBERED_FILLERS,
    train_size=3000,
)

# ----------------------------------------------------------------------------------------------
# products: products, brands and companies

PRODUCTS = Domain(
    name="products",
    pools={
        "g": ("云帆笔记本", "星耀手机", "听澜耳机", "锐影相机", "晨曦手表", "极光平板", "飞鸿电动车", "暖阳空调",
              "清泉净水器", "静语吸尘器", "灵动音箱", "驭风无人机", "青岚冰箱", "墨羽阅读器", "赤焰显卡", "雪域洗衣机",
              "微光投影仪", "凌云路由器", "追光电视", "逐浪游戏机", "流星键盘", "银河鼠标", "北斗记录仪", "朝露加湿器"),
        "b": ("乐拓", "优米", "智卡", "酷思", "极米", "魅影", "斐讯", "迅驰", "宏景", "蓝鲸", "泰尔", "恒星",
              "睿智", "飞扬", "雅乐", "新意", "巨浪", "美途", "安途", "顺达", "科维", "天籁", "百灵", "凯越"),
        "co": ("华瑞电子", "鼎新科技", "宏达制造", "联创集团", "天宇实业", "明远电器", "恒信数码", "伟业精工",
               "锦程控股", "海川智能", "中科光电", "盛达电子", "合众智造", "拓维信息", "东升工业", "永安电器",
               "光启半导体", "金桥投资", "同舟股份", "银杉实业", "华夏精密", "泰和集团", "九州通讯", "博远科技"),
        "pl": CITIES,
        "pr": tuple(f"{p}元" for p in (1299, 1499, 1599, 1799, 1999, 2199, 2399, 2499, 2699, 2999, 3199, 3499,
                                      3699, 3999, 4299, 4599, 4999, 5299, 5699, 5999, 6499, 6999, 7499, 8999)),
        "t": tuple(f"{y}年{m}月" for y in (2019, 2020, 2021, 2022, 2023, 2024) for m in (3, 6, 9, 11)),
    },
    templates=(
        ("{g}由{co}[生产|制造|出品]", (("g", "生产商", "co"),)),
        ("{co}[推出|生产|研发]的{g}[上市了|销量很好|广受好评]", (("g", "生产商", "co"),)),
        ("{g}的生产商[是|为]{co}", (("g", "生产商", "co"),)),
        ("{b}旗下的{g}[广受欢迎|销量领先|备受关注]", (("g", "品牌", "b"),)),
        ("{g}是{b}品牌的[产品|新品|主力产品]", (("g", "品牌", "b"),)),
        ("{g}[于|在]{t}[正式发布|发布|亮相]", (("g", "发布时间", "t"),)),
        ("{t}，{g}[正式发布|首次亮相|开始发售]", (("g", "发布时间", "t"),)),
        ("{g}[售价|定价|官方售价|的价格为]{pr}", (("g", "价格", "pr"),)),
        ("{g}[只卖|卖到了|标价]{pr}", (("g", "价格", "pr"),)),
        ("{g}[产自|原产于]{pl}", (("g", "产地", "pl"),)),
        ("{g}的产地[是|为|在]{pl}", (("g", "产地", "pl"),)),
        ("{co}是{co2}的[子公司|全资子公司|控股子公司]", (("co", "母公司", "co2"),)),
        ("{co}的母公司[是|为]{co2}", (("co", "母公司", "co2"),)),
        ("{co2}[收购了|全资控股|控股]{co}", (("co", "母公司", "co2"),)),
        ("{co}的[主要|最大的|]竞争对手[是|为]{co2}", (("co", "竞争对手", "co2"),)),
        ("{co}与{co2}[竞争激烈|是老对手|在市场上激烈竞争]", (("co", "竞争对手", "co2"),)),
        # two facts about one subject
        ("{g}由{co}[生产|制造]，[售价|定价]{pr}", (("g", "生产商", "co"), ("g", "价格", "pr"))),
        ("{b}旗下的{g}于{t}发布", (("g", "品牌", "b"), ("g", "发布时间", "t"))),
        ("{g}产自{pl}，[售价|标价]{pr}", (("g", "产地", "pl"), ("g", "价格", "pr"))),
        ("{co}是{co2}的子公司，[主要|最大的]竞争对手是{co3}", (("co", "母公司", "co2"), ("co", "竞争对手", "co3"))),
        # a fact stated twice
        ("{g}[售价|定价]{pr}，[促销时|活动期间]仍卖{pr}", (("g", "价格", "pr"), ("g", "价格", "pr"))),
    ),
    negatives=(
        "{g}[销量不错|好评如潮|正在促销|暂时缺货]", "{co}[召开了发布会|公布了财报|股价上涨]",
        "{b}[更换了标志|举办了周年庆]", "用户[试用了|评测了|退回了]{g}", "{pl}[举办了|承办了]消费电子展",
        "{co}与{co2}[签署了合作协议|共同参展]",
    ),
    openers=("", "", "", "产品资讯：", "评测摘要：", "市场快讯：", "第{num}期导购：", "据了解，"),
    fillers=NUMBERED_FILLERS,
    train_size=2200,
)

# ----------------------------------------------------------------------------------------------
# medicine: diseases and what is known of them

MEDICINE = Domain(
    name="medicine",
    pools={
        "d": ("胃溃疡", "哮喘", "痛风", "偏头痛", "带状疱疹", "白内障", "青光眼", "甲亢", "缺铁性贫血", "肺结核",
              "冠心病", "高血压", "糖尿病", "肾结石", "胆囊炎", "阑尾炎", "湿疹", "荨麻疹", "骨质疏松症", "帕金森病",
              "类风湿关节炎", "鼻窦炎", "中耳炎", "脑梗死", "肝硬化", "心力衰竭"),
        "s": ("发热", "咳嗽", "胸闷", "乏力", "恶心", "呕吐", "腹泻", "头晕", "心悸", "失眠", "盗汗", "水肿",
              "皮疹", "瘙痒", "视物模糊", "关节肿痛", "气短", "食欲减退", "体重下降", "尿频", "耳鸣", "鼻塞",
              "腰痛", "咯血"),
        "c": ("细菌感染", "病毒感染", "遗传因素", "长期吸烟", "过度饮酒", "高脂饮食", "缺乏运动", "精神压力大",
              "作息不规律", "免疫力低下", "幽门螺杆菌感染", "过敏反应", "肥胖", "长期熬夜", "环境污染", "年龄增长",
              "外伤", "激素紊乱", "营养不良", "尿酸升高", "血脂异常", "真菌感染", "久坐不动", "铁摄入不足"),
        "m": ("阿莫西林", "布洛芬", "奥美拉唑", "二甲双胍", "硝苯地平", "阿司匹林", "头孢克肟", "氯雷他定",
              "左氧氟沙星", "甲硝唑", "泼尼松", "胰岛素", "别嘌醇", "沙丁胺醇", "阿托伐他汀", "利福平", "碳酸钙",
              "硫酸亚铁", "甲巯咪唑", "左旋多巴", "卡马西平", "美托洛尔", "地塞米松", "非布司他"),
        "e": ("血常规", "尿常规", "胸部CT", "心电图", "胃镜", "肠镜", "B超", "核磁共振", "X光片", "肝功能检查",
              "肾功能检查", "血糖检测", "骨密度检查", "眼底检查", "肺功能检查", "甲功五项", "血脂检查", "脑电图",
              "痰培养", "皮肤活检", "结核菌素试验", "尿酸检测", "听力检查", "冠脉造影"),
        "b": ("胃部", "肺部", "肝脏", "肾脏", "心脏", "大脑", "眼球", "表皮", "膝关节", "腰椎", "甲状腺", "胆道",
              "胸腔", "腹腔", "咽喉", "鼻腔", "耳道", "结肠", "十二指肠", "前列腺", "脊柱", "血管", "淋巴结", "肌肉"),
        "k": ("消化内科", "呼吸内科", "心内科", "内分泌科", "神经内科", "皮肤科", "眼科", "骨科", "泌尿外科",
              "普外科", "风湿免疫科", "耳鼻喉科", "肾内科", "血液科", "感染科", "肝胆外科", "神经外科", "心胸外科",
              "急诊科", "老年科", "康复科", "中医科", "精神科", "儿科"),
    },
    templates=(
        ("{d}的[主要|常见|典型]症状[是|为|包括]{s}", (("d", "症状", "s"),)),
        ("{d}患者[常|多|往往]出现{s}", (("d", "症状", "s"),)),
        ("{d}[表现为|可表现为|主要表现为]{s}", (("d", "症状", "s"),)),
        ("{d}[多由|常由|主要由]{c}[引起|导致|所致]", (("d", "病因", "c"),)),
        ("{c}是{d}的[常见|主要|]病因", (("d", "病因", "c"),)),
        ("{d}[可用|常用|可以服用]{m}[治疗|控制|缓解]", (("d", "治疗药物", "m"),)),
        ("治疗{d}[可选用|常用|首选]{m}", (("d", "治疗药物", "m"),)),
        ("{m}[可用于治疗|适用于|主治]{d}", (("d", "治疗药物", "m"),)),
        ("{d}[需要做|可通过|建议做]{e}[确诊|明确诊断]", (("d", "检查方法", "e"),)),
        ("诊断{d}[常用|需要|可做]{e}", (("d", "检查方法", "e"),)),
        ("{d}[可并发|容易并发|可能并发]{d2}", (("d", "并发症", "d2"),)),
        ("{d2}是{d}的[常见|严重|]并发症", (("d", "并发症", "d2"),)),
        ("{d}[好发于|多发于|常见于]{b}", (("d", "发病部位", "b"),)),
        ("{d}主要[累及|侵犯|影响]{b}", (("d", "发病部位", "b"),)),
        ("{d}[患者应|应|需]到{k}[就诊|挂号|看病]", (("d", "所属科室", "k"),)),
        ("{d}[属于|归]{k}[诊治|管辖]", (("d", "所属科室", "k"),)),
        # two facts about one subject
        ("{d}[好发于|多发于]{b}，[主要|常见]症状[是|为]{s}", (("d", "发病部位", "b"), ("d", "症状", "s"))),
        ("{d}[多由|常由]{c}引起，可用{m}治疗", (("d", "病因", "c"), ("d", "治疗药物", "m"))),
        ("{d}需到{k}就诊，通过{e}确诊", (("d", "所属科室", "k"), ("d", "检查方法", "e"))),
        ("{d}患者常出现{s}和{s2}", (("d", "症状", "s"), ("d", "症状", "s2"))),
        # a fact stated twice
        ("{d}可用{m}治疗，复诊时[仍|继续]用{m}", (("d", "治疗药物", "m"), ("d", "治疗药物", "m"))),
    ),
    negatives=(
        "{d}[可以预防|需要长期随访|应尽早就医]", "[多喝水|注意休息|清淡饮食]有助于恢复",
        "{m}[需要冷藏保存|应遵医嘱服用]", "{e}[无需空腹|需要预约]", "{k}[今日停诊|周末正常出诊]",
        "{b}[没有发现异常|未见明显病变]",
    ),
    openers=("", "", "", "病历摘要：", "健康科普：", "门诊记录：", "第{num}号病例：", "医生提醒，"),
    fillers=(
        "门诊量累计{big}人次", "本文已被转载{num}次", "病例编号{big}已归档",
        "患者于{month}月{day}日复诊", "随访{num}天", "床位号为{num}", "候诊约{num}分钟", "第{num}次随访已完成",
        "检查单号{big}", "住院号{big}",
    ),
    train_size=4000,
)
# fmt: on

DOMAINS = {d.name: d for d in (PEOPLE, PRODUCTS, MEDICINE)}


# ----------------------------------------------------------------------------------------------
# Checking and generating


def check_vocabulary(domain: Domain) -> None:
    """Raise ValueError if a word has '_' or a newline, contains another word, or appears in literal
    template/opener/filler text; or a template names a slot kind the domain has no pool for."""
    words = domain.words()
    problems = [w for w in words if "_" in w or "\n" in w or not w.strip()]
    problems += [f"{rel!r} has '_'" for rel in domain.relations if "_" in rel]
    problems += [f"pool {kind!r} is named like a number field" for kind in domain.pools if kind in NUMBER_FIELDS]
    problems += [f"{a} in {b}" for a in words for b in words if a != b and a in b]
    patterns = [t for t, _ in domain.templates] + list(domain.negatives) + list(domain.openers) + list(domain.fillers)
    for pattern in patterns:
        problems += [f"no pool {kind!r} in {pattern!r}" for kind, _ in SLOT.findall(pattern)
                     if kind not in domain.pools and kind not in NUMBER_FIELDS]
        pieces = re.split(r"\{\w+\}|[\[\]|]", pattern)  # every literal piece and every alternative
        problems += [f"{w} in template {pattern!r}" for w in words for piece in pieces if w in piece]
    for pattern, facts in domain.templates:
        slots = {kind + digit for kind, digit in SLOT.findall(pattern)}
        problems += [f"slot {s!r} of a triple is not in {pattern!r}" for fact in facts for s in (fact[0], fact[2])
                     if s not in slots]
    if problems:
        raise ValueError(f"domain {domain.name}: vocabulary problems: " + "; ".join(problems))


def generate_records(domain: Domain, n: int, *, seed: int, exclude_texts=frozenset()) -> list[GeneratedRecord]:
    """`n` distinct records of `domain`; texts in `exclude_texts` are redrawn."""
    rng = random.Random(seed)
    records, seen = [], set(exclude_texts)
    while len(records) < n:
        record = _record(rng, domain, long=(len(records) + 1) % LONG_EVERY == 0)
        if record.text not in seen:
            seen.add(record.text)
            records.append(record)
    return records


def _record(rng: random.Random, domain: Domain, *, long: bool) -> GeneratedRecord:
    """An opener, fact clauses in random order (<= MAX_TRIPLES triples; maybe a fact-free clause among
    them) or only fact-free clauses, maybe a long filler."""
    if rng.random() < EMPTY_RATE:
        clauses = [(_fill(rng, domain, rng.choice(domain.negatives)), ()) for _ in range(rng.randint(1, 2))]
    else:
        clauses = []
        for _ in range(rng.choice(CLAUSE_COUNTS)):
            pattern, facts = rng.choice(domain.templates)
            values = {}
            text = _fill(rng, domain, pattern, values)
            clauses.append((text, tuple((values[s], rel, values[o]) for s, rel, o in facts)))
        while sum(len(ts) for _, ts in clauses) > MAX_TRIPLES:
            clauses.pop()
        if rng.random() < NEGATIVE_CLAUSE_RATE:
            clauses.insert(rng.randint(0, len(clauses)), (_fill(rng, domain, rng.choice(domain.negatives)), ()))
    text = _fill(rng, domain, rng.choice(domain.openers))
    for i, (clause, _) in enumerate(clauses):
        text += clause + (rng.choice("，；。") if i < len(clauses) - 1 else "。")
    if long:
        text += _filler(rng, domain)
    return GeneratedRecord(text, tuple(t for _, ts in clauses for t in ts))


def _fill(rng: random.Random, domain: Domain, pattern: str, values: dict | None = None) -> str:
    """Draw the alternatives of a pattern and a word (or number) for each slot; slots of one pool get
    different words. The drawn words are left in `values` (slot -> word)."""
    pattern = ALTERNATIVES.sub(lambda m: rng.choice(m.group(1).split("|")), pattern)
    values = {} if values is None else values
    for kind, digit in dict.fromkeys(SLOT.findall(pattern)):
        if kind in domain.pools:
            taken = {v for s, v in values.items() if s.rstrip("0123456789") == kind}
            values[kind + digit] = rng.choice([w for w in domain.pools[kind] if w not in taken])
        else:
            values[kind + digit] = str(rng.randint(*NUMBER_FIELDS[kind]))
    return SLOT.sub(lambda m: values[m.group(1) + m.group(2)], pattern)


def _filler(rng: random.Random, domain: Domain) -> str:
    """Fact-free sentences, several hundred characters; a sentence that contains a word is redrawn."""
    words = domain.words()
    sentences = []
    while len(sentences) < rng.randint(24, 30):
        sentence = _fill(rng, domain, rng.choice(domain.fillers))
        if not any(w in sentence for w in words):
            sentences.append(sentence)
    return "，".join(sentences) + "。"


def make_splits(domain: Domain, n_train: int, n_dev: int, *, seed: int) -> tuple[list[GeneratedRecord],
                                                                                 list[GeneratedRecord]]:
    """Train and dev records; dev is drawn with `seed + 1` and never repeats a train text."""
    check_vocabulary(domain)
    train = generate_records(domain, n_train, seed=seed)
    dev = generate_records(domain, n_dev, seed=seed + 1, exclude_texts=frozenset(r.text for r in train))
    return train, dev


def write_jsonl(records: list[GeneratedRecord], path: Path) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for record in records:
            f.write(json.dumps(record.to_json(), ensure_ascii=False) + "\n")


def write_splits(domain: Domain, out_dir: Path, *, n_train: int | None = None, n_dev: int = DEFAULT_DEV_SIZE,
                 seed: int = DEFAULT_SEED) -> dict[Path, list[GeneratedRecord]]:
    """Write `train.jsonl` and `dev.jsonl` under `out_dir` (train size: the domain's default when None)."""
    train, dev = make_splits(domain, domain.train_size if n_train is None else n_train, n_dev, seed=seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = {out_dir / "train.jsonl": train, out_dir / "dev.jsonl": dev}
    for path, records in written.items():
        write_jsonl(records, path)
    return written


def statistics(records: list[GeneratedRecord], relations: tuple[str, ...]) -> dict:
    """Counts that describe a split."""
    triples = [t for r in records for t in r.triples]
    lengths = sorted(len(r.text) for r in records)
    return {
        "records": len(records),
        "triples": len(triples),
        "by_relation": {rel: sum(t[1] == rel for t in triples) for rel in relations},
        "by_triple_count": {k: sum(len(r.triples) == k for r in records) for k in range(MAX_TRIPLES + 1)},
        "with_duplicates": sum(len(set(r.triples)) < len(r.triples) for r in records),
        "shared_subject": sum(len({t[0] for t in set(r.triples)}) < len(set(r.triples)) for r in records),
        "long_over_300_chars": sum(n > 300 for n in lengths),
        "median_chars": lengths[len(lengths) // 2] if lengths else 0,
        "max_answer_chars": max((len(r.to_json()["answer"]) for r in records), default=0),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--domain", choices=sorted(DOMAINS), help="the domain to generate")
    which.add_argument("--all", action="store_true", help="every domain, each into <out-dir>/<name>")
    which.add_argument("--list", action="store_true", help="print the domains and their relations")
    parser.add_argument("--out-dir", type=Path,
                        help=f"with --domain: the directory (default {DEFAULT_OUT_ROOT}/<name>); "
                                                     f"with --all: the parent (default {DEFAULT_OUT_ROOT})")
    parser.add_argument("--train", type=int, help="records in train.jsonl (default: the domain's own size)")
    parser.add_argument("--dev", type=int, default=DEFAULT_DEV_SIZE, help="records in dev.jsonl")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help="random seed (dev uses seed + 1)")
    args = parser.parse_args(argv)
    if args.list:
        for d in DOMAINS.values():
            print(f"{d.name} (train {d.train_size}): {', '.join(d.relations)}")
        return
    if args.all:
        root = args.out_dir or DEFAULT_OUT_ROOT
        jobs = [(d, root / d.name) for d in DOMAINS.values()]
    else:
        jobs = [(DOMAINS[args.domain], args.out_dir or DEFAULT_OUT_ROOT / args.domain)]
    for domain, out_dir in jobs:
        try:
            written = write_splits(domain, out_dir, n_train=args.train, n_dev=args.dev, seed=args.seed)
        except ValueError as err:
            parser.error(str(err))
        for path, records in written.items():
            print(f"{path}: {json.dumps(statistics(records, domain.relations), ensure_ascii=False)}")


if __name__ == "__main__":
    main()
