"""P-tuning v2: `pre_seq_len` learned key/value pairs in front of every layer, for every ChatGLM version.

The encoder (official `PrefixEncoder`): an embedding of the P prefix positions, optionally through a
Tanh MLP (`prefix_projection`), giving each position one vector of width
W = 2 * num_layers * heads * head_dim. ChatGLM-6B: heads x head_dim = hidden, and the
projection starts from an embedding of width hidden. ChatGLM2/3 and GLM-4: heads = kv groups, head_dim =
kv_channels, and the projection starts from an embedding of width W. Official key names
(`transformer.prefix_encoder.embedding.weight`, `trans.0`/`trans.2` with projection), so official
P-tuning checkpoints load as they are. Like the official `ptuning/main.py`, the encoder stays in float32
while the trunk runs in half precision; its output is cast to the trunk's dtype, then dropout (0.1,
training only). Initialisation is PyTorch's default, as in the official code.

The prefix is always the first P entries of the KV cache, keys not rotated: `seed_cache` writes it into
a cache that decoding then extends; a forward that keeps no cache (training) reads it from a
`PrefixCache`, which stores nothing new.

A checkpoint fits a model when it was trained on the same version (`check_prefix_version`, its
config.json read by the model's family) and its shapes are the model's: `pre_seq_len` rows, width W
(`check_prefix_shapes`). ChatGLM3-6B and GLM-4 prefixes of equal shape exist (the tiny models' are), so
the shapes alone do not tell.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers.cache_utils import Cache, DynamicLayer

PREFIX_DROPOUT = 0.1


class PrefixEncoder(nn.Module):
    """prefix index [b, P] -> [b, P, width]: an embedding of `width`, or (projection) one of
    `embedding_dim` -> Linear(embedding_dim, hidden) -> Tanh -> Linear(hidden, width)."""

    def __init__(self, pre_seq_len: int, width: int, hidden_size: int, projection: bool, embedding_dim: int):
        super().__init__()
        self.prefix_projection = projection
        self.embedding = nn.Embedding(pre_seq_len, embedding_dim if projection else width)
        if projection:
            self.trans = nn.Sequential(nn.Linear(embedding_dim, hidden_size), nn.Tanh(), nn.Linear(hidden_size, width))

    def forward(self, prefix: torch.Tensor) -> torch.Tensor:
        out = self.embedding(prefix)
        return self.trans(out) if self.prefix_projection else out


def prefix_key_values(encoder: PrefixEncoder, dropout: nn.Module, num_layers: int, heads: int, head_dim: int,
                      batch_size: int, dtype: torch.dtype,
                      value_dim: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer (key, value), [b, heads, P, head_dim] and [b, heads, P, value_dim] (default head_dim) in `dtype`
    (the cache layout).

    Each layer's channels are its key's heads then its value's: with equal widths, channel
    `((2 * layer + kv) * heads + head) * head_dim + d` of the encoder output is element `d` of head `head` of the
    key (kv=0) or value (kv=1) of `layer`, as in the official `get_prompt`. One dropout mask covers keys and values
    alike. (Latent attention's: every head's keys and values, which its model hands the attention; glm/prefix.py.)
    """
    value_dim = head_dim if value_dim is None else value_dim
    weight = encoder.embedding.weight
    p = weight.shape[0]
    tokens = torch.arange(p, device=weight.device).expand(batch_size, p)
    kv = dropout(encoder(tokens).to(dtype)).view(batch_size, p, num_layers, heads * (head_dim + value_dim))
    keys, values = kv.split([heads * head_dim, heads * value_dim], dim=-1)
    keys = keys.reshape(batch_size, p, num_layers, heads, head_dim).permute(2, 0, 3, 1, 4)  # [L, b, heads, P, hd]
    values = values.reshape(batch_size, p, num_layers, heads, value_dim).permute(2, 0, 3, 1, 4)
    return [(keys[layer], values[layer]) for layer in range(num_layers)]


def cache_empty(cache: Cache) -> bool:
    """Whether nothing is cached yet, so the prefix goes in first. A compiled forward (the static-cache decode step,
    `decoding.static_decoding`) only ever follows an eager prefill, and a static cache's length is a tensor whose
    test would split its graph: it is never empty there."""
    return not torch.compiler.is_compiling() and cache.get_seq_length() == 0


def seed_cache(cache: Cache, prefix: list[tuple[torch.Tensor, torch.Tensor]]) -> Cache:
    """`cache` (empty) with the prefix as the first `pre_seq_len` entries of every layer."""
    if cache.get_seq_length() != 0:
        raise ValueError("the prefix goes into an empty cache only")
    for layer, (k, v) in enumerate(prefix):
        cache.update(k, v, layer)
    return cache


class _PrefixLayer(DynamicLayer):
    """A cache layer holding only the prefix: `update` returns [prefix | new] and stores nothing."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        super().__init__()
        self.lazy_initialization(keys, values)
        self.keys, self.values = keys, values

    def update(self, key_states, value_states, *args, **kwargs):
        return torch.cat([self.keys, key_states], dim=-2), torch.cat([self.values, value_states], dim=-2)


class PrefixCache(Cache):
    """The prefix as a read-only cache, for forwards that keep no cache (training, scoring).

    Writing nothing makes a layer's forward repeatable: a gradient-checkpointed layer recomputed in the
    backward pass sees the same keys/values, so the prefix survives checkpointing. The prefix tensors
    stay in the autograd graph: gradients reach the encoder.
    """

    def __init__(self, prefix: list[tuple[torch.Tensor, torch.Tensor]]):
        super().__init__(layers=[_PrefixLayer(k, v) for k, v in prefix])


def check_prefix_version(source, theirs: str | None, ours: str, model="the model", error: type[Exception] | None = None,
                         hint: str = "") -> None:
    """Refuse (`error`, default `CheckpointError`) a P-tuning checkpoint trained on version `theirs` (as its
    config.json says; None: it cannot tell, and the shapes decide when it loads) for `model` (a path or a
    description) of version `ours`, naming both (the versions as a reader knows them: "ChatGLM3-6B")."""
    from chatglm_tune.runtime.checkpoint import CheckpointError

    if theirs is None or theirs == ours:
        return
    raise (error or CheckpointError)(
        f"{source} is a P-tuning prefix of a {theirs} model (its config.json), and {model} is {ours}: a prefix runs "
        f"only on the version it was trained on{hint}"
    )


def check_prefix_shapes(source, shapes: dict, expected: dict, width: int, formula: str) -> None:
    """Refuse (`CheckpointError`) prefix-encoder tensors (`shapes`: key -> shape) whose shapes are not the
    model's (`expected`: key -> shape; keys it lacks are left to the caller), naming both: another width
    than the model's W (`width`, made as `formula` says), or another row count than its `pre_seq_len`."""
    from chatglm_tune.runtime.checkpoint import CheckpointError

    for key, shape in shapes.items():
        want = expected.get(key)
        if want is None or tuple(shape) == tuple(want):
            continue
        if key.endswith("embedding.weight") and tuple(shape[1:]) == tuple(want[1:]):
            raise CheckpointError(f"{source}: {key} has {shape[0]} rows, the prefix positions it was trained with "
                                  f"(pre_seq_len), and this model has pre_seq_len={want[0]}")
        raise CheckpointError(f"{source}: {key} has shape {list(shape)}, the model expects {list(want)} (prefix width "
                              f"{width}: {formula}): the prefix was trained on another model")


def only_prefix_weights(path, key_prefix: str) -> bool:
    """Whether the weight files of `path` hold prefix-encoder tensors (keys under `key_prefix`) and nothing else."""
    from chatglm_tune.runtime.checkpoint import iter_tensors, weight_files

    keys = [key for file in weight_files(path) for key, _ in iter_tensors(file)]
    return bool(keys) and all(key.startswith(key_prefix) for key in keys)


def not_a_model(path) -> str:
    """What to say when a P-tuning checkpoint (prefix weights only) is loaded as a model: what it is, and
    what loads it (for a train.py run, which names its base in run_args.json, that base)."""
    import json

    directory = Path(path) if Path(path).is_dir() else Path(path).parent
    run_args = directory / "run_args.json"
    base = json.loads(run_args.read_text(encoding="utf-8")).get("model") if run_args.is_file() else None
    if base is not None:
        return (f"{directory} is a P-tuning run: its weights are a prefix trained on {base}, not a model. "
                f"chatglm_tune.from_pretrained('{directory}') and AutoModel.from_pretrained('{directory}') load that "
                f"base with the prefix; or load {base} and call load_prefix('{directory}')")
    return (f"{directory} holds only P-tuning prefix weights, not a model: load the base model it was trained on and "
            f"call load_prefix('{directory}'), or run it with infer.py --model BASE --ptuning-checkpoint {directory}")
