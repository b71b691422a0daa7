"""The report of bench/scale.py: the summary numbers (the closing JSON), the table (`<results>.md`; ChatGLM-6B's
`scale.md` beside the seed's GPU figures) with the version's targets, and for ChatGLM-6B the bar chart
(`scale.png`), from the results JSON the steps append to. What differs by version comes from its row of
scale_versions.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from scale_children import BITS, GB, INFER, TRAIN
from scale_versions import DEFAULT_VERSION, VERSIONS, BenchVersion

# The decode targets (versions with `decode_targets`); peak RSS targets and the seed's GPU figures
# are in each version's row.
TARGET_OF_BOUND = 0.6  # bf16 and INT8 decode
TARGET_INT4_X_BF16 = 2.0


VARIANT_LABELS = {"e8": "INT8 embedding"}
# '+kr64' -> QuantizedLinear.max_kernel_rows = 64 (an existing class setting)


def _variant_label(suffix: str) -> str:
    """'+e8+mmap64k' -> 'INT8 embedding + MALLOC_MMAP_THRESHOLD_=64 KiB'; '' -> 'as is'."""
    parts = [p for p in suffix.split("+") if p]
    if not parts:
        return "as is"
    def label(p):
        if p in VARIANT_LABELS:
            return VARIANT_LABELS[p]
        if p.startswith("mmap"):
            return f"MALLOC_MMAP_THRESHOLD_={p[4:-1]} KiB"
        if p.startswith("kr"):
            return f"max_kernel_rows={p[2:]}"
        return p

    return " + ".join(label(p) for p in parts)


def _variants(results: dict, step: str) -> list[tuple[str, dict]]:
    """(suffix, record) of `step` as is and of its variants, as-is first."""
    out = [(k[len(step):], v) for k, v in results.items() if k == step or k.startswith(step + "+")]
    return sorted(out, key=lambda kv: (kv[0].count("+"), kv[0]))


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
        complete = [(suf, r) for suf, r in _variants(results, step) if not r.get("partial")]
        return (complete[-1][1], complete[-1][0]) if complete else (None, None)

    def worst(*values):
        values = [v for v in values if v is not None]
        return max(values) if values else None

    infer = {"bf16": ["infer-bf16"], "int8": ["infer-int8-load", "infer-int8-file"], "int4": ["infer-int4-load", "infer-int4-file"]}
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
            out["training_source"][f"{tuning}_{base}"] = _variant_label(suffix) if r else None
        return out

    out = block(lambda step: rec(step, [""]))
    as_is = {}
    for name in TRAIN:
        r = results.get(f"train-{name}")
        if r is not None and r.get("partial"):
            as_is[name.replace("-", "_")] = {k: r.get(k) for k in ("forward_s", "stopped_in", "stopped_after_s", "peak_rss_gb")
                                              if r.get(k) is not None}
            if r.get("step_s") is not None:
                as_is[name.replace("-", "_")]["extrapolated_step_s"] = r["step_s"]
    if as_is:
        out["as_is_training"] = as_is
    best = block(most_changes)
    best["variants"] = {s: _variant_label(most_changes(s)[1]) for s in
                        [*(f"infer-{k}" for k in INFER), *(f"train-{k}" for k in TRAIN)] if most_changes(s)[0] is not None}
    del best["training_source"]
    out["with_options"] = best

    def rounded(d):
        if isinstance(d, dict):
            return {k: rounded(v) for k, v in d.items()}
        return round(d, 3) if isinstance(d, float) else d

    return rounded(out)


def _fmt(v, spec=".2f", none="-"):
    return none if v is None else format(v, spec)


def report(results: dict, out: Path, version: BenchVersion = VERSIONS[DEFAULT_VERSION]) -> None:
    """Write `<stem>.md` (and `<stem>.png` for versions with a chart) into `out`; print the table and the
    closing JSON line `{"<stem>": summary}`."""
    s = summary(results)
    cfg = results.get("_config", {})
    lines = _header(results, cfg, version)
    for note in version.notes:
        lines += ["", note]
    lines += _inference_table(results, version)
    lines += _training_table(results, version, cfg.get("num_layers"))
    lines += _preparation(results)
    if version.targets or version.decode_targets:
        lines += ["", "## Targets (as is)", ""] + [f"- {t}" for t in target_lines(s, version)]
        lines += ["", "## Targets with the measured options (see `code` above)", ""]
        lines += [f"- {t}" for t in target_lines(s["with_options"], version)]
    if version.e8_targets:
        lines += ["", "## Targets with the INT8 embedding / head (`+e8` rows)", ""] + [f"- {t}" for t in e8_target_lines(results, version)]
    if version.fit_steps:
        lines += ["", f"## Fits this machine ({_machine_gb():.1f} GB of memory)", ""] + [f"- {t}" for t in fit_lines(results, version)]
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
               "`bench/checkpoint_writer.py`)" if version.written_bits else "")
    lines.append(f"Config: {cfg.get('num_layers')} layers, hidden {cfg.get('hidden_size')}, vocab {cfg.get('vocab_size')}; "
                 f"random weights{written}. Steps that need the fp16 checkpoint (bf16 / INT8 rows, quantize-*, "
                 "quantized-at-load rows) do not apply and are left out.")
    only = None
    if version.written_bits:
        only = {f"int{version.written_bits}-file"}
    lines += _inference_table(rows, version, only)
    train_only = None if not version.written_bits else {n for n in TRAIN if n.endswith(f"-int{version.written_bits}")}
    decode = [(suffix, r["decode_tok_s"]) for suffix, r in _variants(rows, "infer-int4-file")]
    if decode:
        lines += [""] + [f"Decode ({_variant_label(suffix)}): {1 / tok_s:.2f} s per token." for suffix, tok_s in decode]
    lines += _training_table(rows, version, cfg.get("num_layers"), train_only)
    lines += _partial_lines(rows, cfg.get("num_layers"))
    lines += _preparation(rows)
    if version.fit_steps:
        lines += ["", f"## {version.title} fits this machine ({_machine_gb():.1f} GB of memory)", ""]
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
            text += (f"; the whole step, its backward at {r.get('backward_per_layer_s')} s per layer for {layers} layers, "
                     f"about {r['step_s']:.0f} s: over one command's budget, so time, not memory "
                     f"({r['peak_rss_gb']:.2f} of {_machine_gb():.1f} GB), is what stops it here")
        elif done and per_layer:
            text += (f"; {done}/{layers} layers forward at {per_layer} s each, so about {per_layer * layers:.0f} s for the "
                     "forward alone")
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
            lines.append(f"| {step} | {title} | {r['peak_rss_gb']:.2f} | {_fmt(r.get('load_s'), '.0f')} | "
                         f"{_fmt(decode, '.3f')} | {r.get('forward_s', '-')} | {r.get('step_s', r.get('seconds', '-'))} | "
                         f"{_fmt(disk)} | {r['load_average'][0]} | {r.get('when', '-')} |")
    loads = [[rows[k]["load_average"][0] for k in rows if not k.startswith("_") and ":" not in k and "load_average" in rows[k]]
             for rows in (results, quoted)]
    if all(loads):
        lines += ["", f"Load average (1 min) over all rows: {version.title} {sum(loads[0]) / len(loads[0]):.1f}, "
                  f"{other.title} {sum(loads[1]) / len(loads[1]):.1f} (other jobs on the 2 cores): compare peak RSS "
                  "across the two, not seconds."]
    return lines


def _header(results: dict, cfg: dict, version: BenchVersion) -> list[str]:
    flag = "" if version.name == DEFAULT_VERSION else f" --version {version.name}"
    seed = " The seed's figures are GPU memory of the official code (Table 18-1)." if version.seed_gpu_gb else ""
    lines = [f"# {version.title} at {'a 2-layer slice of ' if cfg.get('quick') else ''}full size on this machine", ""]
    layout = "transformers' own (as released)" if version.layout.startswith("glm4-0414") else "the official"
    lines.append(f"Config: {cfg.get('num_layers')} layers, hidden {cfg.get('hidden_size')}, vocab {cfg.get('vocab_size')}; "
                 f"random fp16 weights (std 0.02) in {layout} sharded layout. Generated by `python bench/scale.py{flag}"
                 f"{' --quick' if cfg.get('quick') else ' --step ...'}` (see its docstring). GB = 1e9 bytes; RSS = peak "
                 "`ru_maxrss` of the whole measuring process, a fresh one per row (Python + torch + transformers baseline, "
                 f"about 0.4 GB, included).{seed}")
    lines.append("")
    any_rec = next((v for k, v in results.items() if not k.startswith("_")), {})
    native = "native bf16 matmul" if any_rec.get("native_bf16_gemm") else "no native bf16 matmul"
    lines.append(f"Machine: {os.cpu_count()} CPUs ({any_rec.get('cpu_capability', '?')}: {native}), torch "
                 f"{any_rec.get('torch', '?')}, {any_rec.get('threads', '?')} torch thread(s) per process; other processes "
                 "share the cores (load average per row), so times vary run to run.")
    lines.append("")
    lines.append("`code`: `as is` = the toolkit's defaults (official formats); `INT8 embedding` = "
                 "`from_pretrained(quantize_embedding=True)` (`--quantize-embedding`: the embedding and head in INT8, "
                 "ChatGLM-6B's tied pair as one copy, the GLM family's untied ones as one each); "
                 "`MALLOC_MMAP_THRESHOLD_` is glibc's setting for the measuring process.")
    return lines


def _target(version: BenchVersion, section: str, kind: str):
    return version.targets.get(section, {}).get(kind, "-")


def _seed(version: BenchVersion, section: str, kind: str):
    return (version.seed_gpu_gb or {}).get(section, {}).get(kind, "-")


def _inference_table(results: dict, version: BenchVersion, only: set | None = None) -> list[str]:
    lines = ["", "## Inference (bf16 compute; batch 1, 64-token prompt, 32 greedy tokens)", "",
             "`-load`: quantized while loading the fp16 checkpoint; `-file`: loaded from the `quantize.py` output. "
             "Bound = copy bandwidth (read + written bytes/s, measured just before) / weight bytes read per token.", "",
             "| variant | code | peak RSS GB | target GB | seed GPU GB | load s | prefill s | decode tok/s | bound tok/s | of bound | GB read/token | copy GB/s | load avg |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name in INFER:
        if only is not None and name not in only:
            continue
        kind = name.split("-")[0]
        target, seed = _target(version, "inference", kind), _seed(version, "inference", kind)
        found = _variants(results, f"infer-{name}")
        if not found:
            lines.append(f"| {name} | | not run | {target} | {seed} |" + " |" * 8)
        for suffix, r in found:
            lines.append(f"| {name} | {_variant_label(suffix)} | {r['peak_rss_gb']:.2f} | {target} | "
                         f"{seed} | {r['load_s']:.0f} | {r['prefill_s']:.1f} | {r['decode_tok_s']:.3f} | "
                         f"{r['bound_tok_s']:.3f} | {r['of_bound']:.0%} | {r['weight_bytes_per_token'] / GB:.2f} | "
                         f"{r['copy_gb_s']:.1f} | {r['load_average'][0]} |")
    return lines


def _training_table(results: dict, version: BenchVersion, layers, only: set | None = None) -> list[str]:
    lines = ["", "## One training step (batch 1 x 256 tokens, 128 labelled; gradient checkpointing; bf16 weights and activations; AdamW)", "",
             "A row stopped at the budget (the 10-minute command limit) shows what was measured before the stop.", "",
             "| step | code | peak RSS GB | target GB | seed GPU GB | load s | forward s | backward s | step s | trainable | load avg |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name in TRAIN:
        if only is not None and name not in only:
            continue
        tuning, base = name.split("-")
        target = _target(version, tuning, base)
        seed = _seed(version, "ptuning", base)  # the seed's figure is for parameter-efficient tuning (P-tuning v2)
        found = _variants(results, f"train-{name}")
        if not found:
            lines.append(f"| {name} | | not run | {target} | {seed} |" + " |" * 6)
        for suffix, r in found:
            if r.get("partial"):
                if r.get("stopped_in") == "backward":
                    bwd = (f"stopped after {r['stopped_after_s'] - r['forward_s']:.0f} s, "
                           f"{r.get('backward_layers_done', 0)}/{layers} layers done")
                else:
                    bwd = "not reached"
                step_s = f"~{r['step_s']} (extrapolated)" if r.get("step_s") is not None else f"> {r.get('stopped_after_s')} (stopped)"
                rss = f"{r['peak_rss_gb']:.2f} (at stop)"
            else:
                bwd, step_s, rss = r["backward_s"], r["step_s"], f"{r['peak_rss_gb']:.2f}"
            lines.append(f"| {name} | {_variant_label(suffix)} | {rss} | {target} | {seed} | {r.get('load_s', '-')} | "
                         f"{r.get('forward_s', '-')} | {bwd} | {step_s} | {r.get('trainable_params', 0):,} | {r['load_average'][0]} |")
    return lines


def _preparation(results: dict) -> list[str]:
    extra = []
    if "write" in results:
        w = results["write"]
        extra.append(f"- write: {w['keys']} tensors, {w['shards']} shards, {w['bytes'] / GB:.2f} GB in {w['seconds']} s, "
                     f"peak RSS {w['peak_rss_gb']:.2f} GB (one shard at a time)")
    for b in (8, 4):
        q = results.get(f"quantize-int{b}")
        if q:
            extra.append(f"- quantize.py --bits {b}: {q['seconds']} s, peak RSS {q['peak_rss_gb']:.2f} GB, {q['disk_gb']:.2f} GB on disk")
    return ["", "## Preparation", "", *extra] if extra else []


def target_lines(s: dict, version: BenchVersion) -> list[str]:
    out = []
    for section, key in (("inference", "inference_rss_gb"), ("ptuning", "ptuning_rss_gb")):
        for b, want in version.targets.get(section, {}).items():
            got = s[key].get(b)
            source = (s.get("training_source") or {}).get("ptuning_" + b) if section == "ptuning" else None
            note = f" ({source})" if source and source != "as is" else ""
            out.append(f"{section} {b} peak RSS {_fmt(got)} GB <= {want}: "
                       + ("not run" if got is None else "met" if got <= want else "MISSED") + note)
    if not version.decode_targets:
        return out
    for b in ("bf16", "int8"):
        got, bound = s["decode_tok_s"].get(b), s["bound_tok_s"].get(b)
        ratio = None if got is None or bound is None else got / bound
        out.append(f"decode {b} {_fmt(ratio, '.0%')} of the bandwidth bound >= {TARGET_OF_BOUND:.0%}: "
                   + ("not run" if ratio is None else "met" if ratio >= TARGET_OF_BOUND else "MISSED"))
    a, b = s["decode_tok_s"].get("int4"), s["decode_tok_s"].get("bf16")
    ratio = None if a is None or b is None else a / b
    out.append(f"decode int4 {_fmt(ratio)}x bf16 >= {TARGET_INT4_X_BF16}x: "
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
            out.append(f"{section} {kind} with the INT8 embedding / head peak RSS {_fmt(worst)} GB <= {want}: "
                       + ("not run" if worst is None else "met" if worst <= want else "MISSED"))
    return out


def fit_lines(results: dict, version: BenchVersion) -> list[str]:
    """Per `version.fit_steps`: whether the step (as is) ran to its end here, with its peak RSS."""
    out = []
    for step in version.fit_steps:
        r = results.get(step)
        variants = [(suffix, v) for suffix, v in _variants(results, step) if suffix]
        if r is None and variants:  # only with options: say which, and how far it got
            suffix, r = variants[-1]
            step = f"{step} ({_variant_label(suffix)}; as is: not run)"
        if r is None:
            out.append(f"{step}: not run")
        elif r.get("partial"):
            out.append(f"{step}: stopped at the budget after {r.get('stopped_after_s')} s ({r.get('stopped_in')}), "
                       f"peak RSS {r['peak_rss_gb']:.2f} GB: MISSED")
        else:
            out.append(f"{step}: ran to the end, peak RSS {r['peak_rss_gb']:.2f} GB: met")
    return out


def _machine_gb() -> float:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:")) / GB


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
        ax.bar([x - w for x in xs], [seed[b] for b in BITS], w, label="seed: official code, GPU memory", color="#bbbbbb")
        ax.bar(xs, [ours.get(b) or 0 for b in BITS], w, color="#3a7bd5",
               label="this toolkit: peak RSS, CPU (defaults)")
        ax.bar([x + w for x in xs], [prop.get(b) or 0 for b in BITS], w, label="with --quantize-embedding", color="#59a14f",
               hatch="//", edgecolor="white")
        for x, b in zip(xs, BITS):
            for dx, v in ((0, ours.get(b)), (w, prop.get(b))):
                if v:
                    ax.text(x + dx, v + 0.2, f"{v:.1f}", ha="center", fontsize=7)
            if target:
                ax.plot([x - 0.5 * w, x + 1.5 * w], [target[b]] * 2, color="#d62728", lw=2, label="target" if x == 0 else None)
        ax.set_xticks(xs, [b.upper() if b != "bf16" else "half (bf16)" for b in BITS])
        ax.set_title(title)
    axes[0].set_ylabel("GB")
    axes[0].legend(fontsize=7, loc="upper right")
    fig.suptitle(f"{version.title}{' (2-layer slice)' if cfg.get('quick') else ''}: memory beside the seed's GPU figures")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
