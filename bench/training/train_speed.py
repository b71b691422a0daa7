"""Seconds per training step on the mid-size config: P-tuning v2 and LoRA, fp32 and bf16 autocast.

The mid-size config (hidden 1024, 8 layers, 16 heads, vocab 130528), batch 4 x 288 tokens, the last
32 positions of each row labelled (an SPO answer), P-tuning `pre_seq_len` 16, LoRA with the library's
`LoraOptions()` (r 8 on query_key_value), AdamW at the tuning's `training.DEFAULT_LR`. Each variant
runs in a fresh process (peak RSS is that process's own, `measure.run`), one warm-up step, then the
median of `--steps` timed steps (forward, backward, AdamW).

"official-style" is the same model with the loss computed as the official code does: fp32 logits of
the 130528-row head at every position, then shifted cross entropy. "ours" runs the head only on the
labelled positions (`labels=` without `logits_to_keep`). Printed side by side; the last line is JSON.

    python bench/training/train_speed.py [--steps 3]
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: chatglm_tune, bench.<room>.<module>

from bench.common.measure import median_seconds, run_python  # noqa: E402

BATCH, SEQ, ANSWER, PRE_SEQ_LEN = 4, 288, 32, 16


def one_variant(tuning: str, precision: str, loss_path: str, steps: int) -> dict:
    import torch
    import torch.nn.functional as F

    from chatglm_tune import ChatGLMConfig, ChatGLMForConditionalGeneration
    from chatglm_tune.options import DEFAULT_LR, TrainOptions
    from chatglm_tune.tuning.training import set_trainable

    torch.manual_seed(0)
    overrides = dict(pre_seq_len=PRE_SEQ_LEN) if tuning == "ptuning" else {}
    config = ChatGLMConfig.from_name("mid", **overrides)
    model = set_trainable(ChatGLMForConditionalGeneration(config), TrainOptions(tuning=tuning))
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=DEFAULT_LR[tuning])
    ids = torch.randint(10, 120000, (BATCH, SEQ))
    ids[:, SEQ - ANSWER - 2] = config.gmask_token_id
    ids[:, SEQ - ANSWER - 1] = config.bos_token_id
    labels = torch.full_like(ids, -100)
    labels[:, SEQ - ANSWER - 1 :] = ids[:, SEQ - ANSWER - 1 :]

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            if loss_path == "ours":
                loss = model(input_ids=ids, labels=labels).loss
            else:  # the official way: every position through the head, fp32 logits, shifted CE
                logits = model(input_ids=ids, logits_to_keep=0).logits.float()
                loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.item()

    return {"step_s": round(median_seconds(step, repeats=steps, warmup=1), 3)}


PRECISIONS = ("fp32", "bf16")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant (default 3)")
    parser.add_argument("--precisions", default=",".join(PRECISIONS),
                        help="comma-separated, of fp32,bf16 (default both; bf16 is slow on CPUs without AVX-512 "
                             "BF16/AMX)")
    parser.add_argument("--variant", nargs=3, help=argparse.SUPPRESS)  # internal: run one variant, print JSON
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(one_variant(*args.variant, args.steps)))
        return
    precisions = args.precisions.split(",")
    results = {}
    for variant in [(t, p, kind) for t in ("ptuning", "lora") for p in precisions
                    for kind in ("official-style", "ours")]:
        done = run_python(__file__, "--steps", args.steps, "--variant", *variant)
        results["/".join(variant)] = {**done.last_json(), "peak_rss_gb": round(done.peak_rss / 2**30, 2)}
        print(f"  {'/'.join(variant):28s} {results['/'.join(variant)]}", file=sys.stderr)
    print(f"\nmid config (hidden 1024, 8 layers, vocab 130528), batch {BATCH} x {SEQ}, {ANSWER} labelled positions per "
          "row")
    print(f"{'tuning':8s} {'precision':9s} {'official-style s/step':>22s} {'ours s/step':>12s} {'speed-up':>9s} "
          f"{'RSS official':>13s} {'RSS ours':>9s}")
    summary = {}
    for tuning in ("ptuning", "lora"):
        for precision in precisions:
            ref, ours = results[f"{tuning}/{precision}/official-style"], results[f"{tuning}/{precision}/ours"]
            speedup = ref["step_s"] / ours["step_s"]
            summary[f"{tuning}_{precision}"] = {"official_style_s": ref["step_s"], "ours_s": ours["step_s"],
                                                "speedup": round(speedup, 2),
                                                "official_style_rss_gb": ref["peak_rss_gb"],
                                                "ours_rss_gb": ours["peak_rss_gb"]}
            print(f"{tuning:8s} {precision:9s} {ref['step_s']:22.2f} {ours['step_s']:12.2f} {speedup:8.2f}x "
                  f"{ref['peak_rss_gb']:12.2f}G {ours['peak_rss_gb']:8.2f}G")
    print(json.dumps({"train_speed": summary}))


if __name__ == "__main__":
    main()
