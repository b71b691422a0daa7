"""Benchmark: GLM-5 and GLM-5.3-Flash at full size, accounted (no weight read): parameters and weights by part in
bf16 / INT8 / INT4, the trainable sizes of P-tuning v2 and LoRA, a sequence's cache and training activations at 4K
and 32K tokens, and the fewest 80 / 141 GB cards a LoRA or P-tuning run takes under FSDP2 (bf16 and INT4 bases);
then the first few full-size layers written with random weights in the release's layout and measured on this machine.
The versions are bench/common/accounted_versions.py's rows; the counting is bench/scale/scale_accounting.py's.

    python bench/scale/scale_cards.py --version glm5 --step accounting     # seconds, no weights
    python bench/scale/scale_cards.py --version glm5 --step write          # the first 3 layers, ~6 GB in /tmp
    python bench/scale/scale_cards.py --version glm5 --step measure        # load, prefill, a LoRA step (a child)
    python bench/scale/scale_cards.py --version glm5 --step report         # bench/results/scale-glm5.{md,json}
    python bench/scale/scale_cards.py --version glm5 --step clean          # delete the written layers
    (--version glm53-flash: the first 4 layers, ~5 GB; --step all: accounting, write, measure, report)

Cache (inference, one sequence, bf16 as transformers' cache holds it): a sparse-attention layer keeps per token its
normed key/value latent and rotary key (kv_lora_rank + qk_rope_head_dim) and its indexer's key (index_head_dim;
GLM-5.3-Flash's pooled indexer also its gate scores, index_head_dim, and a valid flag: 2 x 128 + 1); a KDA layer
keeps no cache but a state of fixed size: heads x Dk x Dv float32 and the conv's last kernel-size columns of q, k, v
(3 x heads x 128 x 4, bf16).

Training activations (one sequence, bf16, gradient checkpointing per decoder layer, kernels that never hold a
[tokens x tokens] tensor: flash attention, a blockwise indexer, chunked KDA): each layer's input kept (hidden size,
x 4 with GLM-5.3-Flash's hyper-connection streams), plus the layer being recomputed: every intermediate its forward
makes kept once (`recompute_bytes`: an upper estimate; the routed experts' for the 8 chosen a token; KDA's chunk states,
one heads x Dk x Dv float32 state every 64 tokens) and the gradients in and out of its widest one; plus the
loss's chunk (the toolkit's: 4096 labelled positions of float32 logits, their log-softmax and the bf16 head output).

Cards (FSDP2 as configs/fsdp.yaml sets it: one decoder layer a unit, resharded after forward; the base loaded in
bf16, `--dtype bfloat16 --mixed-precision bf16`; one sequence a card): a card holds its 1/N of the base but the
root unit (embedding, final norm, head: gathered from the forward through the backward), the root unit whole, two
decoder layers gathered at once (the one computing and the one prefetched; the largest layer counted), its 1/N of
the trainable state (float32 weights, gradients and AdamW's two moments: 16 bytes a parameter), and its sequence's
activations. An INT4 base: the toolkit holds INT weights as frozen Parameters, which FSDP2 shards as it does any (not
run under FSDP2 here: the tests run float bases). It fits where that is at most 90% of what a process can allocate
on the card (about 78 GiB on an 80 GB H100, 139 GiB on a 141 GB H200), the rest left to the allocator's
fragmentation and the collectives' buffers.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # the repository: chatglm_tune, bench.<room>.<module>

from bench.common.accounted_versions import (EXPERT_LORA, VERSIONS, AccountedVersion, sliced_config,  # noqa: E402
                                             text_config)
from bench.common.measure import RESULTS, run_python  # noqa: E402
from bench.scale import scale_accounting as acc  # noqa: E402
from chatglm_tune.models.loss import CHUNK_TOKENS  # noqa: E402
from chatglm_tune.options import LoraOptions, TrainOptions  # noqa: E402

LENGTHS = (4096, 32768)
CARDS = {"80 GB": 78 * 2**30, "141 GB": 139 * 2**30}  # what a process can allocate on an H100 80 GB / H200 141 GB
USABLE = 0.9  # of it planned for; the rest: allocator fragmentation, the collectives' buffers
STATE_BYTES = 16  # a trainable parameter: float32 weight, gradient, AdamW's two moments
MAX_CARDS = 1024
BF16, FP32 = 2, 4


def cache_bytes(version: AccountedVersion, cfg: dict, tokens: int) -> dict[str, int]:
    """A sequence's cache after `tokens` tokens, by kind (the module docstring)."""
    c = text_config(version, cfg)
    kinds = acc.layer_kinds(c)
    sparse = [i for i, (kda, _) in enumerate(kinds) if not kda]
    indexed = [i for i in sparse if (getattr(c, "indexer_types", None) or ["full"] * len(kinds))[i] == "full"]
    width = c.index_head_dim * 2 + 1 if getattr(c, "index_kpool", None) else c.index_head_dim
    kda = len(kinds) - len(sparse)
    linear = kda and c.linear_num_heads * c.linear_head_dim
    return {"latent keys / values": len(sparse) * tokens * (c.kv_lora_rank + c.qk_rope_head_dim) * BF16,
            "indexer keys": len(indexed) * tokens * width * BF16,
            "KDA states": kda * linear * c.linear_head_dim * FP32 if kda else 0,
            "KDA conv states": kda * 3 * linear * c.linear_conv_kernel_dim * BF16 if kda else 0}


def _layer_items(c, kda: bool, routed: bool) -> list[int]:
    """Bytes a token of each intermediate one decoder layer's forward makes (float32 where the code computes in
    float32; the routed experts' for the experts a token chooses)."""
    h, heads = c.hidden_size, c.num_attention_heads
    streams = getattr(c, "hc_mult", 0)
    items = [h * BF16, h * FP32] * 2  # the two norms: bf16 outputs, float32 inputs
    if streams:  # each sublayer's streams flattened and normed in float32, collapsed, mixed back
        items += [streams * h * FP32, streams * h * FP32, h * BF16, streams * h * BF16] * 2
    else:
        items += [h * BF16] * 2  # the residual sums
    if kda:
        w, d = c.linear_num_heads * c.linear_head_dim, c.linear_head_dim
        # q k v and their conv outputs, normed q k, the gates' low-rank and full outputs, KDA out, gated norm, o_proj
        items += [3 * w * BF16, 3 * w * BF16, 2 * w * BF16, 2 * d * BF16, 2 * w * BF16, w * BF16, w * BF16, h * BF16]
        items += [w * FP32, c.linear_num_heads * FP32, c.linear_num_heads * d * d * FP32 // 64]  # g, beta, states
    else:
        qk, kv = c.qk_nope_head_dim + c.qk_rope_head_dim, c.kv_lora_rank + c.qk_rope_head_dim
        items += [2 * c.q_lora_rank * BF16, heads * qk * BF16, kv * BF16, c.kv_lora_rank * BF16,
                  heads * (c.qk_nope_head_dim + c.v_head_dim) * BF16, 2 * heads * qk * BF16,  # keys, queries
                  heads * c.v_head_dim * BF16, heads * FP32, h * BF16, c.index_topk * 4]  # out, lse, o_proj, chosen
    if routed:
        i, k = c.moe_intermediate_size, c.num_experts_per_tok
        items += [2 * c.n_routed_experts * FP32, k * h * BF16, k * 2 * i * BF16, k * 2 * i * BF16, k * h * BF16,
                  4 * i * c.n_shared_experts * BF16, 2 * h * BF16]
    else:
        items += [2 * c.intermediate_size * BF16, 2 * c.intermediate_size * BF16, h * BF16]
    return items


def recompute_bytes(c, kda: bool, routed: bool, tokens: int) -> int:
    """A decoder layer recomputed for its backward: every intermediate of its forward kept once (an upper estimate:
    a frozen Linear need not keep its input), and the gradient flowing in and out of its widest one."""
    items = _layer_items(c, kda, routed)
    return tokens * (sum(items) + 2 * max(items))


def activation_bytes(version: AccountedVersion, cfg: dict, tokens: int) -> dict[str, int]:
    """A training step's activations for one sequence of `tokens`, by kind (the module docstring)."""
    c = text_config(version, cfg)
    kinds = acc.layer_kinds(c)
    return {"layer inputs kept": len(kinds) * tokens * c.hidden_size * (getattr(c, "hc_mult", 0) or 1) * BF16,
            "the layer recomputed": max(recompute_bytes(c, kda, routed, tokens) for kda, routed in set(kinds)),
            "loss chunk": min(tokens, CHUNK_TOKENS) * c.vocab_size * (BF16 + 2 * FP32)}


def unit_bytes(version: AccountedVersion, cfg: dict, bits: int, table) -> tuple[int, int]:
    """(the root unit's bytes: everything outside the decoder layers, the largest decoder layer's) at INT`bits`."""
    types = getattr(text_config(version, cfg), "layer_types", None)
    layers: dict[int, int] = {}
    root = 0
    for key, shape, fp32 in table:
        part = acc.part_of(key, types)
        size = acc.tensor_bytes(shape, fp32, bits if bits and acc.quantized(key, part) else 0)
        layer = acc.LAYER.search(key)
        if layer:
            layers[int(layer.group(1))] = layers.get(int(layer.group(1)), 0) + size
        else:
            root += size
    return root, max(layers.values())


def per_card(base: int, root: int, layer: int, trainable: int, activations: int, cards: int) -> float:
    """Bytes on each of `cards` cards under FSDP2 (the module docstring)."""
    return (base - root) / cards + root + 2 * layer + trainable * STATE_BYTES / cards + activations


def cards_needed(base: int, root: int, layer: int, trainable: int, activations: int, capacity: int) -> int | None:
    """The fewest cards of `capacity` bytes whose `per_card` fits in USABLE of it; None where none does."""
    for n in range(1, MAX_CARDS + 1):
        if per_card(base, root, layer, trainable, activations, n) <= USABLE * capacity:
            return n
    return None


def trainable_sizes(version: AccountedVersion, cfg: dict, table) -> dict[str, int]:
    """{tuning: trainable parameters} with the toolkit's defaults (pre_seq_len, LoRA rank)."""
    r = LoraOptions().r
    return {f"P-tuning v2 (P {TrainOptions().pre_seq_len})": sum(
                acc.ptuning_elements(version, cfg, TrainOptions().pre_seq_len).values()),
            f"LoRA r {r}, attention": acc.lora_elements(version, cfg, version.lora_targets, r, table),
            f"LoRA r {r}, attention + routed experts": acc.lora_elements(version, cfg,
                                                                         version.lora_targets + EXPERT_LORA, r, table)}


def fits(version: AccountedVersion, cfg: dict, table, trainable: dict[str, int]) -> list[dict]:
    """A row per tuning and base (bf16, INT4): the cards it needs at each length and card size, and why."""
    rows = []
    for bits in (0, 4):
        base = sum(acc.weight_bytes(version, cfg, bits, table=table).values())
        root, layer = unit_bytes(version, cfg, bits, table)
        for tuning, params in trainable.items():
            row = {"tuning": tuning, "base": f"INT{bits}" if bits else "bf16", "base_gb": base / acc.GB,
                   "root_gb": root / acc.GB, "layer_gb": layer / acc.GB, "trainable": params, "cards": {}}
            for tokens in LENGTHS:
                act = sum(activation_bytes(version, cfg, tokens).values())
                for card, capacity in CARDS.items():
                    n = cards_needed(base, root, layer, params, act, capacity)
                    row["cards"][f"{card} {tokens // 1024}K"] = {
                        "cards": n, "per_card_gb": None if n is None else
                        per_card(base, root, layer, params, act, n) / acc.GB,
                        "floor_gb": (root + 2 * layer + act) / acc.GB}
            rows.append(row)
    return rows


def account(version: AccountedVersion) -> dict:
    """The whole accounting of `version` at full size, and of its measured copy's weights and cache."""
    cfg = version.config
    table = acc.tensors(version, cfg)
    counted, formula = acc.parts(version, cfg), acc.formula_parts(version, cfg)
    weights = {f"int{b}" if b else "bf16": acc.weight_bytes(version, cfg, b, table=table) for b in (0, 8, 4)}
    weights["int4+e8"] = acc.weight_bytes(version, cfg, 4, int8_embedding=True, table=table)
    trainable = trainable_sizes(version, cfg, table)
    sliced = version.slice_layers
    return {
        "parameters": counted, "formula_parameters": formula, "formula_equals_model": counted == formula,
        "active_parameters": acc.active_elements(version, cfg, counted), "weights_bytes": weights,
        "ptuning_parameters": acc.ptuning_elements(version, cfg, TrainOptions().pre_seq_len),
        "trainable_parameters": trainable,
        "cache_bytes": {str(t): cache_bytes(version, cfg, t) for t in LENGTHS},
        "activation_bytes": {str(t): activation_bytes(version, cfg, t) for t in LENGTHS},
        "fits": fits(version, cfg, table, trainable),
        "slice": {"layers": sliced, "overrides": version.slice_overrides,
                  "weights_bytes": acc.weight_bytes(version, sliced_config(version, sliced), 0)},
    }


def save(path: Path, name: str, record: dict) -> None:
    results = json.loads(path.read_text()) if path.exists() else {}
    results[name] = record
    path.write_text(json.dumps(results, indent=1))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--version", choices=VERSIONS, required=True)
    p.add_argument("--step", choices=("accounting", "write", "measure", "report", "clean", "all"), required=True)
    p.add_argument("--model-dir", type=Path, help="the measured copy (default /tmp/<slug>-random-<N>l)")
    p.add_argument("--out", type=Path, default=RESULTS, help="results folder (default %(default)s)")
    p.add_argument("--prefill-tokens", type=int, help="measure: the prompt prefilled with a cache (default: the "
                   "row's `measured_tokens`, 4096 for GLM-5, 1024 for GLM-5.3-Flash, whose CPU reference KDA holds "
                   "2 MiB of float32 a token in each of its chunk intermediates)")
    p.add_argument("--train-tokens", type=int, help="measure: the LoRA step's sequence (default: the row's, 4096 "
                   "for GLM-5, 512 for GLM-5.3-Flash)")
    p.add_argument("--threads", type=int, default=1, help="measure: torch threads (default %(default)s)")
    args = p.parse_args(argv)
    version = VERSIONS[args.version]
    prefill_tokens, train_tokens = version.measured_tokens
    model_dir = args.model_dir or Path(f"/tmp/{version.slug}-random-{version.slice_layers}l")
    args.out.mkdir(parents=True, exist_ok=True)
    results = args.out / f"{version.stem}.json"
    for step in (("accounting", "write", "measure", "report") if args.step == "all" else (args.step,)):
        if step == "accounting":
            save(results, "accounting", account(version))
        elif step == "write":
            done = run_python(HERE / "scale_slice.py", "write", "--version", version.name, "--model-dir", model_dir)
            save(results, "write", {**done.last_json(), "seconds": round(done.seconds, 1),
                                    "peak_rss_gb": done.peak_rss / acc.GB})
        elif step == "measure":
            done = run_python(HERE / "scale_slice.py", "measure", "--version", version.name, "--model-dir", model_dir,
                              "--prefill-tokens", args.prefill_tokens or prefill_tokens,
                              "--train-tokens", args.train_tokens or train_tokens,
                              "--threads", args.threads)
            save(results, "measure", {**done.last_json(), "process_s": round(done.seconds, 1),
                                      "peak_rss_gb": done.peak_rss / acc.GB})
        elif step == "report":
            from bench.scale.scale_cards_report import report

            report(json.loads(results.read_text()), version, args.out)
        else:
            shutil.rmtree(model_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
