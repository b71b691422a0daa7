"""The tensors a GGUF file is written from, under their checkpoint keys, in one order for the header and the data.

A version's tensors go under the keys of the layout it is released in: ChatGLM2/3 and GLM-4 under the official
keys (q/k/v fused as `query_key_value`); GLM-4-0414 and GLM-Edge, released in transformers' own form
(`config.TRANSFORMERS_FORMS`), under transformers' keys (q, k, v apart; GLM-4-0414's extra norms). Either maps to
llama.cpp's names (`weights.gguf_name`).
Both give `shapes()` and the tensors in that order (`__iter__`), and any one tensor by key (`get`), which the
mixture-of-experts layouts read to stack experts (export/gguf_moe.py).
- `ModelTensors`: a loaded model's (a LoRA run merged into its base), under its version's layout (GLM-4.5's,
  GLM-4.7-Flash's and GLM-5's routed experts fused, 3D, as transformers holds them).
- `CheckpointTensors`: a checkpoint directory read as it lies, each tensor in the file's own dtype: what a model
  directory or a full fine-tuning run needs, without loading the model (the memory of one tensor, not of the
  model); a released checkpoint's experts per expert. `__iter__` reads one weight file at a time; `get` keeps
  the safetensors files it reads memory-mapped (a torch file is searched for the key each time). `names_every_tensor`
  says whether each of its keys has a GGUF name (an official-layout or a transformers-form checkpoint).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from chatglm_tune.export.gguf_moe import moe_arch, moe_layout
from chatglm_tune.models.glm.config import TRANSFORMERS_FORMS
from chatglm_tune.models.glm.weights import IGNORED, gguf_name, to_official
from chatglm_tune.runtime.checkpoint import CheckpointError, iter_tensors, open_safetensors, weight_files


class ModelTensors:
    def __init__(self, model):
        state = model.state_dict()
        released_form = getattr(model.config, "chatglm_version", None) in TRANSFORMERS_FORMS
        self.state = state if released_form else to_official(state)

    def shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        return [(key, tuple(t.shape)) for key, t in self.state.items()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return ((key, t.detach()) for key, t in self.state.items())

    def get(self, key: str) -> torch.Tensor:
        return self.state[key].detach()


class CheckpointTensors:
    def __init__(self, directory: Path):
        self.files = weight_files(directory)
        self._shapes: list[tuple[str, tuple[int, ...]]] | None = None
        self._file_of: dict[str, Path] = {}  # key -> its weight file (filled with the shapes)
        self._open: dict[Path, object] = {}  # safetensors files opened by `get`

    def shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """(key, shape) in the order `__iter__` gives the tensors, read from the files' headers only (once)."""
        if self._shapes is None:
            self._shapes = self._read_shapes()
        return self._shapes

    def _read_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        out = []
        for file in self.files:
            if file.suffix == ".safetensors":
                with open_safetensors(file) as f:
                    found = [(key, tuple(f.get_slice(key).get_shape())) for key in f.keys() if not IGNORED.match(key)]
            else:  # a weights-only torch file, memory-mapped: its tensors are not read here
                found = [(key, tuple(t.shape)) for key, t in iter_tensors(file) if not IGNORED.match(key)]
            self._file_of.update((key, file) for key, _ in found)
            out += found
        return out

    def get(self, key: str) -> torch.Tensor:
        """One tensor, read from its file (a safetensors file stays open, memory-mapped, for the next)."""
        self.shapes()
        file = self._file_of.get(key)
        if file is None:
            raise CheckpointError(f"{key} is in none of the weight files {', '.join(f.name for f in self.files)}")
        if file.suffix != ".safetensors":
            return next(t for k, t in iter_tensors(file) if k == key)
        if file not in self._open:
            self._open[file] = open_safetensors(file)
        return self._open[file].get_tensor(key)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for file in self.files:
            for key, tensor in iter_tensors(file):
                if not IGNORED.match(key):
                    yield key, tensor


def names_every_tensor(tensors: CheckpointTensors, config=None) -> bool:
    """Whether every tensor of a checkpoint has a GGUF name: official ChatGLM2/3 / GLM-4 keys, or transformers'
    keys (GLM-4-0414, GLM-Edge, glm-4-9b-chat-hf); for a mixture-of-experts model (its `config`), whether its
    keys make the layout of its llama.cpp architecture (`gguf_moe.moe_layout`); a P-tuning prefix has none."""
    arch = None if config is None else moe_arch(config)
    try:
        if arch is not None:
            moe_layout(arch, config, tensors)
            return True
        for key, _ in tensors.shapes():
            gguf_name(key)
    except ValueError:
        return False
    return True
