"""The memory a model of a bench version takes, from the loader's own accounting: the model `load_glm` builds on the
meta device for an INT checkpoint (`modeling._empty_model`: every block Linear and routed expert an empty INT layer,
the embedding and head INT8 with `quantize_embedding`), its tensors' bytes summed by part. No weight is read or
written, so it gives the full size of a model that does not fit this machine (GLM-4.5-Air: about 60 GB in INT4),
and the same sum for the few-layer copy that is measured (`scale.py --version glm45-air`: `slice_layers`), whose
peak RSS minus its weights is what a process adds to them (Python, torch, the kernels' buffers, a short cache).
"""

from __future__ import annotations

import torch

PARTS = ("embedding", "attention", "routed experts", "shared experts", "routers", "dense MLP", "norms", "head")
GB = 1e9


def part_of(key: str) -> str:
    """Which of PARTS a state_dict key belongs to."""
    if key.startswith("model.embed_tokens."):
        return "embedding"
    if key.startswith("lm_head."):
        return "head"
    if ".mlp.experts." in key:
        return "routed experts"
    if ".mlp.shared_experts." in key:
        return "shared experts"
    if ".mlp.gate." in key:
        return "routers"
    if ".self_attn." in key and not key.endswith("layernorm.weight"):
        return "attention"
    if ".mlp." in key:
        return "dense MLP"
    return "norms"


def accounting(cfg: dict, bits: int, int8_embedding: bool = True) -> dict[str, int]:
    """{part: bytes} of the model `load_glm` builds for config.json `cfg` holding INT`bits` weights (bf16 compute),
    and "KV cache / 1K tokens": what 1024 tokens of its cache take in bf16."""
    from chatglm_tune.models.glm.config import glm_config
    from chatglm_tune.models.glm.modeling import _empty_model
    from chatglm_tune.models.registry import detect

    raw = {k: v for k, v in cfg.items() if k != "quantization_bit"}
    config = glm_config(raw, version=detect(raw))
    model, _ = _empty_model(config, "<accounting>", bits, 0, True, torch.bfloat16 if int8_embedding else None)
    compute = torch.bfloat16.itemsize  # the loader casts float tensors to the compute dtype
    sizes = bytes_by_part(model.state_dict(), float_bytes=compute)
    sizes["KV cache / 1K tokens"] = 1024 * 2 * cache_width(cfg)
    return sizes


def bytes_by_part(state: dict[str, torch.Tensor], float_bytes: int | None = None) -> dict[str, int]:
    """{part: bytes} of a model's state_dict (the P-tuning prefix encoder left out); `float_bytes`: the size counted
    for each float element (the dtype a loader casts to), else each tensor's own."""
    sizes = dict.fromkeys(PARTS, 0)
    for key, tensor in state.items():
        if not key.startswith("prefix_encoder."):
            size = float_bytes if float_bytes and tensor.is_floating_point() else tensor.element_size()
            sizes[part_of(key)] += tensor.numel() * size
    return sizes


def cache_width(cfg: dict) -> int:
    """Values a token keeps in the cache over all layers: keys and values of grouped-query attention, or latent
    attention's normed latent and rotated shared key."""
    layers = cfg["num_hidden_layers"]
    if "kv_lora_rank" in cfg:
        return layers * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return layers * 2 * cfg["num_key_value_heads"] * head_dim


def memory_lines(full: dict[str, int], sliced: dict[str, int], layers: int, total_layers: int,
                 measured_rss_gb: float | None) -> list[str]:
    """The report's table: each part at full size and in the `layers`-layer copy, the weights' sums, and where the
    copy was measured, the full size's peak estimated as its weights plus what the copy's process added."""
    lines = ["", "## Memory, from the loader's accounting (INT4 blocks and experts, INT8 embedding and head)", "",
             f"| part | full size ({total_layers} layers) GB | measured copy ({layers} layers) GB |", "|---|---|---|"]
    for part in (*PARTS, "KV cache / 1K tokens"):
        lines.append(f"| {part} | {full[part] / GB:.2f} | {sliced[part] / GB:.2f} |")
    estimate = memory_estimate(full, sliced, measured_rss_gb)
    lines.append(f"| weights | {estimate['full_weights_gb']:.2f} | {estimate['copy_weights_gb']:.2f} |")
    if measured_rss_gb is not None:
        lines += ["", f"The {layers}-layer copy's measured peak RSS: {measured_rss_gb:.2f} GB, its weights "
                      f"{estimate['copy_weights_gb']:.2f} GB: the process adds {estimate['process_adds_gb']:.2f} GB. "
                      f"The full size would peak near {estimate['full_peak_estimate_gb']:.1f} GB (its weights + that)."]
    return lines


def memory_estimate(full: dict[str, int], sliced: dict[str, int], measured_rss_gb: float | None) -> dict:
    """The closing JSON's numbers: both sizes' weights, and with a measured copy what its process added and the full
    size's estimated peak, GB."""
    full_gb, sliced_gb = (sum(v for k, v in d.items() if k in PARTS) / GB for d in (full, sliced))
    out = {"full_weights_gb": round(full_gb, 2), "copy_weights_gb": round(sliced_gb, 2)}
    if measured_rss_gb is not None:
        out.update(copy_peak_rss_gb=round(measured_rss_gb, 2), process_adds_gb=round(measured_rss_gb - sliced_gb, 2),
                   full_peak_estimate_gb=round(full_gb + measured_rss_gb - sliced_gb, 1))
    return out
