"""The tensors a GGUF file is written from, under their checkpoint keys, in one order for the header and the data.

A version's tensors go under the keys of the layout it is released in: ChatGLM2/3 and GLM-4 under the official
keys (q/k/v fused as `query_key_value`); GLM-4-0414 and GLM-Edge, released in transformers' own form
(`config.TRANSFORMERS_FORMS`), under transformers' keys (q, k, v apart; GLM-4-0414's extra norms). Either maps to
llama.cpp's names (`weights.gguf_name`).
- `ModelTensors`: a loaded model's (a LoRA run merged into its base), under its version's layout.
- `CheckpointTensors`: a checkpoint directory read as it lies, one weight file open at a time, each tensor in the
  file's own dtype: what a model directory or a full fine-tuning run needs, without loading the model (the memory
  of one tensor, not of the model). `names_every_tensor` says whether each of its keys has a GGUF name (an
  official-layout or a transformers-form checkpoint).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from chatglm_tune.checkpoint import iter_tensors, weight_files
from chatglm_tune.models.glm.config import TRANSFORMERS_FORMS
from chatglm_tune.models.glm.weights import IGNORED, gguf_name, to_official


class ModelTensors:
    def __init__(self, model):
        state = model.state_dict()
        released_form = getattr(model.config, "chatglm_version", None) in TRANSFORMERS_FORMS
        self.state = state if released_form else to_official(state)

    def shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        return [(key, tuple(t.shape)) for key, t in self.state.items()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return ((key, t.detach()) for key, t in self.state.items())


class CheckpointTensors:
    def __init__(self, directory: Path):
        self.files = weight_files(directory)
        self._shapes: list[tuple[str, tuple[int, ...]]] | None = None

    def shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """(key, shape) in the order `__iter__` gives the tensors, read from the files' headers only (once)."""
        if self._shapes is None:
            self._shapes = self._read_shapes()
        return self._shapes

    def _read_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        out = []
        for file in self.files:
            if file.suffix == ".safetensors":
                with safe_open(str(file), framework="pt") as f:
                    out += [(key, tuple(f.get_slice(key).get_shape())) for key in f.keys() if not IGNORED.match(key)]
            else:  # a weights-only torch file, memory-mapped: its tensors are not read here
                out += [(key, tuple(t.shape)) for key, t in iter_tensors(file) if not IGNORED.match(key)]
        return out

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for file in self.files:
            for key, tensor in iter_tensors(file):
                if not IGNORED.match(key):
                    yield key, tensor


def names_every_tensor(tensors: CheckpointTensors) -> bool:
    """Whether every tensor of a checkpoint has a GGUF name: official ChatGLM2/3 / GLM-4 keys, or transformers'
    keys (GLM-4-0414, GLM-Edge, glm-4-9b-chat-hf); a P-tuning prefix has none."""
    try:
        for key, _ in tensors.shapes():
            gguf_name(key)
    except ValueError:
        return False
    return True
