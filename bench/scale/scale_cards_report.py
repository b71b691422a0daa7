"""The report of bench/scale/scale_cards.py: `<stem>.md` from the results JSON its steps write (the accounting, the
measured copy's write and measure), and the closing JSON line. The figures and what they assume are
scale_cards.py's and scale_accounting.py's docstrings; this file only lays them out.
"""

from __future__ import annotations

import json
from pathlib import Path

from bench.common.accounted_versions import EXPERT_LORA, AccountedVersion, sliced_config
from bench.scale.scale_accounting import GB, PARTS
from bench.scale.scale_cards import CARDS, LENGTHS, STATE_BYTES, USABLE, activation_bytes, cache_bytes

FLOAT_KEPT = {  # why a part stays float under INT8 / INT4 (scale_accounting.py's docstring at length)
    "embedding": "bf16 as loaded (`quantize_embedding`: INT8 rows)", "head": "as the embedding",
    "indexer": "its scores choose the 2048 tokens; no gradients", "routers": "choose 8 experts; float32",
    "linear-attention gates": "decay compounds along the sequence; conv, dt_bias, A_log float32",
    "hyper-connections": "mixing weights in float32 (sigmoid, softmax, Sinkhorn)", "norms": "vectors",
}


QUIET_LOAD = 1.5  # a 1-minute load average below this before the measure: the bench's own write step, no other job


def _gb(x: float, spec: str = ".2f") -> str:
    return format(x / GB, spec)


def parts_lines(a: dict) -> list[str]:
    counted, weights = a["parameters"], a["weights_bytes"]
    lines = ["", "## Parameters and weights by part (GB = 1e9 bytes)", "",
             "Parameters: transformers' class on the meta device, equal part for part to the config's formula: "
             f"**{a['formula_equals_model']}**. INT8 / INT4: the official per-row layout (an fp16 scale a row).", "",
             "| part | parameters (B) | bf16 GB | INT8 GB | INT4 GB | under INT8 / INT4 |", "|---|---|---|---|---|---|"]
    for part in PARTS:
        if counted[part]:
            kept = FLOAT_KEPT.get(part, "INT8 / INT4")
            lines.append(f"| {part} | {counted[part] / 1e9:.3f} | {_gb(weights['bf16'][part])} | "
                         f"{_gb(weights['int8'][part])} | {_gb(weights['int4'][part])} | {kept} |")
    total = sum(counted.values())
    lines.append(f"| **total** | **{total / 1e9:.1f}** | **{_gb(sum(weights['bf16'].values()), '.1f')}** | "
                 f"**{_gb(sum(weights['int8'].values()), '.1f')}** | **{_gb(sum(weights['int4'].values()), '.1f')}** "
                 "| |")
    lines += ["", f"Active a token: {a['active_parameters'] / 1e9:.1f} B (all but the routed experts a token does not "
              f"choose; the input embedding counted). INT4 with the embedding and head as INT8 rows: "
              f"{_gb(sum(weights['int4+e8'].values()), '.1f')} GB."]
    return lines


def trainable_lines(a: dict, version: AccountedVersion) -> list[str]:
    pt = a["ptuning_parameters"]
    lines = ["", "## Trainable (the toolkit's defaults)", "",
             f"LoRA targets: {' '.join(version.lora_targets)}; on the routed experts also {' '.join(EXPERT_LORA)} "
             "(peft's `target_parameters`, an adapter per expert; they take no dropout: `--lora-dropout 0`).", "",
             "| tuning | parameters (M) | float32 GB | training state GB (x16: weight, gradient, AdamW's two) |",
             "|---|---|---|---|"]
    for tuning, n in a["trainable_parameters"].items():
        lines.append(f"| {tuning} | {n / 1e6:.1f} | {_gb(4 * n)} | {_gb(STATE_BYTES * n)} |")
    lines += ["", f"P-tuning v2: sparse attention {pt['sparse attention'] / 1e6:.1f} M (each head's key and value a "
              "position and layer)" + (f", linear attention {pt['linear attention'] / 1e6:.1f} M (P virtual keys and "
                                       "values a head, from which each KDA layer's initial state is made)"
                                       if pt["linear attention"] else "") + "."]
    return lines


def sequence_lines(a: dict) -> list[str]:
    lengths = [str(t) for t in LENGTHS]
    head = " | ".join(f"{int(t) // 1024}K GB" for t in lengths)
    lines = ["", "## One sequence: cache (inference) and activations (a training step)", "",
             f"| | {head} |", "|---|" + "---|" * len(lengths)]
    for label, key in (("cache", "cache_bytes"), ("training", "activation_bytes")):
        for kind in a[key][lengths[0]]:
            values = [a[key][t][kind] for t in lengths]
            if any(values):
                lines.append(f"| {label}: {kind} | " + " | ".join(_gb(v) for v in values) + " |")
        lines.append(f"| **{label}** | " + " | ".join(f"**{_gb(sum(a[key][t].values()))}**" for t in lengths) + " |")
    return lines


def fits_lines(a: dict) -> list[str]:
    columns = [f"{card} {t // 1024}K" for t in LENGTHS for card in CARDS]
    lines = ["", "## Cards under FSDP2: the fewest that fit (GB on each), one sequence a card", "",
             f"Planned to {USABLE:.0%} of what a process can allocate: "
             + ", ".join(f"{card} card {cap / 2**30:.0f} GiB" for card, cap in CARDS.items())
             + ". A card: its 1/N of the base, the root unit (embedding, norm, head) gathered, two decoder layers "
             "gathered (the largest counted), its 1/N of the training state, its sequence's activations (above). "
             "`no`: that floor (all but the 1/N shares) is over the plan at any count.", "",
             "| tuning | base | base GB | largest layer GB | " + " | ".join(columns) + " |",
             "|---|---|---|---|" + "---|" * len(columns)]
    for row in a["fits"]:
        cells = []
        for column in columns:
            cell = row["cards"][column]
            cells.append(f"no (floor {cell['floor_gb']:.0f})" if cell["cards"] is None
                         else f"{cell['cards']} ({cell['per_card_gb']:.0f})")
        lines.append(f"| {row['tuning']} | {row['base']} | {row['base_gb']:.0f} | {row['layer_gb']:.1f} | "
                     + " | ".join(cells) + " |")
    return lines


def measured_lines(results: dict, version: AccountedVersion) -> list[str]:
    m, a = results.get("measure"), results["accounting"]
    layers = a["slice"]["layers"]
    lines = ["", f"## Measured: the first {layers} layers on this machine", ""]
    if "write" in results:
        w = results["write"]
        lines.append(f"Written: {w['keys']} tensors, {w['shards']} shards, {_gb(w['bytes'])} GB in {w['seconds']} s "
                     f"(peak RSS {w['peak_rss_gb']:.2f} GB).")
    if m is None:
        return lines + ["", "Not measured yet: `python bench/scale/scale_cards.py --version "
                        f"{version.name} --step write`, then `--step measure`, then `--step report`."]
    cfg = sliced_config(version, layers)
    cache = sum(cache_bytes(version, cfg, m["prefill"]["tokens"]).values())
    weights, accounted = m["weights_bytes"], sum(a["slice"]["weights_bytes"].values())
    kernels = sum(activation_bytes(version, cfg, m["lora"]["tokens"]).values())
    busy = m["load_average"][0]
    where = (f"on a quiet machine (load average {busy} before it)" if busy < QUIET_LOAD else
             f"beside other jobs on the 2 cores (load average {busy}): the seconds are void, the memory is not")
    lines += ["", f"Measured {m['when']} {where}. The toolkit's loader of the released layout (`from_pretrained`), "
              "on transformers' modules and their reference PyTorch paths (no flash-linear-attention or DSA kernels "
              "on a CPU), bf16, 1 thread; each weight copied out of its file as it is read.", "",
              "| row | measured | accounted |", "|---|---|---|",
              f"| weights held | {_gb(weights)} GB | {_gb(accounted)} GB |",
              f"| prefill of {m['prefill']['tokens']} tokens: cache | {m['prefill']['cache_bytes'] / 1e6:.2f} MB | "
              f"{cache / 1e6:.2f} MB |",
              f"| prefill: peak RSS | {m['prefill']['peak_rss_gb']:.2f} GB | weights + cache "
              f"{_gb(weights + cache)} GB |",
              f"| LoRA step on {m['lora']['tokens']} tokens: trainable | {m['lora']['trainable_params']:,} | |",
              f"| LoRA step: peak RSS | {m['lora']['peak_rss_gb']:.2f} GB | weights + activations with kernels "
              f"{_gb(weights + kernels)} GB |",
              f"| the process: peak RSS | {m['peak_rss_gb']:.2f} GB | |",
              "", "Above the accounted figures: the Python / torch baseline (about 0.4 GB) and what the reference "
              "paths hold that kernels do not: the indexer's [tokens x tokens x 32] float32 scores, the attention "
              "probabilities, and in KDA's chunked form [chunks x 64 x 64 x 128] float32 products a head."]
    return lines


def report(results: dict, version: AccountedVersion, out: Path) -> None:
    """Write `<stem>.md` into `out`; print it and the closing JSON line."""
    a = results["accounting"]
    lines = [f"# {version.title} at full size: accounted, and its first {a['slice']['layers']} layers measured", "",
             f"Generated by `python bench/scale/scale_cards.py --version {version.name} --step ...` (its docstring "
             "says what each figure assumes). GB = 1e9 bytes."]
    for note in version.notes:
        lines += ["", note]
    lines += parts_lines(a) + trainable_lines(a, version) + sequence_lines(a) + fits_lines(a)
    lines += measured_lines(results, version)
    summary = {"parameters_b": round(sum(a["parameters"].values()) / 1e9, 2),
               "active_b": round(a["active_parameters"] / 1e9, 2),
               "weights_gb": {k: round(sum(v.values()) / GB, 1) for k, v in a["weights_bytes"].items()},
               "cards": {f"{r['tuning']} / {r['base']}": {k: v["cards"] for k, v in r["cards"].items()}
                         for r in a["fits"]}}
    if "measure" in results:
        m = results["measure"]
        summary["measured"] = {"layers": a["slice"]["layers"], "weights_gb": round(m["weights_bytes"] / GB, 2),
                               "prefill_tokens": m["prefill"]["tokens"], "cache_bytes": m["prefill"]["cache_bytes"],
                               "prefill_peak_rss_gb": round(m["prefill"]["peak_rss_gb"], 2),
                               "lora_tokens": m["lora"]["tokens"],
                               "lora_peak_rss_gb": round(m["lora"]["peak_rss_gb"], 2),
                               "load_average": m["load_average"][0]}
    closing = json.dumps({version.stem: summary})
    text = "\n".join(lines) + "\n"
    (out / f"{version.stem}.md").write_text(text + f"\nThe bench's closing JSON line:\n\n{closing}\n")
    print(text)
    print(closing)
