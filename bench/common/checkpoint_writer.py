"""A random-weight checkpoint in a version's official layout, written shard by shard (bench/scale/scale.py's
`write` step).

    python bench/common/checkpoint_writer.py DIR [--version {chatglm,chatglm3,glm4,glm4-0414,glm4-0414-32b}]
        [--num-layers N] [--shards M]

Prints a JSON line. The version's row of bench/common/scale_versions.py gives the config and the shard count.

ChatGLM-6B (`chatglm`, the default): the keys, shapes and order are those of the library's model (its
`state_dict`, built on the meta device: no memory), plus what the official files hold beyond it:
`lm_head.weight` stored (equal to the embedding, as the tied head is) and each layer's
`attention.rotary_emb.inv_freq` buffer, after `attention.dense.bias` as in the official key order. fp16
`pytorch_model-0000N-of-0000M.bin` shards (M = 8 at full size), `pytorch_model.bin.index.json`.
ChatGLM3-6B / GLM-4-9B (`glm_tensors`): the official `modeling_chatglm.py` state dict, in its order:
`transformer.embedding.word_embeddings.weight`, `transformer.rotary_pos_emb.inv_freq`, per layer
`transformer.encoder.layers.N.{input_layernorm.weight, self_attention.query_key_value.{weight,bias},
self_attention.dense.weight, post_attention_layernorm.weight, mlp.dense_h_to_4h.weight,
mlp.dense_4h_to_h.weight}`, `transformer.encoder.final_layernorm.weight`, `transformer.output_layer.weight`
(untied); checked against the toolkit's key map (models.glm.weights.to_official of its meta-device model). fp16
`model-0000N-of-0000M.safetensors` shards (7 / 10 at full size), `model.safetensors.index.json`, and the
real tokenizer files copied beside them.

GLM-4-0414 (`transformers_tensors`, released in transformers' own form): the state dict of the toolkit's
meta-device `Glm4ForCausalLM` under transformers' key names, in its order (`model.embed_tokens.weight`, per layer
`model.layers.N.{self_attn.{q,k,v}_proj.{weight,bias}, self_attn.o_proj.weight, mlp.gate_up_proj.weight,
mlp.down_proj.weight, input_layernorm.weight, post_attention_layernorm.weight, post_self_attn_layernorm.weight,
post_mlp_layernorm.weight}`, `model.norm.weight`, `lm_head.weight`), the prefix encoder aside; fp16
safetensors shards and the tokenizer as released: a `tokenizer.json` (GLM-4's BPE, converted from the shared
assets' rank file) and a tokenizer_config.json with the chat template. GLM-4-32B-0414 (`glm4-0414-int4`):
the same keys as `quantize.py --bits 4` writes them (`transformers_int4_tensors`): each block Linear as its
packed INT4 `weight` (int8 [out, in/2]) and fp16 per-row `weight_scale` [out], everything else fp16; the
nibbles are drawn (from a table of 16 equally likely values, the quantiles of the quantized N(0, 0.02)) so that
`weight_scale * q` has about the spread of the std-0.02 fp16 weights, and every row's scale is that of such a
row (absmax / 7 = 0.02 * sqrt(2 ln in) / 7): the INT4 file of a random fp16 checkpoint, without the 65 GB
checkpoint.

Both: config.json; LayerNorm / RMSNorm weights are ones and biases of LayerNorms zeros; every other
tensor is drawn N(0, 0.02) directly in fp16 from a generator seeded by its key, so at most one shard is
in memory and the same config always gives the same bytes.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import shutil
import sys
import zlib
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: chatglm_tune, bench.<room>.<module>

from chatglm_tune import ChatGLMConfig, ChatGLMForConditionalGeneration  # noqa: E402
from bench.common.scale_versions import DEFAULT_VERSION, VERSIONS  # noqa: E402

STD = 0.02
INV_FREQ_AFTER = ".attention.dense.bias"  # the official files keep the rotary buffer after this key


def official_tensors(config: ChatGLMConfig) -> list[tuple[str, tuple[int, ...], str]]:
    """(key, shape, init) of every tensor the official checkpoint holds, in its order. init: "ones",
    "zeros", "inv_freq", or the key whose random values it takes (the tied head takes the embedding's)."""
    with torch.device("meta"):
        model = ChatGLMForConditionalGeneration(config)
    first_name = {}  # a tied parameter is drawn once, under the first name it has
    for name, param in model.named_parameters(remove_duplicate=False):
        first_name.setdefault(id(param), name)
    layer_norms = {name for name, module in model.named_modules() if isinstance(module, torch.nn.LayerNorm)}
    params = dict(model.named_parameters(remove_duplicate=False))
    rot = config.head_dim // 2  # each half of a head is rotated by one of the two positions
    out = []
    for key, tensor in model.state_dict(keep_vars=True).items():
        owner, leaf = key.rsplit(".", 1)
        if owner in layer_norms:
            init = "ones" if leaf == "weight" else "zeros"
        else:
            init = first_name[id(params[key])]
        out.append((key, tuple(tensor.shape), init))
        if key.endswith(INV_FREQ_AFTER):
            out.append((key[: -len(INV_FREQ_AFTER)] + ".attention.rotary_emb.inv_freq", (rot // 2,), "inv_freq"))
    return out


def glm_tensors(raw: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """(key, shape, init) of every tensor of an official ChatGLM2/3 / GLM-4 checkpoint of config.json `raw`,
    in the official state-dict order (NH heads, G groups, D = kv_channels; init as `official_tensors`)."""
    h, d, g, nh = raw["hidden_size"], raw["kv_channels"], raw["multi_query_group_num"], raw["num_attention_heads"]
    ffn, vocab, qkv = raw["ffn_hidden_size"], raw["padded_vocab_size"], (raw["num_attention_heads"] + 2 * g) * d
    out = [("transformer.embedding.word_embeddings.weight", (vocab, h), None),
           ("transformer.rotary_pos_emb.inv_freq", (d // 4,), "inv_freq")]  # rotary on D/2 dims, one per pair
    for n in range(raw["num_layers"]):
        layer = f"transformer.encoder.layers.{n}."
        out += [(layer + "input_layernorm.weight", (h,), "ones"),
                (layer + "self_attention.query_key_value.weight", (qkv, h), None),
                (layer + "self_attention.query_key_value.bias", (qkv,), None),
                (layer + "self_attention.dense.weight", (h, nh * d), None),
                (layer + "post_attention_layernorm.weight", (h,), "ones"),
                (layer + "mlp.dense_h_to_4h.weight", (2 * ffn, h), None),
                (layer + "mlp.dense_4h_to_h.weight", (h, ffn), None)]
    out += [("transformer.encoder.final_layernorm.weight", (h,), "ones"),
            ("transformer.output_layer.weight", (vocab, h), None)]
    out = [(key, shape, init or key) for key, shape, init in out]
    _check_against_toolkit(raw, out)
    return out


def _check_against_toolkit(raw: dict, tensors) -> None:
    """AssertionError unless `tensors` are the official keys and shapes of the toolkit's model for `raw`
    (its meta-device state dict through `models.glm.weights.to_official`), the unused inv_freq buffer aside."""
    from chatglm_tune.models.glm.config import glm_config
    from chatglm_tune.models.glm.modeling import GlmForCausalLMWithPrefix
    from chatglm_tune.models.glm.weights import IGNORED, to_official
    from chatglm_tune.models.registry import detect

    with torch.device("meta"):
        model = GlmForCausalLMWithPrefix(glm_config(raw, version=detect(raw)))
    theirs = {k: tuple(v.shape) for k, v in to_official(model.state_dict()).items()}
    ours = {k: shape for k, shape, _ in tensors if not IGNORED.match(k)}
    assert ours == theirs, (sorted(set(ours) ^ set(theirs)), [k for k in ours if ours[k] != theirs.get(k)])


def _meta_glm(raw: dict):
    from chatglm_tune.models.glm.config import glm_config
    from chatglm_tune.models.glm.modeling import model_class
    from chatglm_tune.models.registry import detect

    raw = {k: v for k, v in raw.items() if k != "quantization_bit"}
    version = detect(raw)
    with torch.device("meta"):
        return model_class(version)(glm_config(raw, version=version))


def transformers_tensors(raw: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """(key, shape, init) of a checkpoint in transformers' own form (GLM-4-0414: `Glm4ForCausalLM`) of config.json
    `raw`: the toolkit's meta-device model's state dict, in its order (the keys its loader reads), without the
    P-tuning prefix encoder; RMSNorm weights ones."""
    model = _meta_glm(raw)
    out = []
    for key, tensor in model.state_dict().items():
        if key.startswith("prefix_encoder."):
            continue
        out.append((key, tuple(tensor.shape), "ones" if key.endswith("norm.weight") else key))
    return out


def transformers_int4_tensors(raw: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """`transformers_tensors` as `quantize.py --bits 4` writes them: each block Linear's weight [out, in] as
    `weight` int8 [out, in/2] (init "int4:<key>") and `weight_scale` fp16 [out] (init "scale:<in>")."""
    from chatglm_tune.models.glm.config import QUANTIZABLE_LINEARS

    out = []
    for key, shape, init in transformers_tensors(raw):
        owner, _, leaf = key.rpartition(".")
        if leaf == "weight" and owner.rpartition(".")[2] in QUANTIZABLE_LINEARS and ".layers." in key:
            out += [(key, (shape[0], shape[1] // 2), "int4:" + key),
                    (owner + ".weight_scale", (shape[0],), f"scale:{shape[1]}")]
        else:
            out.append((key, shape, init))
    return out


def quantized_tensors(raw: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """(key, shape, init) of what `quantize.py --bits 4` writes for config.json `raw` (a mixture-of-experts version:
    the toolkit's meta-device model with its block Linears and routed experts swapped for INT4 layers, each expert
    under the released per-expert keys): packed `weight` int8 (init "int4:<key>") and fp16 `weight_scale`
    ("scale:<in>") of every swapped Linear; norms ones, routers' score corrections zeros, the rest random fp16."""
    from chatglm_tune.models.glm.config import quantizable_linears
    from chatglm_tune.quant.apply import quantize_model
    from chatglm_tune.quant.experts import quantize_experts
    from chatglm_tune.quant.modules import QuantizedLinear

    model = _meta_glm(raw)
    quantize_model(model, 4, 0, targets=quantizable_linears(model.config.chatglm_version), empty_init=True)
    quantize_experts(model, 4, 0, empty_init=True)
    inputs = {f"{name}.weight_scale": str(m.in_features) for name, m in model.named_modules()
              if isinstance(m, QuantizedLinear)}
    out = []
    for key, tensor in model.state_dict().items():
        if key.startswith("prefix_encoder."):
            continue
        if key in inputs:
            init = "scale:" + inputs[key]
        elif tensor.dtype == torch.int8:
            init = "int4:" + key
        else:
            init = ("ones" if key.endswith("norm.weight") else "zeros"
                    if key.endswith("e_score_correction_bias") else key)
        out.append((key, tuple(tensor.shape), init))
    return out


def _int4_table() -> torch.Tensor:
    """256 packed bytes: byte b holds (Q[b >> 4], Q[b & 15]) in the official nibble order, where Q are the 16
    quantiles (midpoints of 16 equal-probability bins) of N(0, 0.02) / scale rounded to [-7, 7], scale = 0.02 *
    sqrt(2 ln 4096) / 7 (the order of every width here)."""
    from chatglm_tune.quant.format import pack_int4

    sigma = 7 / math.sqrt(2 * math.log(4096))
    probs = (torch.arange(16, dtype=torch.float64) + 0.5) / 16
    q = (torch.erfinv(2 * probs - 1) * math.sqrt(2) * sigma).round().clamp(-7, 7).to(torch.int8)
    pairs = torch.stack((q.repeat_interleave(16), q.repeat(16)), dim=1)  # (256, 2): b >> 4, b & 15
    return pack_int4(pairs).view(256)


@functools.cache
def _int4_pool() -> torch.Tensor:
    """64 MiB of packed INT4 bytes drawn independently from `_int4_table` (seeded): what INT4 tensors are cut from."""
    g = torch.Generator().manual_seed(0)
    return _int4_table()[torch.randint(0, 256, (1 << 26,), dtype=torch.uint8, generator=g).long()]


def make_tensor(shape: tuple[int, ...], init: str) -> torch.Tensor:
    """The tensor of one entry of `official_tensors` / `transformers_tensors` (fp16; INT4 entries int8)."""
    if init.startswith("int4:"):  # 1 MiB runs of the pool at offsets drawn per key: written at copy speed
        g, pool = torch.Generator().manual_seed(zlib.crc32(init.encode())), _int4_pool()
        out = torch.empty(shape, dtype=torch.int8)
        flat, step = out.view(-1), 1 << 20
        offsets = torch.randint(0, pool.numel() - step, (-(-flat.numel() // step),), generator=g).tolist()
        for start, offset in zip(range(0, flat.numel(), step), offsets):
            n = min(step, flat.numel() - start)
            flat[start : start + n] = pool[offset : offset + n]
        return out
    if init.startswith("scale:"):
        return torch.full(shape, STD * math.sqrt(2 * math.log(int(init[6:]))) / 7, dtype=torch.float16)
    if init == "ones":
        return torch.ones(shape, dtype=torch.float16)
    if init == "zeros":
        return torch.zeros(shape, dtype=torch.float16)
    if init == "inv_freq":
        rot = 2 * shape[0]
        return (1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))).half()
    g = torch.Generator().manual_seed(zlib.crc32(init.encode()))
    return torch.empty(shape, dtype=torch.float16).normal_(0.0, STD, generator=g)


def shard_plan(tensors, n_shards: int) -> list[list[int]]:
    """Contiguous groups of tensor indices: n_shards - 1 groups of about equal bytes, then the rest with
    the last tensor (the head: `lm_head.weight` / `transformer.output_layer.weight`, alone in the official
    last shard but for the final LayerNorm).
    Every group non-empty."""
    sizes = [(1 if init.startswith("int4:") else 2) * torch.Size(shape).numel() for _, shape, init in tensors]
    body = list(range(len(tensors) - 1))  # all but lm_head
    groups, i = [], 0
    for shard in range(n_shards - 1):
        left = n_shards - 1 - shard  # groups still to fill, this one included
        target = sum(sizes[j] for j in body[i:]) / left
        group, size = [], 0
        while i < len(body) and len(body) - i > left - 1:  # leave one key for each later group
            if group and size + sizes[body[i]] > target:
                break
            group.append(body[i])
            size += sizes[body[i]]
            i += 1
        groups.append(group)
    groups.append(body[i:] + [len(tensors) - 1])
    assert all(groups) and sum(map(len, groups)) == len(tensors)
    return groups


def _save_bin(shard: dict, path: Path) -> None:
    torch.save(shard, path)


def _save_safetensors(shard: dict, path: Path) -> None:
    from safetensors.torch import save_file

    save_file(shard, str(path), metadata={"format": "pt"})


# layout -> (tensors of a config.json dict, shard name pattern, index file, how a shard is written)
LAYOUTS = {
    "chatglm6b": (lambda cfg: official_tensors(ChatGLMConfig.from_name("chatglm-6b", num_layers=cfg["num_layers"])),
                  "pytorch_model-{:05d}-of-{:05d}.bin", "pytorch_model.bin.index.json", _save_bin),
    "glm": (glm_tensors, "model-{:05d}-of-{:05d}.safetensors", "model.safetensors.index.json", _save_safetensors),
    "glm4-0414": (transformers_tensors, "model-{:05d}-of-{:05d}.safetensors", "model.safetensors.index.json",
                  _save_safetensors),
    "glm4-0414-int4": (transformers_int4_tensors, "model-{:05d}-of-{:05d}.safetensors", "model.safetensors.index.json",
                       _save_safetensors),
    "moe-int4": (quantized_tensors, "model-{:05d}-of-{:05d}.safetensors", "model.safetensors.index.json",
                 _save_safetensors),
}


def write_released_tokenizer(assets: Path, directory: Path, version: str = "glm4-0414") -> None:
    """A version's tokenizer files as released (GLM-4-0414's, GLM-4.7-Flash's): `tokenizer.json` (GLM-4's BPE from the
    rank file in `assets`) and a tokenizer_config.json for transformers' `PreTrainedTokenizerFast` with the chat
    template."""
    from chatglm_tune.models.glm.glm4_tokenizer import EOS_TOKEN, RELEASED_CHAT_TEMPLATES, load_glm4_tokenizer

    load_glm4_tokenizer(assets).save_vocabulary(str(directory))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": RELEASED_CHAT_TEMPLATES[version],
              "clean_up_tokenization_spaces": False, "eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN,
              "padding_side": "left", "do_lower_case": False, "remove_space": False,
              "model_input_names": ["input_ids", "attention_mask"], "model_max_length": 128000}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=2), encoding="utf-8")


def write_checkpoint(directory: Path, version, n_shards: int, num_layers: int | None = None) -> dict:
    """Write the checkpoint of `version` (a `scale_versions.BenchVersion`; full size, or its first
    `num_layers` layers) into `directory` (replaced if it exists); {"keys", "shards", "bytes"}."""
    tokenizer_dir = version.tokenizer_dir()  # before anything is written: fails if absent
    cfg = version.config_json(num_layers)
    list_tensors, pattern, index_name, save = LAYOUTS[version.layout]
    tensors = list_tensors(cfg)
    if directory.exists():
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    plan = shard_plan(tensors, n_shards)
    weight_map, total = {}, 0
    for s, group in enumerate(plan, 1):
        name = pattern.format(s, len(plan))
        shard = {tensors[j][0]: make_tensor(*tensors[j][1:]) for j in group}
        save(shard, directory / name)
        total += sum(t.numel() * t.element_size() for t in shard.values())
        weight_map.update(dict.fromkeys(shard, name))
        del shard
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / index_name).write_text(json.dumps(index, indent=2))
    (directory / "config.json").write_text(json.dumps(cfg, indent=2))
    if tokenizer_dir is not None and version.tokenizer_json:
        from chatglm_tune.models.registry import detect

        write_released_tokenizer(tokenizer_dir, directory, detect(cfg))
    elif tokenizer_dir is not None:
        for file in tokenizer_dir.iterdir():
            if file.is_file():
                shutil.copyfile(file, directory / file.name)
    return {"keys": len(tensors), "shards": len(plan), "bytes": total}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("directory", type=Path, help="where the checkpoint goes (replaced if it exists)")
    p.add_argument("--version", choices=VERSIONS, default=DEFAULT_VERSION, help="which model (default %(default)s)")
    p.add_argument("--num-layers", type=int, help="layers (default: the version's full size)")
    p.add_argument("--shards", type=int, help="weight files (default: as many as the official checkpoint's)")
    args = p.parse_args(argv)
    version = VERSIONS[args.version]
    print(json.dumps(write_checkpoint(args.directory, version, args.shards or version.shards, args.num_layers)))


if __name__ == "__main__":
    main()
