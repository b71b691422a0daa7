"""FSDP2 for every version and tuning method. configs/fsdp.yaml names no layer class: accelerate then shards each
model's own decoder layer (its `_no_split_modules`: ChatGLM-6B's GLMBlock, transformers' GlmDecoderLayer, ...),
found through peft's wrapper too. Two processes (gloo on CPU) sharding that way follow one process's losses, for
every version and for each tuning method."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml
from serving import tiny_model

from chatglm_tune.data.batches import EncodedDataset, SpecialIds, collate_train
from chatglm_tune.data.records import read_records
from chatglm_tune.models import registry
from chatglm_tune.options import EncodingOptions, LoraOptions, TrainOptions
from chatglm_tune.tuning.training import decoder_layers

ROOT = Path(__file__).resolve().parents[1]
VERSIONS = sorted(registry.VERSIONS)
TUNINGS = ("full", "lora", "ptuning")
# Two processes train every version fully, and LoRA and P-tuning on one version of each kind of layer: ChatGLM-6B's
# GLMBlock, transformers' dense GLM layer (GLM-4), the latent-attention mixture of experts (GLM-4.7-Flash), its
# sparse-attention one (GLM-5) and the hybrid of KDA linear and sparse attention (GLM-5.3-Flash).
SHARDED = [(name, "full") for name in VERSIONS] + [(name, tuning)
                                                   for name in ("chatglm", "glm4", "glm4-moe-lite", "glm5",
                                                                "glm53-flash")
                                                   for tuning in ("lora", "ptuning")]
STEPS = 2


def wrap_policy(model):
    """What accelerate's FSDP2 preparation shards as a unit, with configs/fsdp.yaml's settings."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy

    settings = yaml.safe_load((ROOT / "configs" / "fsdp.yaml").read_text())["fsdp_config"]
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=settings["fsdp_version"], auto_wrap_policy=settings["fsdp_auto_wrap_policy"].lower(),
        transformer_cls_names_to_wrap=settings.get("fsdp_transformer_layer_cls_to_wrap"))
    return fsdp2_prepare_auto_wrap_policy(plugin, model)


def tuned(directory: Path, name: str, tuning: str):
    """The version's model of `directory` made ready for `tuning` as train.py makes it (LoRA r 4, prefix 4)."""
    from chatglm_tune.tuning.training import set_trainable

    version = registry.VERSIONS[name]
    torch.manual_seed(1)
    model = version.load_model(directory, **(dict(pre_seq_len=4) if tuning == "ptuning" else {}))
    return set_trainable(model, TrainOptions(tuning=tuning, lora=LoraOptions(r=4, dropout=0.0)))


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fsdp")
    return {name: tiny_model(name, root / name) for name in VERSIONS}


def layer_count(model) -> int:
    config = model.config
    return getattr(config, "num_hidden_layers", None) or config.num_layers


@pytest.mark.parametrize("tuning", TUNINGS)
def test_the_shard_unit_is_each_versions_decoder_layer(models, tuning):
    for name, directory in models.items():
        model = tuned(directory, name, tuning)
        policy = wrap_policy(model)
        units = [m for m in model.modules() if policy(m)]
        assert len(units) == layer_count(model), name
        assert units == decoder_layers(model), name  # the unit --compile compiles too


def batch(directory: Path, name: str, rank: int | None) -> dict[str, torch.Tensor]:
    """Four training rows of SPO dev records as train.py encodes them (rank r: rows 2r, 2r + 1)."""
    tokenizer = registry.VERSIONS[name].load_tokenizer(directory)
    records = read_records(ROOT / "data" / "spo_dev.jsonl")[0][:4]
    rows = EncodedDataset.from_records(records, tokenizer, EncodingOptions(max_src_len=48, max_len=64)).examples
    return collate_train(rows if rank is None else rows[2 * rank: 2 * rank + 2], SpecialIds.of(tokenizer))


def losses(model, directory: Path, name: str, rank: int | None) -> list[float]:
    """STEPS AdamW steps; a rank's loss is averaged over the ranks, one process averages its two halves."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    rows = batch(directory, name, rank)
    halves = [rows] if rank is not None else [{k: v[half] for k, v in rows.items()}
                                              for half in (slice(0, 2), slice(2, 4))]
    out = []
    for _ in range(STEPS):
        loss = sum(model(**half).loss for half in halves) / len(halves)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        value = loss.detach().clone()
        if rank is not None:
            dist.all_reduce(value)
            value /= dist.get_world_size()
        out.append(value.item())
    return out


def shard_and_train(rank: int, port: int, models: dict[str, Path], out: Path) -> None:
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    try:
        results = {}
        for name, tuning in SHARDED:
            model = tuned(models[name], name, tuning)
            policy = wrap_policy(model)
            for module in [m for m in model.modules() if policy(m)]:
                fully_shard(module)
            fully_shard(model)
            results[name, tuning] = losses(model, models[name], name, rank)
        if rank == 0:
            torch.save(results, out)
    finally:
        dist.destroy_process_group()
    # Its work done, the process ends without C++ static destructors: torch's gloo sometimes aborts in them at exit
    # ("terminate called without an active exception"), as train.py's distributed runs avoid too.
    os._exit(0)


def test_two_sharded_processes_follow_one_process_for_each_version_and_tuning(models, tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(shard_and_train, args=(port, models, tmp_path / "losses.pt"), nprocs=2)
    sharded = torch.load(tmp_path / "losses.pt", weights_only=True)
    for name, tuning in SHARDED:
        alone = losses(tuned(models[name], name, tuning), models[name], name, None)
        assert sharded[name, tuning] == pytest.approx(alone, rel=1e-4), (name, tuning)
