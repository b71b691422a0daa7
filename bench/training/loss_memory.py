"""Peak memory and seconds of a training loss at GLM-4's vocabulary (151,552 words): transformers' way (fp32 logits of
every position, then the shifted cross entropy) against the toolkit's (`loss.causal_lm_loss`: the output layer on the
labelled positions only, `--chunk-tokens` of them at a time, each chunk's logits recomputed in the backward pass).

The output layer alone (hidden 1024 -> vocabulary, fp32) on random final hidden states of `--rows` x `--length`
tokens, the last `--labelled` share of each row labelled (an answer after its prompt): one forward and backward per
variant, each in a fresh process (its peak RSS is its own); the two losses and hidden-state gradients compared.
Printed side by side; the last line is JSON.

    python bench/training/loss_memory.py [--rows 4 --length 1024 --labelled 0.5]
        [--results bench/results/loss_memory.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: chatglm_tune, bench.<room>.<module>

from bench.common.measure import run_python  # noqa: E402

VOCAB, HIDDEN = 151_552, 1024


def one_variant(args) -> dict:
    import time

    import torch
    import torch.nn.functional as F

    from chatglm_tune.models.loss import causal_lm_loss

    torch.manual_seed(0)
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    hidden = torch.randn(args.rows, args.length, HIDDEN, requires_grad=True)
    labels = torch.randint(0, VOCAB, (args.rows, args.length))
    labels[:, : int(args.length * (1 - args.labelled))] = -100
    start = time.perf_counter()
    if args.variant == "transformers":
        logits = head(hidden).float()
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))
    else:
        loss = causal_lm_loss(head, hidden, labels, chunk_tokens=args.chunk_tokens[0])
    loss.backward()
    return {"seconds": round(time.perf_counter() - start, 2), "loss": loss.item(),
            "grad_sum": hidden.grad.double().abs().sum().item()}


def main(argv=None) -> None:
    from chatglm_tune.models.loss import CHUNK_TOKENS

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--labelled", type=float, default=0.5, help="share of each row labelled (its end)")
    p.add_argument("--chunk-tokens", type=int, nargs="+", default=[CHUNK_TOKENS, 512],
                   help="the toolkit's chunk sizes to measure (the first is the library's default)")
    p.add_argument("--results", type=Path, help="also write the closing JSON here")
    p.add_argument("--variant", help=argparse.SUPPRESS)  # internal: one measurement, printed as JSON
    args = p.parse_args(argv)
    if args.variant:
        print(json.dumps(one_variant(args)))
        return
    shape = ["--rows", args.rows, "--length", args.length, "--labelled", args.labelled]
    rows = {}
    for variant, chunk in [("transformers", 0)] + [("toolkit", c) for c in args.chunk_tokens]:
        done = run_python(__file__, *shape, "--variant", variant, "--chunk-tokens", max(chunk, 1))
        name = variant if variant == "transformers" else f"toolkit, chunks of {chunk}"
        rows[name] = {**done.last_json(), "peak_rss_gb": round(done.peak_rss / 2**30, 2)}
    base = rows["transformers"]
    print(f"\nloss of {args.rows} x {args.length} tokens ({args.labelled:.0%} labelled), hidden {HIDDEN} -> vocabulary "
          f"{VOCAB}")
    print(f"{'variant':28s} {'peak RSS GB':>11s} {'seconds':>8s} {'loss':>9s} {'|grad| sum':>12s}")
    for name, r in rows.items():
        print(f"{name:28s} {r['peak_rss_gb']:11.2f} {r['seconds']:8.2f} {r['loss']:9.5f} {r['grad_sum']:12.2f}")
    same = all(abs(r["loss"] - base["loss"]) < 1e-4 and abs(r["grad_sum"] / base["grad_sum"] - 1) < 1e-4
               for r in rows.values())
    print(f"losses and gradients equal: {same}")
    line = json.dumps({"loss_memory": {"rows": args.rows, "length": args.length, "labelled": args.labelled,
                                       "vocab": VOCAB, "variants": rows, "equal": same}})
    if args.results:
        args.results.write_text(line + "\n", encoding="utf-8")
    print(line)


if __name__ == "__main__":
    main()
