"""A random-weight checkpoint in the official ChatGLM-6B layout, written shard by shard (bench/scale.py's
`write` step).

    python bench/checkpoint_writer.py DIR [--num-layers N] [--shards M]   # prints a JSON line

The keys, shapes and order are those of the library's model (its `state_dict`, built on the meta device:
no memory), plus what the official files hold beyond it: `lm_head.weight` stored (equal to the
embedding, as the tied head is) and each layer's `attention.rotary_emb.inv_freq` buffer, after
`attention.dense.bias` as in the official key order. fp16 `pytorch_model-0000N-of-0000M.bin` shards
(M = 8 at full size), `pytorch_model.bin.index.json` and config.json. LayerNorm weights are ones and
biases zeros; every other tensor is drawn N(0, 0.02) directly in fp16 from a generator seeded by its
key, so at most one shard is in memory and the same config always gives the same bytes.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import zlib
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from chatglm_tune import ChatGLMConfig, ChatGLMForConditionalGeneration  # noqa: E402

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


def make_tensor(shape: tuple[int, ...], init: str) -> torch.Tensor:
    """The fp16 tensor of one entry of `official_tensors`."""
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
    the last tensor (`lm_head.weight`, alone in the official last shard but for the final LayerNorm).
    Every group non-empty."""
    sizes = [2 * torch.Size(shape).numel() for _, shape, _ in tensors]
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


def write_checkpoint(directory: Path, config: ChatGLMConfig, n_shards: int) -> dict:
    """Write the checkpoint into `directory` (replaced if it exists); {"keys", "shards", "bytes"}."""
    if directory.exists():
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    tensors = official_tensors(config)
    assert tensors[-1][0] == "lm_head.weight", tensors[-1][0]
    plan = shard_plan(tensors, n_shards)
    weight_map, total = {}, 0
    for s, group in enumerate(plan, 1):
        name = f"pytorch_model-{s:05d}-of-{len(plan):05d}.bin"
        shard = {tensors[j][0]: make_tensor(*tensors[j][1:]) for j in group}
        torch.save(shard, directory / name)
        total += sum(t.numel() * t.element_size() for t in shard.values())
        weight_map.update(dict.fromkeys(shard, name))
        del shard
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "pytorch_model.bin.index.json").write_text(json.dumps(index, indent=2))
    cfg = config.to_dict()
    cfg.update(architectures=["ChatGLMModel"], torch_dtype="float16")
    cfg.pop("dtype", None)
    (directory / "config.json").write_text(json.dumps(cfg, indent=2))
    return {"keys": len(tensors), "shards": len(plan), "bytes": total}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("directory", type=Path, help="where the checkpoint goes (replaced if it exists)")
    p.add_argument("--num-layers", type=int, help="layers (default: ChatGLM-6B's 28)")
    p.add_argument("--shards", type=int, default=8, help="weight files (default %(default)s, as the official checkpoint)")
    args = p.parse_args(argv)
    overrides = {} if args.num_layers is None else {"num_layers": args.num_layers}
    print(json.dumps(write_checkpoint(args.directory, ChatGLMConfig.from_name("chatglm-6b", **overrides), args.shards)))


if __name__ == "__main__":
    main()
