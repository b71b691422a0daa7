"""Loading every checkpoint layout users have, safely, with clear errors and one copy of the weights."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from chatglm_tune import ChatGLMForConditionalGeneration
from chatglm_tune.runtime.checkpoint import CheckpointError
from conftest import FIXTURES

SMALL = FIXTURES / "model-small-vocab"


@pytest.fixture(scope="module")
def reference():
    model = ChatGLMForConditionalGeneration.from_pretrained(SMALL)
    ids = torch.tensor([[5, 6, 7, 1017, 1020]])
    with torch.no_grad():
        return model, ids, model(ids).logits


def _official_state(model):
    """The official layout: fp16 tensors, the tied head stored too, the rotary buffer present."""
    state = {k: v.half() for k, v in model.state_dict().items()}
    state["lm_head.weight"] = state["transformer.word_embeddings.weight"].clone()
    state["transformer.layers.0.attention.rotary_emb.inv_freq"] = torch.ones(4)
    return state


def _write_official_shards(state, directory, n_shards=3):
    keys = list(state)
    weight_map = {}
    for i in range(n_shards):
        name = f"pytorch_model-{i + 1:05d}-of-{n_shards:05d}.bin"
        part = {k: state[k] for k in keys[i::n_shards]}
        torch.save(part, directory / name)
        weight_map.update(dict.fromkeys(part, name))
    (directory / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {"total_size": 1},
                                                                        "weight_map": weight_map}))
    (directory / "config.json").write_text((SMALL / "config.json").read_text())


def test_official_sharded_bin_loads_and_matches(reference, tmp_path):
    model, ids, logits = reference
    _write_official_shards(_official_state(model), tmp_path)
    loaded = ChatGLMForConditionalGeneration.from_pretrained(tmp_path)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, logits)  # the golden weights are fp16-exact


def test_single_pth_and_sharded_safetensors(reference, tmp_path):
    model, ids, logits = reference
    torch.save(_official_state(model), tmp_path / "weights.pth")
    (tmp_path / "config.json").write_text((SMALL / "config.json").read_text())
    from_pth = ChatGLMForConditionalGeneration.from_pretrained(tmp_path / "weights.pth")
    model.save_pretrained(tmp_path / "sharded", max_shard_bytes=200_000)
    assert len(list((tmp_path / "sharded").glob("model-*-of-*.safetensors"))) > 1
    from_shards = ChatGLMForConditionalGeneration.from_pretrained(tmp_path / "sharded")
    with torch.no_grad():
        assert torch.equal(from_pth(ids).logits, logits)
        assert torch.equal(from_shards(ids).logits, logits)


def test_missing_shard_names_the_file(reference, tmp_path):
    _write_official_shards(_official_state(reference[0]), tmp_path)
    (tmp_path / "pytorch_model-00002-of-00003.bin").unlink()
    with pytest.raises(CheckpointError, match="missing: pytorch_model-00002-of-00003.bin"):
        ChatGLMForConditionalGeneration.from_pretrained(tmp_path)


def test_wrong_shape_names_key_expected_and_found(reference, tmp_path):
    state = _official_state(reference[0])
    state["transformer.layers.1.mlp.dense_h_to_4h.weight"] = torch.zeros(10, 96, dtype=torch.half)
    torch.save(state, tmp_path / "w.pth")
    (tmp_path / "config.json").write_text((SMALL / "config.json").read_text())
    with pytest.raises(CheckpointError,
                       match=r"dense_h_to_4h.weight has shape \[10, 96\], the model expects \[384, 96\]"):
        ChatGLMForConditionalGeneration.from_pretrained(tmp_path / "w.pth")


def test_config_that_does_not_match_the_weights(reference, tmp_path):
    torch.save(_official_state(reference[0]), tmp_path / "w.pth")
    config = json.loads((SMALL / "config.json").read_text())
    config["num_layers"] = 3
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="missing weights: transformer.layers.2"):
        ChatGLMForConditionalGeneration.from_pretrained(tmp_path / "w.pth")


class _Payload:
    def __reduce__(self):
        return (print, ("pickle code ran",))


def test_pickled_code_is_refused(tmp_path, capsys):
    torch.save({"transformer.word_embeddings.weight": _Payload()}, tmp_path / "evil.pth")
    (tmp_path / "config.json").write_text((SMALL / "config.json").read_text())
    with pytest.raises(CheckpointError, match="weights-only"):
        ChatGLMForConditionalGeneration.from_pretrained(tmp_path / "evil.pth")
    assert "pickle code ran" not in capsys.readouterr().out


def test_loading_peaks_near_one_copy_of_the_weights(tmp_path):
    """A 128 MB fp32 checkpoint loaded in fp32: the process grows by about one copy, not two."""
    from chatglm_tune import ChatGLMConfig

    config = ChatGLMConfig(vocab_size=8192, hidden_size=512, num_layers=8, num_attention_heads=8,
                           inner_hidden_size=2048, bos_token_id=4, eos_token_id=5, mask_token_id=6, gmask_token_id=7,
                           pad_token_id=3)
    ChatGLMForConditionalGeneration(config).save_pretrained(tmp_path)
    weight_bytes = (tmp_path / "model.safetensors").stat().st_size
    script = textwrap.dedent(f"""
        import resource, torch
        from chatglm_tune import ChatGLMForConditionalGeneration
        torch.ones(1) @ torch.ones(1)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        model = ChatGLMForConditionalGeneration.from_pretrained({str(tmp_path)!r})
        print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before)
    """)
    grown = int(subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                               check=True).stdout.split()[-1])
    assert grown < 1.35 * weight_bytes, f"loading grew the process by {grown / weight_bytes:.2f}x the weights"
