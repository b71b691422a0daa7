"""Adapting a trained base to relations it never saw: P-tuning v2 and LoRA, on the tiny model.

1. A tiny base is trained from scratch (train.py --model tiny --tuning full) on synthetic records
   of all four relations, annotated with two of them (部件故障, 组成) only.
2. Its dev F1 is measured on records of the two other relations (性能故障, 检测工具).
3. P-tuning v2 (prefix only) and LoRA (adapters on query_key_value) each train on the new relations,
   on top of the frozen base; their dev F1 on the new relations is measured.
Target: each adaptation lifts dev F1 from the base's score to >= 0.8. The last line is JSON.

    python bench/adapt.py [--work-dir /tmp/chatglm_tune_adapt]
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import train as train_cli  # noqa: E402
from chatglm_tune.data import read_records  # noqa: E402
from chatglm_tune.extraction import load_for_inference, resolve_model_source  # noqa: E402
from chatglm_tune.training import TrainOptions, evaluate  # noqa: E402

BASE_RELATIONS = ("部件故障", "组成")
NEW_RELATIONS = ("性能故障", "检测工具")
ADAPTATIONS = {
    "ptuning": ["--tuning", "ptuning", "--pre-seq-len", "16", "--prefix-projection", "--lr", "1e-2", "--epochs", "4",
                "--batch-size", "16"],
    "lora": ["--tuning", "lora", "--lora-r", "16", "--lora-alpha", "32", "--lora-target", "query_key_value",
             "dense_h_to_4h", "dense_4h_to_h", "dense", "--lr", "2e-3", "--epochs", "4", "--batch-size", "16"],
}


def make_data(work: Path) -> dict:
    """Texts of all four relations everywhere; the base's files keep only the base relations' triples,
    the adaptation files only the new ones (a partial annotation: the base has read every kind of text,
    it was just never asked for the new relations)."""
    sys.path.insert(0, str(REPO / "data"))
    import make_spo

    work.mkdir(parents=True, exist_ok=True)
    base_train, base_dev = make_spo.make_splits(10000, 200, seed=11)
    new_train, new_dev = make_spo.make_splits(4000, 200, seed=21)
    files = {}
    for name, records, keep in (("base_train", base_train, BASE_RELATIONS), ("base_dev", base_dev, BASE_RELATIONS),
                                ("new_train", new_train, NEW_RELATIONS), ("new_dev", new_dev, NEW_RELATIONS)):
        kept = [make_spo.GeneratedRecord(r.text, tuple(t for t in r.triples if t[1] in keep)) for r in records]
        files[name] = work / f"{name}.jsonl"
        make_spo.write_jsonl(kept, files[name])
    return files


def dev_f1(run_dir: Path, dev_file: Path) -> float:
    source = resolve_model_source(run_dir)
    model, tokenizer = load_for_inference(source)
    records, _ = read_records(dev_file)
    with torch.no_grad():  # the prompt and lengths the run was trained with
        scores = evaluate(model, tokenizer, records, TrainOptions(tuning="full", encoding=source.encoding))
    return scores["micro"]["f1"]


def run(argv: list[str]) -> float:
    start = time.time()
    if train_cli.main(argv) != 0:
        raise SystemExit(f"train.py failed: {' '.join(argv)}")
    return time.time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/chatglm_tune_adapt"), help="data and runs go here")
    args = parser.parse_args()
    work = args.work_dir
    files = make_data(work)
    results = {}
    seconds = {"base": run(["--model", "tiny", "--tuning", "full", "--train-file", str(files["base_train"]),
                            "--dev-file", str(files["base_dev"]), "--output-dir", str(work / "base")])}
    results["base_on_base_relations"] = dev_f1(work / "base", files["base_dev"])
    results["base_on_new_relations"] = dev_f1(work / "base", files["new_dev"])
    for name, flags in ADAPTATIONS.items():
        seconds[name] = run(["--model", str(work / "base"), "--train-file", str(files["new_train"]),
                             "--dev-file", str(files["new_dev"]), "--output-dir", str(work / name), *flags])
        results[f"{name}_on_new_relations"] = dev_f1(work / name, files["new_dev"])

    print(f"\ntiny base trained on {'/'.join(BASE_RELATIONS)}, adapted to {'/'.join(NEW_RELATIONS)} (dev micro-F1)")
    print(f"{'model':34s} {'dev F1':>7s} {'train s':>8s}")
    print(f"{'base, on its own relations':34s} {results['base_on_base_relations']:7.3f} {seconds['base']:8.0f}")
    print(f"{'base, on the new relations':34s} {results['base_on_new_relations']:7.3f}")
    for name in ADAPTATIONS:
        print(f"{name + ', on the new relations':34s} {results[name + '_on_new_relations']:7.3f} {seconds[name]:8.0f}")
    print(json.dumps({"adapt": {**{k: round(v, 4) for k, v in results.items()},
                                "train_seconds": {k: round(v) for k, v in seconds.items()}}}))


if __name__ == "__main__":
    main()
