"""Can transformers' own continuous batching (`generate_batch`, the `ContinuousBatchingManager` behind
`transformers serve`) run the toolkit's models? Tried on tiny random models, side by side with the
toolkit's engine (`chatglm_tune.decoding.engine`, what serve.py runs) on the same prompts:

    python bench/serve/transformers_cb.py      # ~1 minute; results in bench/results/transformers_cb.json

Rows: transformers' plain `GlmForCausalLM` holding GLM-4 weights (what LoRA merged into a base is), the
toolkit's GLM-4 class without and with a P-tuning prefix, with INT4 Linears, and ChatGLM-6B. For each: whether
it runs, whether its greedy ids equal `generate`'s for each prompt alone, and the wall time of 3 prompts x 8
new tokens. The last line is JSON.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: chatglm_tune, bench.<room>.<module>

from transformers import GenerationConfig, GlmForCausalLM  # noqa: E402

from chatglm_tune.data.batches import SpecialIds  # noqa: E402
from chatglm_tune.data.records import SPORecord  # noqa: E402
from chatglm_tune.decoding.engine import Engine, Request  # noqa: E402
from chatglm_tune.decoding.generation import generate  # noqa: E402
from chatglm_tune.models import registry  # noqa: E402
from chatglm_tune.options import EncodingOptions  # noqa: E402
from chatglm_tune.quant.apply import quantize_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
NEW_TOKENS = 8


class _FirstError(logging.Handler):
    """Keeps the first error transformers' continuous batching logs (it logs a failed request, not raises)."""

    def __init__(self):
        super().__init__(logging.ERROR)
        self.message = ""

    def emit(self, record):
        if record.exc_info and not self.message:
            err = record.exc_info[1]
            self.message = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"


def transformers_cb(model, prompts, pad_id) -> tuple[list[list[int]] | None, float, str]:
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=pad_id)
    logger = logging.getLogger("ContinuousBatchingLogger")
    first = _FirstError()
    logger.addHandler(first)
    try:
        return _run_cb(model, prompts, config, first)
    finally:
        logger.removeHandler(first)


def _run_cb(model, prompts, config, first) -> tuple[list[list[int]] | None, float, str]:
    began = time.perf_counter()
    try:
        out = model.generate_batch(inputs=prompts, generation_config=config, progress_bar=False)
    except Exception as err:  # what it raises is the finding
        return None, time.perf_counter() - began, f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
    seconds = time.perf_counter() - began
    ids = [out[key].generated_tokens for key in sorted(out, key=lambda k: int(k.split("_")[-1]))]
    failed = [i for i, got in enumerate(ids) if len(got) != NEW_TOKENS]
    return ids, seconds, f"requests {failed} failed: {first.message}" if failed else ""


def engine_ids(model, tokenizer, prompts) -> tuple[list[list[int]], float]:
    engine = Engine(model, SpecialIds.of(tokenizer), vocab_limit=None)  # every id, as generate_batch
    got = [[] for _ in prompts]
    began = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.submit(Request(prompt, NEW_TOKENS, on_token=got[i].append, on_finish=lambda *a: None, stop_ids=[-1]))
    while engine.running or engine.waiting:
        engine.step()
    return got, time.perf_counter() - began


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2, help="torch threads (default %(default)s)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "transformers_cb.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    logging.getLogger("ContinuousBatchingLogger").propagate = False  # its errors are rows of the table
    texts = [json.loads(line)["text"]
             for line in (ROOT / "data" / "spo_dev.jsonl").read_text(encoding="utf-8").splitlines()[:40]]
    rows = []
    scratch = Path(tempfile.mkdtemp(prefix="transformers-cb-"))  # the tiny models' tokenizer files
    for name in ("glm4", "chatglm"):
        version = registry.VERSIONS[name]
        torch.manual_seed(0)
        model, tokenizer = version.tiny(texts, scratch / name)
        prompts = [tokenizer.prompt_format.prompt_ids(tokenizer, SPORecord(t, None), EncodingOptions())[0]
                   for t in texts[:3]]
        variants = [("toolkit class", model.eval())]
        if name == "glm4":
            plain = GlmForCausalLM(copy.deepcopy(model.config)).eval()  # CB rewrites its model's config
            plain.load_state_dict(model.state_dict(), strict=False)
            torch.manual_seed(0)
            prefixed, _ = version.tiny(texts, scratch / "prefix", pre_seq_len=4)
            int4 = quantize_model(version.tiny(texts, scratch / "int4")[0].eval(), 4,
                                  targets=version.quantizable_linears)
            variants = [("transformers GlmForCausalLM (= LoRA merged)", plain), *variants,
                        ("toolkit class + P-tuning prefix", prefixed.eval()), ("toolkit class, INT4 Linears", int4)]
        for label, m in variants:
            same_weights = model if label.startswith("transformers") else m  # the plain class has no positions hook
            alone = [generate(same_weights, torch.tensor([p]), max_new_tokens=NEW_TOKENS, eos_token_id=None)[0]
                     for p in prompts]
            # the engine first: transformers' batching switches its model to paged attention
            ours, our_seconds = (engine_ids(m, tokenizer, prompts) if not label.startswith("transformers")
                                 else (None, None))
            ids, seconds, error = transformers_cb(m, prompts, tokenizer.pad_token_id)
            rows.append({"model": f"{version.title}: {label}", "runs": ids is not None and not error,
                         "equal_to_alone": ids == alone, "seconds": round(seconds, 2), "error": error,
                         "engine_equal_to_alone": None if ours is None else ours == alone,
                         "engine_seconds": None if our_seconds is None else round(our_seconds, 3)})
    shutil.rmtree(scratch, ignore_errors=True)
    print(f"{'model':58} {'transformers CB':>16} {'equal':>6} {'s':>6} | {'engine equal':>12} {'s':>6}")
    for r in rows:
        engine = ("-" if r["engine_seconds"] is None
                  else f"{str(r['engine_equal_to_alone']):>12} {r['engine_seconds']:6.3f}")
        print(f"{r['model']:58} {'runs' if r['runs'] else 'FAILS':>16} {str(r['equal_to_alone']):>6} "
              f"{r['seconds']:6.2f} | {engine}")
        if r["error"]:
            print(f"    {r['error']}")
    summary = {"threads": args.threads, "new_tokens": NEW_TOKENS, "prompts": 3, "rows": rows,
               "cpu": torch.backends.cpu.get_cpu_capability()}
    args.out.write_text(json.dumps(summary, ensure_ascii=False, indent=2))
    print(json.dumps(summary, ensure_ascii=False))


if __name__ == "__main__":
    main()
