"""The report of bench/scale/scale.py: the summary numbers (the closing JSON), the table (`<results>.md`; ChatGLM-6B's
`scale.md` beside the seed's GPU figures) with the version's targets, and for ChatGLM-6B the bar chart
(`scale.png`), from the results JSON the steps append to. What differs by version comes from its row of
bench/common/scale_versions.py; the tables are scale_tables.py's.
"""

from __future__ import annotations

import json
from pathlib import Path

from bench.common.scale_versions import DEFAULT_VERSION, VERSIONS, BenchVersion
from bench.scale.scale_children import BITS, GB, INFER, TRAIN
from bench.scale.scale_memory import memory_estimate, memory_lines
from bench.scale.scale_tables import (fmt, header_lines, inference_table, machine_gb, preparation_lines, step_variants,
                                      training_table, variant_label)

# The decode targets (versions with `decode_targets`); peak RSS targets and the seed's GPU figures
# are in each version's row.
TARGET_OF_BOUND = 0.6  # bf16 and INT8 decode
TARGET_INT4_X_BF16 = 2.0


def summary(results: dict) -> dict:
    """The closing JSON's numbers (None where a step has not run).

    Top level: the toolkit's defaults (the official formats). Inference RSS for INT8/INT4 is the worse of
    quantized-at-load and loaded-from-file; decode speed is that of the quantize.py file (the deployment
    path). Training: a complete step (partial measurements of a step stopped at the budget under
    `as_is_training`). `with_options`: the same numbers from the runs with the most options measured
    (`--quantize-embedding`, environment settings), the options named under `variants`.
    """
    def rec(step, suffixes):
        for suffix in suffixes:
            r = results.get(step + suffix)
            if r is not None and not r.get("partial"):
                return r, suffix
        return None, None

    def most_changes(step):
        complete = [(suf, r) for suf, r in step_variants(results, step) if not r.get("partial")]
        return (complete[-1][1], complete[-1][0]) if complete else (None, None)

    def worst(*values):
        values = [v for v in values if v is not None]
        return max(values) if values else None

    infer = {"bf16": ["infer-bf16"], "int8": ["infer-int8-load", "infer-int8-file"],
             "int4": ["infer-int4-load", "infer-int4-file"]}
    file_step = {"bf16": "infer-bf16", "int8": "infer-int8-file", "int4": "infer-int4-file"}

    def block(choose) -> dict:
        out = {"inference_rss_gb": {}, "ptuning_rss_gb": {}, "lora_rss_gb": {}, "decode_tok_s": {}, "bound_tok_s": {},
               "step_s": {}, "training_source": {}}
        for kind, steps in infer.items():
            out["inference_rss_gb"][kind] = worst(*((choose(s)[0] or {}).get("peak_rss_gb") for s in steps))
            r = choose(file_step[kind])[0] or {}
            out["decode_tok_s"][kind], out["bound_tok_s"][kind] = r.get("decode_tok_s"), r.get("bound_tok_s")
        for name in TRAIN:
            tuning, base = name.split("-")
            r, suffix = choose(f"train-{name}")
            out[f"{tuning}_rss_gb"][base] = r.get("peak_rss_gb") if r else None
            out["step_s"][f"{tuning}_{base}"] = r.get("step_s") if r else None
            out["training_source"][f"{tuning}_{base}"] = variant_label(suffix) if r else None
        return out

    out = block(lambda step: rec(step, [""]))
    as_is = {}
    for name in TRAIN:
        r = results.get(f"train-{name}")
        if r is not None and r.get("partial"):
            as_is[name.replace("-", "_")] = {k: r.get(k)
                                             for k in ("forward_s", "stopped_in", "stopped_after_s", "peak_rss_gb")
                                              if r.get(k) is not None}
            if r.get("step_s") is not None:
                as_is[name.replace("-", "_")]["extrapolated_step_s"] = r["step_s"]
    if as_is:
        out["as_is_training"] = as_is
    best = block(most_changes)
    best["variants"] = {s: variant_label(most_changes(s)[1]) for s in
                        [*(f"infer-{k}" for k in INFER), *(f"train-{k}" for k in TRAIN)]
                        if most_changes(s)[0] is not None}
    del best["training_source"]
    out["with_options"] = best

    def rounded(d):
        if isinstance(d, dict):
            return {k: rounded(v) for k, v in d.items()}
        return round(d, 3) if isinstance(d, float) else d

    return rounded(out)


def report(results: dict, out: Path, version: BenchVersion = VERSIONS[DEFAULT_VERSION]) -> None:
    """Write `<stem>.md` (and `<stem>.png` for versions with a chart) into `out`; print the table and the
    closing JSON line `{"<stem>": summary}`."""
    s = summary(results)
    cfg = results.get("_config", {})
    lines = header_lines(results, cfg, version)
    for note in version.notes:
        lines += ["", note]
    lines += inference_table(results, version)
    lines += training_table(results, version, cfg.get("num_layers"))
    lines += preparation_lines(results)
    if "memory" in results:
        memory, measured = results["memory"], results.get("infer-int4-file+e8", {}).get("peak_rss_gb")
        lines += memory_lines(memory["full"], memory["sliced"], memory["sliced_layers"],
                              version.shape()["num_layers"], measured)
        s["memory"] = memory_estimate(memory["full"], memory["sliced"], measured)
    if version.targets or version.decode_targets:
        lines += ["", "## Targets (as is)", ""] + [f"- {t}" for t in target_lines(s, version)]
        lines += ["", "## Targets with the measured options (see `code` above)", ""]
        lines += [f"- {t}" for t in target_lines(s["with_options"], version)]
    if version.e8_targets:
        lines += ["", "## Targets with the INT8 embedding / head (`+e8` rows)",
                  ""] + [f"- {t}" for t in e8_target_lines(results, version)]
    if version.fit_steps:
        lines += ["", f"## Fits this machine ({machine_gb():.1f} GB of memory)",
                  ""] + [f"- {t}" for t in fit_lines(results, version)]
    for name in version.companions:
        companion = VERSIONS[name]
        rows = companion_results(results, companion)
        lines += _companion_section(rows, companion)
        s[name.replace("-", "_")] = summary(rows)
    if version.compare_with:
        other = VERSIONS[version.compare_with]
        quoted = out / f"{other.stem}.json"
        if quoted.exists():
            lines += _comparison(results, json.loads(quoted.read_text()), version, other)
    text = "\n".join(lines) + "\n"
    closing = json.dumps({version.stem: s})
    (out / f"{version.stem}.md").write_text(text + f"\nThe bench's closing JSON line:\n\n{closing}\n")
    if version.chart:
        chart(out / f"{version.stem}.png", s, cfg, version)
    print(text)
    print(closing)


def companion_results(results: dict, companion: BenchVersion) -> dict:
    """The records of `companion` (keys under its `results_prefix`) in a shared results file, unprefixed."""
    prefix = companion.results_prefix
    return {k[len(prefix):]: v for k, v in results.items() if k.startswith(prefix)}


def _companion_section(rows: dict, version: BenchVersion) -> list[str]:
    """A version whose rows share this results file: its config, inference and training rows, preparation, and
    whether its steps ran to the end here."""
    cfg = rows.get("_config", {})
    lines = ["", f"# {version.title} (`--version {version.name}`)", ""]
    written = (f" written directly as `quantize.py --bits {version.written_bits}` would write it (no fp16 checkpoint; "
               "`bench/common/checkpoint_writer.py`)" if version.written_bits else "")
    lines.append(f"Config: {cfg.get('num_layers')} layers, hidden {cfg.get('hidden_size')}, vocab "
                 f"{cfg.get('vocab_size')}; random weights{written}. Steps that need the fp16 checkpoint (bf16 / INT8 "
                 "rows, quantize-*, quantized-at-load rows) do not apply and are left out.")
    only = None
    if version.written_bits:
        only = {f"int{version.written_bits}-file"}
    lines += inference_table(rows, version, only)
    train_only = None if not version.written_bits else {n for n in TRAIN if n.endswith(f"-int{version.written_bits}")}
    decode = [(suffix, r["decode_tok_s"]) for suffix, r in step_variants(rows, "infer-int4-file")]
    if decode:
        lines += [""] + [f"Decode ({variant_label(suffix)}): {1 / tok_s:.2f} s per token." for suffix, tok_s in decode]
    lines += training_table(rows, version, cfg.get("num_layers"), train_only)
    lines += _partial_lines(rows, cfg.get("num_layers"))
    lines += preparation_lines(rows)
    if version.fit_steps:
        lines += ["", f"## {version.title} fits this machine ({machine_gb():.1f} GB of memory)", ""]
        lines += [f"- {t}" for t in fit_lines(rows, version)]
    return lines


def _partial_lines(rows: dict, layers) -> list[str]:
    """What a training row stopped at the budget measured, and the forward it implies."""
    out = []
    for key, r in rows.items():
        if not key.startswith("train-") or not r.get("partial"):
            continue
        done, per_layer = r.get("forward_layers_done"), r.get("forward_per_layer_s")
        text = (f"{key}: stopped at the budget {r.get('stopped_after_s')} s into the step ({r.get('stopped_in')}), "
                f"after {r.get('load_s')} s of loading; peak RSS {r['peak_rss_gb']:.2f} GB")
        if r.get("forward_s") is not None:
            text += f"; forward {r['forward_s']} s"
        if r.get("step_s") is not None:
            text += (f"; the whole step, its backward at {r.get('backward_per_layer_s')} s per layer for {layers} "
                     f"layers, about {r['step_s']:.0f} s: over one command's budget, so time, not memory "
                     f"({r['peak_rss_gb']:.2f} of {machine_gb():.1f} GB), is what stops it here")
        elif done and per_layer:
            text += (f"; {done}/{layers} layers forward at {per_layer} s each, so about {per_layer * layers:.0f} s for "
                     "the forward alone")
        out.append(text + ".")
    return ["", *out] if out else []


def _comparison(results: dict, quoted: dict, version: BenchVersion, other: BenchVersion) -> list[str]:
    """`version`'s rows beside `other`'s, quoted from its results file (not rerun)."""
    lines = ["", f"# Beside {other.title} (quoted from `bench/results/{other.stem}.json`, not rerun)", "",
             "| step | model | peak RSS GB | load s | decode tok/s | forward s | step s | disk GB | load avg | when |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for step in ("write", "quantize-int4", "infer-int4-load", "infer-int4-file", "train-ptuning-int4"):
        for title, rows in ((version.title, results), (other.title, quoted)):
            r = rows.get(step)
            if r is None:
                lines.append(f"| {step} | {title} | not run |" + " |" * 7)
                continue
            disk = r.get("disk_gb", r.get("bytes", 0) / GB if "bytes" in r else None)
            decode = r.get("decode_tok_s")
            lines.append(f"| {step} | {title} | {r['peak_rss_gb']:.2f} | {fmt(r.get('load_s'), '.0f')} | "
                         f"{fmt(decode, '.3f')} | {r.get('forward_s', '-')} | {r.get('step_s', r.get('seconds', '-'))} "
                         f"| {fmt(disk)} | {r['load_average'][0]} | {r.get('when', '-')} |")
    loads = [[rows[k]["load_average"][0] for k in rows if not k.startswith("_") and ":" not in k
              and "load_average" in rows[k]]
             for rows in (results, quoted)]
    if all(loads):
        lines += ["", f"Load average (1 min) over all rows: {version.title} {sum(loads[0]) / len(loads[0]):.1f}, "
                  f"{other.title} {sum(loads[1]) / len(loads[1]):.1f} (other jobs on the 2 cores): compare peak RSS "
                  "across the two, not seconds."]
    return lines


def target_lines(s: dict, version: BenchVersion) -> list[str]:
    out = []
    for section, key in (("inference", "inference_rss_gb"), ("ptuning", "ptuning_rss_gb")):
        for b, want in version.targets.get(section, {}).items():
            got = s[key].get(b)
            source = (s.get("training_source") or {}).get("ptuning_" + b) if section == "ptuning" else None
            note = f" ({source})" if source and source != "as is" else ""
            out.append(f"{section} {b} peak RSS {fmt(got)} GB <= {want}: "
                       + ("not run" if got is None else "met" if got <= want else "MISSED") + note)
    if not version.decode_targets:
        return out
    for b in ("bf16", "int8"):
        got, bound = s["decode_tok_s"].get(b), s["bound_tok_s"].get(b)
        ratio = None if got is None or bound is None else got / bound
        out.append(f"decode {b} {fmt(ratio, '.0%')} of the bandwidth bound >= {TARGET_OF_BOUND:.0%}: "
                   + ("not run" if ratio is None else "met" if ratio >= TARGET_OF_BOUND else "MISSED"))
    a, b = s["decode_tok_s"].get("int4"), s["decode_tok_s"].get("bf16")
    ratio = None if a is None or b is None else a / b
    out.append(f"decode int4 {fmt(ratio)}x bf16 >= {TARGET_INT4_X_BF16}x: "
               + ("not run" if ratio is None else "met" if ratio >= TARGET_INT4_X_BF16 else "MISSED"))
    return out


def e8_target_lines(results: dict, version: BenchVersion) -> list[str]:
    """Per `version.e8_targets`: the worst peak RSS of the complete `+e8` rows of that section and kind (inference
    int4: `infer-int4-load+e8...` and `infer-int4-file+e8...`) against its target."""
    out = []
    for section, wanted in version.e8_targets.items():
        for kind, want in wanted.items():
            step = f"infer-{kind}-" if section == "inference" else f"train-{section}-{kind}+"
            got = [r["peak_rss_gb"] for k, r in results.items()
                   if k.startswith(step) and "+e8" in k and not r.get("partial")]
            worst = max(got) if got else None
            out.append(f"{section} {kind} with the INT8 embedding / head peak RSS {fmt(worst)} GB <= {want}: "
                       + ("not run" if worst is None else "met" if worst <= want else "MISSED"))
    return out


def fit_lines(results: dict, version: BenchVersion) -> list[str]:
    """Per `version.fit_steps`: whether the step (as is) ran to its end here, with its peak RSS."""
    out = []
    for step in version.fit_steps:
        r = results.get(step)
        variants = [(suffix, v) for suffix, v in step_variants(results, step) if suffix]
        if r is None and variants:  # only with options: say which, and how far it got
            suffix, r = variants[-1]
            step = f"{step} ({variant_label(suffix)}; as is: not run)"
        if r is None:
            out.append(f"{step}: not run")
        elif r.get("partial"):
            out.append(f"{step}: stopped at the budget after {r.get('stopped_after_s')} s ({r.get('stopped_in')}), "
                       f"peak RSS {r['peak_rss_gb']:.2f} GB: MISSED")
        else:
            out.append(f"{step}: ran to the end, peak RSS {r['peak_rss_gb']:.2f} GB: met")
    return out


def chart(path: Path, s: dict, cfg: dict, version: BenchVersion) -> None:
    """Grouped bars per panel: the seed's GPU figure, our peak RSS as is, and with the measured options."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    best = s.get("with_options", {})
    seed, target = version.seed_gpu_gb, version.targets
    groups = [("inference", "inference_rss_gb", seed["inference"], target["inference"]),
              ("P-tuning v2 step", "ptuning_rss_gb", seed["ptuning"], target["ptuning"]),
              ("LoRA step", "lora_rss_gb", seed["ptuning"], None)]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.6), sharey=True)
    w = 0.27
    for ax, (title, key, seed, target) in zip(axes, groups):
        ours, prop = s[key], best.get(key, {})
        xs = list(range(len(BITS)))
        ax.bar([x - w for x in xs], [seed[b] for b in BITS], w, label="seed: official code, GPU memory",
               color="#bbbbbb")
        ax.bar(xs, [ours.get(b) or 0 for b in BITS], w, color="#3a7bd5",
               label="this toolkit: peak RSS, CPU (defaults)")
        ax.bar([x + w for x in xs], [prop.get(b) or 0 for b in BITS], w, label="with --quantize-embedding",
               color="#59a14f",
               hatch="//", edgecolor="white")
        for x, b in zip(xs, BITS):
            for dx, v in ((0, ours.get(b)), (w, prop.get(b))):
                if v:
                    ax.text(x + dx, v + 0.2, f"{v:.1f}", ha="center", fontsize=7)
            if target:
                ax.plot([x - 0.5 * w, x + 1.5 * w], [target[b]] * 2, color="#d62728", lw=2,
                        label="target" if x == 0 else None)
        ax.set_xticks(xs, [b.upper() if b != "bf16" else "half (bf16)" for b in BITS])
        ax.set_title(title)
    axes[0].set_ylabel("GB")
    axes[0].legend(fontsize=7, loc="upper right")
    fig.suptitle(f"{version.title}{' (2-layer slice)' if cfg.get('quick') else ''}: memory beside the seed's GPU "
                 "figures")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
