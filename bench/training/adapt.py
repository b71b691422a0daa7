"""Adapting a trained base to relations it never saw: P-tuning v2 and LoRA, on a tiny model of each version.

`--version chatglm|chatglm3|glm4|glm4-0414` picks the base's architecture, tokenizer and prompt format (the
tiny preset of that version: `train.py --model tiny|tiny-chatglm3|tiny-glm4|tiny-glm4-0414`; GLM-4-0414 is
GLM-4's architecture with a norm after attention and after the MLP, in transformers' own form, its prompt
the chat template of its tokenizer.json); every stage below is the same for each, and LoRA puts adapters on
the version's block Linears (attention and MLP).

0. Pretraining. A real base (ChatGLM-6B) was pretrained on text before it was tuned: it can write
   every character and copy any span of its input. The tiny base gets the small version of that: it
   learns to repeat texts of all four relations (a corpus of its own, unannotated, sharing no text
   with a dev file) after its own instruction (COPY_PROMPT, in the version's prompt format), in a
   plain loop over the library's model. Among those texts go glossary rows (one per GLOSSARY_EVERY
   texts) that list relation names in a random order, so that the base has written every word an
   answer can need, as a real base has (no text names a relation: 性 and 具 occur in none). Its
   vocabulary (character-level; GLM-4: bytes, every character, then merges) is trained on
   that corpus, the relation names and the base's train file, as a real base's covers every character.
1. The pretrained base is then trained (full fine-tuning, the tiny demo's settings) on synthetic
   records that state facts of two relations (部件故障, 检测工具) only, mixed with records of the three
   other domains of make_domains.py (people and organisations, products, medicine: 22 relations,
   `--other-domain-records` of each; the pretraining corpus holds as many more of their texts), as a
   real base has learnt many kinds of extraction before it meets yours.
2. Its dev F1 is measured on records that state facts of the two other relations (性能故障, 组成) only,
   and on its own.
3. P-tuning v2 (prefix only) and LoRA (adapters on the block Linears) each train on the new relations'
   records on top of the frozen base (train.py --model <base run>); their dev F1 on the new relations
   is measured from the saved run directories (infer.py's loading path).
Target: each adaptation lifts dev F1 from the base's score to >= 0.8. The last line is JSON.

What the design has been through (P-tuning v2 dev F1 on the new relations):
- Texts of all four relations in every file, each annotated with its own relations only (the base
  learns to answer nothing for a new relation's fact, which the prefix must then undo), no
  pretraining: 0.27 (组成 0.43, 性能故障 0: the base had never written 36 of the 44 characters of the
  state words). LoRA: 0.87.
- The same with copy pretraining on the base's texts: 0.486 (组成 0.69, 性能故障 0: the prefix wrote
  格能故障 / 给能故障, never having written 性).
- The same with glossary rows too: 0.432 (组成 0.63, 性能故障 0.02: the relation is written now, but the
  prefix did not overturn the base's learned silence on quantity/state facts); LoRA 0.988.
- Each file states the facts of its own relations only; pretraining on a corpus of all four: 0.904
  (性能故障 0.88, 组成 0.92); LoRA 1.000; the base 0.999 on its own relations and 0 on the new ones
  (bench/results/adapt.json, 54 min on one thread, 20 P-tuning epochs, no other domains: not yet
  measured again on the present design).

On a tiny ChatGLM3 base (--version chatglm3, the same design; base 0.997 on its own relations, 0 on the
new ones) these P-tuning flags reach only 0.176 after the full 5000 steps (dev loss 1.05 at step 500,
0.38 at the end; F1 0.02 at step 1000, 0.13 at 3500), where LoRA reaches 0.99. Why, measured: the GLM
base's layer-0 attention is nearly uniform over the text (its queries are near 0, the logits about
-0.7), so the 128 prefix entries, whose keys start near 0, take 86% of every layer-0 head's attention
before any training (the prefix there adds one vector to every position), and after it 77-100% of every head of
every layer: the copying heads no longer find the text, and the answers name entities that are not in
it (密封圈是减振器的零部件 -> 车速信号_组成_减振器). Tried without success: pre_seq_len 16 (F1 0.004 at
step 1000), no projection at lr 3e-3 (0 at step 500), a prefix of 32 started from the base's own keys
and values of real prompt tokens (0 at step 1500), no projection at the official lr 2e-2 (0.069 at step
1500, dev loss 0.62), a prefix started as a no-op (keys against each head's mean query, values the mean
value: 0 at step 2000, dev loss 1.41), an 8-layer base (base 0.997; P-tuning train loss 2.1 at step 960,
against 0.7 on the 4-layer base). What the 0.176 run gets wrong: it writes the right relation and often the
right second entity, but the first entity or a state word is recalled from the new relations' pools rather
than copied (密封圈是减振器的零部件 -> 轴承_组成_减振器, 怠速始终忽高忽低 -> 怠速_性能故障_跳变): the prefix
cannot point the base's copy heads, which only ever copied parts and tools, at new kinds of span.
The present design gives the base more kinds of span to copy (stage 1: the other domains' 22 relations
beside its own two, 6 base epochs of the larger set): on it the MLP reparameterisation (--prefix-projection)
at lr 1e-2 reached 0.796 in 20 epochs (0.13, 0.33, 0.63, 0.78, 0.80 at each 1000 steps) and 0.843 in 30
(性能故障 0.934, 组成 0.781; 0.23, 0.41, 0.67, 0.80, 0.84 at each 1500 steps) on a tiny ChatGLM3 base; on a
tiny GLM-4 base (byte-level vocabulary, 8 base epochs; base 1.000 / 0.000) 0.728 in 30 epochs (0.25, 0.38,
0.61, 0.68, 0.73 at each 1500 steps), 0.760 in 45, and at lr 2e-2 it diverged (train loss 1.09 at step 250,
2.29 at step 890); 8,000 new records instead of 4,000 (15 epochs, the same steps) did no better (0.62 at
step 4500 against 0.61). The official settings (no projection, lr 2e-2) learn faster and stay stable: on
the GLM-4 base 0.31, 0.57, 0.75, 0.80, 0.79 at each 1500 steps of 30 epochs (the misses: a state word
written as another of the new relations' pool, 忽高忽低 -> 漂移, 突然升高 -> 漂移), and in 40 epochs (the
flags above) 0.858 (性能故障 0.857, 组成 0.858; 0.43, 0.74, 0.83, 0.85, 0.86 at each 2000 steps;
LoRA 0.994: bench/results/adapt-glm4.json). On the ChatGLM3 base, the same flags: 0.903
(性能故障 0.943, 组成 0.875; 0.55, 0.83, 0.88, 0.89, 0.90 at each 2000 steps; bench/results/adapt-chatglm3.json).
On a tiny GLM-4-0414 base (--version glm4-0414; the same design, 8 base epochs: base 0.991 on its own relations,
0.000 on the new ones): LoRA 0.986 (10 epochs; 0.942 in 3 on a 4-epoch base); P-tuning with the flags above 0.600
in 40 epochs (性能故障 0.602, 组成 0.599; 0.24, 0.47, 0.54, 0.58, 0.60 at each 2000 steps), short of 0.8, where the
GLM-4 base stood at 0.43, 0.74, 0.83, 0.85, 0.86 (bench/results/adapt-glm4-0414.json; its pretraining ran in an
earlier process, so its train_seconds hold the adaptations only). On a 4-epoch base (0.969 on its own relations)
the same flags reached 0.460 in 40 epochs and 0.231 in 20: a better base helps, but the prefix learns at half
GLM-4's pace on this architecture, whose only difference from GLM-4's is a norm after attention and after the MLP
(the prefix there is transformers' Glm4ForCausalLM with the prefix as the first cache entries,
tests/test_glm_transformers_forms.py, 1e-5): those norms bound what the prefix adds to the residual stream. Tried
on the same 8-epoch base: lr 4e-2, 0.690 in 40 epochs (0.35, 0.51, 0.60, 0.69, 0.69 at each 2000 steps: faster than
at 2e-2, but the cosine schedule ends while it still learns); the MLP reparameterisation (--prefix-projection) at lr
1e-2, 0.035 at step 2000 (stopped). In 80 epochs: lr 4e-2 0.829 (性能故障 0.886, 组成 0.789; 0.53, 0.64, 0.78, 0.82,
0.83 at each 4000 steps; 3951 s beside another run), lr 6e-2 0.820 (0.51, 0.64, 0.76, 0.80, 0.82). Hence
VERSION_SETTINGS: GLM-4-0414's P-tuning runs at 4e-2 for 80 epochs (bench/results/adapt-glm4-0414.json); the
mixture-of-experts versions (`--version glm4-moe`, `glm4-moe-lite`: GLM-4-0414's attention without its extra norms,
or latent attention, and routed experts) take the same: on the tiny GLM-4.5 base (8 epochs; 1.000 on its own
relations, 0.000 on the new ones) P-tuning 0.994 (性能故障 0.988, 组成 0.997; stopped at step 4000 and continued
with --resume, so its train_seconds hold the last 16000 steps), LoRA 1.000 (bench/results/adapt-glm4-moe.json). On the
tiny GLM-4.7-Flash base (8 epochs; 1.000 / 0.000; the base's and LoRA's train_seconds include about 45 minutes the
process was stopped for other measurements) LoRA reaches 1.000 and P-tuning v2 0.936 (性能故障 0.907, 组成 0.956; 0.44,
0.71, 0.89, 0.91, 0.94 at each 4000 steps; its train_seconds include ~12 minutes beside the test suite):
bench/results/adapt-glm4-moe-lite.json. Its prefix was at first what latent attention caches, the normed key/value
latent and the rotary key of each entry: 32 + 8 numbers an entry and layer on the tiny preset (the release's 512 + 64),
one latent giving every head's key and value at once. With these settings that prefix learnt far slower: dev F1 0.041,
0.080, 0.101 and 0.122 at steps 4000, 8000, 12000 and 16000 (dev loss 0.90, 0.72, 0.63, 0.59). It wrote the format and
the new relations' names but recalled entities and state words from the new relations' pools instead of copying them
(密封圈 -> 密封, 喉箍 -> 柱塞, 忽高忽低 -> 磨损), or answered nothing, and took 84-98% of the attention of every head of
every layer. Tried, each at step 2000 (dev loss / F1): these settings in 40 epochs 0.97 / 0.023; lr 1.2e-1 1.13 / 0.009;
the MLP reparameterisation at lr 1e-2 1.21 / 0.013; pre_seq_len 32 1.34 / 0.008; pre_seq_len 512 (80 epochs) 0.91 /
0.023. The prefix is now each head's own keys and values (glm/prefix.py: 8 heads x (24 + 16) = 320 numbers an entry and
layer here, zero latents in their place in the cache), of which a prefix of latents is one case (each head's expansion
of them): train loss 0.93 at step 1000 against 1.67, dev loss 0.25 at step 4000 against 0.90, and the F1 above.
--ptuning-epochs, --lora-epochs, --ptuning-lr, --lora-lr: the run length and rate of each adaptation.

    OMP_NUM_THREADS=1 python bench/training/adapt.py [--version chatglm|chatglm3|glm4|glm4-0414|glm4-moe|glm4-moe-lite]
        [--work-dir DIR] [--results FILE]
"""

import argparse
import json
import random
import shutil
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # the repository: chatglm_tune, train.py, bench.<room>.<module>

import train as train_cli  # noqa: E402
from chatglm_tune.data.batches import SpecialIds, collate_train  # noqa: E402
from chatglm_tune.data.records import SPORecord, read_records  # noqa: E402
from chatglm_tune.models import registry  # noqa: E402
from chatglm_tune.models.glm.config import TRANSFORMERS_FORMS  # noqa: E402
from chatglm_tune.options import TINY_DEMO, TINY_PRESETS, EncodingOptions, TrainOptions  # noqa: E402
from chatglm_tune.runs import loading, rundir  # noqa: E402
from chatglm_tune.tuning.training import LengthGroupedSampler, build_tiny, evaluate, optimizer_and_schedule  # noqa: E402

sys.path.insert(0, str(REPO / "data"))
import make_domains  # noqa: E402
import make_spo  # noqa: E402

BASE_RELATIONS = ("部件故障", "检测工具")
NEW_RELATIONS = ("性能故障", "组成")
SEED = 42
COPY_PROMPT = "复述下面的文本。\n文本："  # the pretraining task's instruction (the SPO prompt is another)
COPY_TOKENS = 96  # pretraining rows: at most this many source tokens, and as many of the text repeated
GLOSSARY_EVERY = 10  # pretraining: one row of relation names per this many texts
OTHER_DOMAIN_SEED = 100  # + the domain's index: the other domains' records
MIX_SEED = 5  # the shuffle that mixes them into the base's train file
# The base's recipe: the tiny demo's (train.py --model tiny --tuning full), spelled out for a prepared base
# directory, at the rate and weight decay the results were measured with (the demo has since moved on).
BASE_LR, BASE_WEIGHT_DECAY = 3e-3, 0.01
BASE_FLAGS = ["--tuning", "full", "--batch-size", str(TINY_DEMO["batch_size"]),
              "--lr", str(BASE_LR), "--warmup-ratio", str(TINY_DEMO["warmup_ratio"]),
              "--weight-decay", str(BASE_WEIGHT_DECAY), "--max-src-len", str(TINY_DEMO["max_src_len"]),
              "--max-len", str(TINY_DEMO["max_len"])]
ADAPTATIONS = {
    # Prefix only (the trunk and the tied LM head stay frozen): the official ChatGLM2/3 P-tuning v2 settings
    # (ptuning/train.sh: pre_seq_len 128, no prefix projection, lr 2e-2, 16 rows a step), 40 epochs. On a
    # tiny GLM-4 base they reach 0.858 where the MLP reparameterisation at lr 1e-2 (the earlier flags) reached
    # 0.728 in 30 epochs and 0.760 in 45, and diverged at lr 2e-2 (module docstring). On ChatGLM-6B's base of
    # the earlier design, the MLP at lr 5e-3 did a little better than at 1e-2 (0.923 against 0.904).
    # --grad-accum 1: P-tuning's method default (the official 1 row x 16 accumulated) would make it 16 x 16.
    "ptuning": ["--tuning", "ptuning", "--pre-seq-len", "128", "--lr", "2e-2", "--epochs", "40",
                "--batch-size", "16", "--grad-accum", "1"],
    # Adapters on every block Linear (the version's quantizable Linears: attention and MLP).
    "lora": ["--tuning", "lora", "--lora-r", "16", "--lora-alpha", "32", "--lr", "5e-3", "--epochs", "10",
             "--batch-size", "16"],
}
# Where a version's prefix learns slower than the official settings allow: GLM-4-0414's norms after attention and
# after the MLP bound what the prefix adds to the residual stream, and at lr 2e-2 P-tuning reached 0.600 in 40
# epochs, at 4e-2 in 80 epochs 0.829 (module docstring).
_GLM4_0414_PTUNING = {"ptuning": {"--lr": "4e-2", "--epochs": "80"}}
VERSION_SETTINGS = {"glm4-0414": _GLM4_0414_PTUNING, "glm4-moe": _GLM4_0414_PTUNING,
                    "glm4-moe-lite": _GLM4_0414_PTUNING}
PRESET_OF_VERSION = {version: preset for preset, version in TINY_PRESETS.items()}


def adaptation_setting(name: str, flag: str, version: str) -> str:
    """The value of `flag` ("--lr", "--epochs") of adaptation `name` on a base of `version`."""
    flags = ADAPTATIONS[name]
    return VERSION_SETTINGS.get(version, {}).get(name, {}).get(flag, flags[flags.index(flag) + 1])


def adaptation_flags(name: str, version: str, epochs: int, lr: float) -> list[str]:
    """train.py flags of adaptation `name` on a base of `version`, run `epochs` epochs at `lr`."""
    targets = ["--lora-target", *registry.VERSIONS[version].quantizable_linears] if name == "lora" else []
    return [*ADAPTATIONS[name], *targets, "--epochs", str(epochs), "--lr", str(lr)]


def make_data(work: Path, n_base: int, n_new: int, per_domain: int) -> tuple[dict, list[str]]:
    """The base's files state facts of the base relations only, the adaptation files facts of the new
    relations only; the pretraining corpus (returned as texts) states facts of all four, no dev text.
    With `per_domain`, the base's train file also holds that many records of each other domain
    (make_domains.py), and the corpus as many more of their texts (module docstring, stage 1)."""
    work.mkdir(parents=True, exist_ok=True)
    base_train, base_dev = make_spo.make_splits(n_base, 200, seed=11, relations=BASE_RELATIONS)
    new_train, new_dev = make_spo.make_splits(n_new, 200, seed=21, relations=NEW_RELATIONS)
    corpus = make_spo.generate_records(n_base, seed=31, exclude_texts=frozenset(r.text for r in base_dev + new_dev))
    texts = [r.text for r in corpus]
    if per_domain:
        for i, domain in enumerate(make_domains.DOMAINS.values()):
            drawn = make_domains.generate_records(domain, 2 * per_domain, seed=OTHER_DOMAIN_SEED + i)
            base_train += drawn[:per_domain]
            texts += [r.text for r in drawn[per_domain:]]
        random.Random(MIX_SEED).shuffle(base_train)
    files = {}
    for name, records in (("base_train", base_train), ("base_dev", base_dev), ("new_train", new_train),
                          ("new_dev", new_dev)):
        files[name] = work / f"{name}.jsonl"
        make_spo.write_jsonl(records, files[name])
    return files, texts


def make_init(directory: Path, corpus: list[str], train_file: Path, num_layers: int, version: str) -> Path:
    """A random tiny model of `version` and its tokenizer (what train.py --model tiny[-VERSION] builds), the
    vocabulary trained on the prompt, every relation name, the pretraining corpus, and the base's train
    texts and answers."""
    shutil.rmtree(directory, ignore_errors=True)
    records, _ = read_records(train_file)
    torch.manual_seed(SEED)
    # The block count in the version's config field: the official one, or transformers' for the versions released
    # in transformers' form (GLM-4-0414, GLM-Edge), whose tiny config would keep its 2 layers beside a `num_layers`.
    layers_field = "num_hidden_layers" if version in TRANSFORMERS_FORMS else "num_layers"
    model, tokenizer = build_tiny(records, directory, TrainOptions(tuning="full"), preset=PRESET_OF_VERSION[version],
                                  extra_texts=(COPY_PROMPT, *make_spo.RELATIONS, *corpus), **{layers_field: num_layers})
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def glossary(n: int) -> list[str]:
    """`n` pretraining texts, each naming one to four of the relations in a random order."""
    rng = random.Random(SEED)
    return ["，".join(rng.sample(make_spo.RELATIONS, rng.randint(1, len(make_spo.RELATIONS)))) + "。" for _ in range(n)]


def pretrain(directory: Path, texts: list[str], epochs: int) -> None:
    """Stage 0 (module docstring): teach the random model in `directory` to repeat texts, in place."""
    version = registry.of_directory(directory)
    tokenizer, model = version.load_tokenizer(directory), version.load_model(directory)
    special = SpecialIds.of(tokenizer)
    # The version's own prompt format (as its training rows): COPY_PROMPT + text, answered by the text.
    prompt_tokens = len(version.format.prompt_ids(tokenizer, SPORecord("", None),
                                                  EncodingOptions(prompt=COPY_PROMPT))[0])
    encoding = EncodingOptions(prompt=COPY_PROMPT, max_src_len=prompt_tokens + COPY_TOKENS,
                               max_len=prompt_tokens + 2 * COPY_TOKENS + 4)
    rows = [version.format.training_row(tokenizer, SPORecord(text, None, response=text), encoding) for text in texts]
    batch_size = TINY_DEMO["batch_size"]
    sampler = LengthGroupedSampler([len(r.input_ids) for r in rows], batch_size, seed=SEED)
    loader = torch.utils.data.DataLoader(rows, batch_size=batch_size, sampler=sampler,
                                         collate_fn=lambda batch: collate_train(batch, special))
    total = epochs * len(loader)
    options = TrainOptions(tuning="full", lr=BASE_LR, warmup_ratio=TINY_DEMO["warmup_ratio"],
                           weight_decay=BASE_WEIGHT_DECAY)
    optimizer, scheduler = optimizer_and_schedule(model.parameters(), options, total)
    model.train()
    with tqdm(total=total, desc="pretrain (copy)") as bar:
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            for batch in loader:
                loss = model(**batch).loss
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), options.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
                bar.set_postfix(loss=f"{loss.item():.4f}")
                bar.update()
    model.save_pretrained(directory)


def dev_f1(run_dir: Path, dev_file: Path) -> dict:
    source = loading.resolve_run(run_dir)
    model, tokenizer = loading.load_run(source)
    records, _ = read_records(dev_file)
    with torch.no_grad():  # the prompt and lengths the run was trained with
        scores = evaluate(model, tokenizer, records, TrainOptions(tuning="full", encoding=source.encoding))
    return scores


def earlier_results(args) -> dict:
    """With --reuse-base, the `--results` file's numbers of the same base (version and design), which this
    run's numbers update: an adaptation can be (re)run alone on a base measured before."""
    if not (args.reuse_base and args.results and args.results.exists()):
        return {}
    earlier = json.loads(args.results.read_text())["adapt"]
    same = (earlier.get("version"), earlier.get("other_domain_records", 0)) == (args.version, args.other_domain_records)
    return earlier if same else {}


def run(argv: list[str]) -> float:
    start = time.time()
    if train_cli.main([*argv, "--threads", "1"]) != 0:
        raise SystemExit(f"train.py failed: {' '.join(argv)}")
    return time.time() - start


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", choices=tuple(PRESET_OF_VERSION), default="chatglm",
                        help="the tiny base's version")
    parser.add_argument("--work-dir", type=Path,
                        help="data and runs go here (default /tmp/chatglm_tune_adapt[-VERSION])")
    parser.add_argument("--results", type=Path,
                        help="also write the closing JSON here (e.g. bench/results/adapt-chatglm3.json)")
    parser.add_argument("--base-records", type=int, default=10000,
                        help="train records of the base, and texts of its pretraining corpus")
    parser.add_argument("--new-records", type=int, default=4000, help="train records of the adaptations")
    parser.add_argument("--other-domain-records", type=int, default=1500,
                        help="records of each other domain (make_domains.py) in the base's train file (0: none, the "
                             "earlier design)")
    parser.add_argument("--base-layers", type=int, default=4, help="blocks of the base (the tiny presets have 2 or 3)")
    parser.add_argument("--pretrain-epochs", type=int, default=2, help="epochs of the copy pretraining (0: none)")
    parser.add_argument("--base-epochs", type=int, default=8,
                        help="epochs of the base (bench/results/adapt-chatglm3.json: 6)")
    parser.add_argument("--reuse-base", action="store_true", help="keep a base already trained in the work dir")
    parser.add_argument("--only", nargs="+", choices=tuple(ADAPTATIONS), default=list(ADAPTATIONS))
    parser.add_argument("--resume", action="store_true",
                        help="continue an adaptation stopped midway from its saved state (train.py --resume), with "
                             "--reuse-base")
    for name in ADAPTATIONS:
        parser.add_argument(f"--{name}-epochs", type=int,
                            help=f"epochs of {name} (default: its flags, VERSION_SETTINGS)")
        parser.add_argument(f"--{name}-lr", type=float,
                            help=f"learning rate of {name} (default: its flags, VERSION_SETTINGS)")
    args = parser.parse_args()
    if args.resume and not args.reuse_base:
        parser.error("--resume continues an adaptation of the base already trained: give --reuse-base too")
    return args


def main() -> None:
    args = parse_args()
    epochs = {n: getattr(args, f"{n}_epochs") or int(adaptation_setting(n, "--epochs", args.version))
              for n in args.only}
    lrs = {n: getattr(args, f"{n}_lr") or float(adaptation_setting(n, "--lr", args.version)) for n in args.only}
    torch.set_num_threads(1)
    work = args.work_dir or Path("/tmp/chatglm_tune_adapt" + ("" if args.version == "chatglm" else f"-{args.version}"))
    bench_start = time.time()
    files, corpus = make_data(work, args.base_records, args.new_records, args.other_domain_records)
    earlier, seconds = earlier_results(args), {}

    def write_results(scores: dict) -> str:
        """The JSON line of what is measured so far, written to --results after each stage: a run cut short
        keeps its numbers, and `--reuse-base --only NAME` adds the missing ones."""
        stages = {k: v for k, v in earlier.get("train_seconds", {}).items() if k != "total"} | {
            k: round(v) for k, v in seconds.items()}
        stages["total"] = sum(v for k, v in stages.items() if k != "total")  # training time of every stage
        line = json.dumps({"adapt": earlier | {
            "version": args.version, "other_domain_records": args.other_domain_records,
            "base_epochs": json.loads((work / "base" / "run_args.json").read_text())["epochs"],  # as the base ran
            "adaptation_epochs": earlier.get("adaptation_epochs", {})
            | {n: epochs[n] for n in epochs if seconds.get(n)},
            "adaptation_lr": earlier.get("adaptation_lr", {}) | {n: lrs[n] for n in lrs if seconds.get(n)},
            **{k: round(s["micro"]["f1"], 4) for k, s in scores.items()}, "train_seconds": stages}}, ensure_ascii=False)
        if args.results:
            args.results.write_text(line + "\n")
        return line

    if not (args.reuse_base and (work / "base" / "model.safetensors").exists()):
        shutil.rmtree(work / "base", ignore_errors=True)
        init = make_init(work / "init", corpus, files["base_train"], args.base_layers, args.version)
        started = time.time()
        if args.pretrain_epochs:
            pretrain(init, corpus + glossary(len(corpus) // GLOSSARY_EVERY), args.pretrain_epochs)
        seconds["pretrain"] = time.time() - started
        seconds["base"] = run(["--model", str(init), "--train-file", str(files["base_train"]),
                               "--dev-file", str(files["base_dev"]), "--output-dir", str(work / "base"), *BASE_FLAGS,
                               "--epochs", str(args.base_epochs)])
    scores = {"base_on_base_relations": dev_f1(work / "base", files["base_dev"]),
              "base_on_new_relations": dev_f1(work / "base", files["new_dev"])}
    write_results(scores)
    for name in args.only:
        resume = args.resume and rundir.state_dir(work / name) is not None
        if not resume:
            shutil.rmtree(work / name, ignore_errors=True)
        seconds[name] = run(["--model", str(work / "base"), "--train-file", str(files["new_train"]), "--dev-file",
                             str(files["new_dev"]), "--output-dir", str(work / name), *(["--resume"] if resume else []),
                             *adaptation_flags(name, args.version, epochs[name], lrs[name])])
        scores[f"{name}_on_new_relations"] = dev_f1(work / name, files["new_dev"])
        write_results(scores)

    print(f"\ntiny {args.version} base trained on {'/'.join(BASE_RELATIONS)}, adapted to {'/'.join(NEW_RELATIONS)}"
          " (dev, 200 records)")
    print(f"{'model':34s} {'P':>6s} {'R':>6s} {'F1':>6s} {'train s':>8s}")
    rows = [("base, on its own relations", "base_on_base_relations", "base"),
            ("base, on the new relations", "base_on_new_relations", None)]
    rows += [(f"{name}, on the new relations", f"{name}_on_new_relations", name) for name in args.only]
    for label, key, timed in rows:
        m = scores[key]["micro"]
        took = f"{seconds[timed]:8.0f}" if timed in seconds else f"{'':8s}"
        print(f"{label:34s} {m['precision']:6.3f} {m['recall']:6.3f} {m['f1']:6.3f} {took}")
    for name in args.only:
        per = scores[f"{name}_on_new_relations"]["per_relation"]
        print(f"  {name} per relation: "
              + ", ".join(f"{rel} {per[rel]['f1']:.3f}" for rel in NEW_RELATIONS if rel in per))
    print(f"whole bench: {time.time() - bench_start:.0f} s")
    print(write_results(scores))


if __name__ == "__main__":
    main()
