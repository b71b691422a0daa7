"""Safe checkpoint loading and atomic saving for ChatGLM models.

Loads, in this order of preference, from a directory: `model.safetensors.index.json` + shards,
`*.safetensors`, the official `pytorch_model.bin.index.json` + `pytorch_model-0000N-of-0000M.bin`
shards, `pytorch_model.bin`, or a single `.pth`/`.pt`/`.bin` file given directly. Torch files are read
with `torch.load(weights_only=True, mmap=True)`: no pickle code runs.

The model is built on the meta device and every tensor is assigned as it is read, one shard at a time,
cast to the compute dtype, so loading peaks near one copy of the weights. A caller may hand each tensor
to a placement function of its own first (`place`): quantizing while loading
(`quant.apply.QuantizeOnLoad`) turns each block Linear weight into INT8/INT4 as soon as it is read, a
few rows at a time, without ever holding a whole float weight, let alone the whole model.

Memory: both file types are read through a private memory map (torch's `mmap=True`, safetensors' own),
whose pages count in the process's RSS once touched. Every tensor is therefore copied out of the map
(cast, quantized, or cloned when the dtype already fits), and the file pages it occupied are released
right away with `madvise(MADV_DONTNEED)` (Linux; only inside a read-only-used map of that very file),
so at most one tensor's pages are resident beside the loaded weights, and the loaded model never
depends on the checkpoint file.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from chatglm_tune.runtime import crashpoints, heap, leftovers

IGNORED_KEYS = re.compile(r"(^lm_head\.weight$)|(\.rotary_emb\.inv_freq$)")  # tied head; recomputed buffer
PREFIX_KEY = "transformer.prefix_encoder."
TORCH_SUFFIXES = (".bin", ".pth", ".pt")
# Arguments the Auto classes pass along to from_pretrained; meaningless for a local directory.
AUTO_PLUMBING = {"_from_auto", "trust_remote_code", "adapter_kwargs", "revision", "cache_dir", "force_download",
                 "local_files_only", "proxies", "token", "subfolder", "_commit_hash", "code_revision", "name_or_path"}


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into the model as configured."""


def weight_files(path: str | os.PathLike) -> list[Path]:
    """The weight files of a checkpoint directory (or the file itself), in load order."""
    path = Path(path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint file or directory")
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = path / index_name
        if index.exists():
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            missing = [n for n in names if not (path / n).exists()]
            if missing:
                raise CheckpointError(f"{index}: shard(s) listed in the index are missing: {', '.join(missing)}")
            return [path / n for n in names]
    for pattern in ("model*.safetensors", "pytorch_model*.bin"):
        found = sorted(path.glob(pattern))
        if found:
            return found
    found = [f for f in sorted(path.iterdir()) if f.suffix in (".safetensors", *TORCH_SUFFIXES)]
    if len(found) == 1:
        return found
    if not found:
        raise CheckpointError(f"{path}: no weights found (model*.safetensors, pytorch_model*.bin or one *.pth)")
    raise CheckpointError(f"{path}: several weight files and no model*.safetensors or pytorch_model*.bin; pass the "
                          "file itself")


def open_safetensors(file: str | os.PathLike, device: str = "cpu"):
    """safetensors' reader of `file` (`safe_open`, a context manager too). CheckpointError naming the file where it is
    truncated or not a safetensors file at all: its header does not parse, or describes more bytes than the file
    holds (safetensors' own error names no file)."""
    try:
        return safe_open(str(file), framework="pt", device=device)
    except SafetensorError as e:
        raise CheckpointError(f"{file}: truncated or not a safetensors file ({e}): download it again, or save it "
                              "again from its source") from None


def iter_tensors(file: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(key, tensor) of one weight file, read lazily; torch files with weights_only=True."""
    if file.suffix == ".safetensors":
        with open_safetensors(file) as f:
            for key in f.keys():
                yield key, f.get_tensor(key)
        return
    if file.suffix not in TORCH_SUFFIXES:
        raise CheckpointError(f"{file}: unknown weight file type {file.suffix!r}")
    try:
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # a truncated file, or one that needs pickle code to load
        raise CheckpointError(f"{file}: cannot be read as a weights-only torch file ({e})") from e
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict):
        raise CheckpointError(f"{file}: expected a state dict, found {type(state).__name__}")
    keys = list(state)
    for key in keys:
        yield key, state.pop(key)  # drop our reference as we go


# place(key, tensor, pages) -> True when it put `tensor` into the model itself (reading rows of it and
# releasing their file pages through `pages.release`); False leaves it to the plain copy.
Placement = Callable[[str, torch.Tensor, "_FilePages"], bool]


def load_weights(
    model: nn.Module,
    path: str | os.PathLike,
    *,
    dtype: torch.dtype,
    only_prefix: bool = False,
    place: Placement | None = None,
) -> list[str]:
    """Assign the tensors of a checkpoint to a (meta or real) model; returns the keys still unset.

    Every key is checked against the model (known, same shape) before anything is placed. Floating
    tensors are cast to `dtype`, except the prefix encoder (kept in float32) and the quantization
    scales; integer tensors keep their type. `only_prefix` accepts nothing but
    `transformer.prefix_encoder.*` keys (a P-tuning checkpoint on top of a loaded base). `place` (see
    `Placement`) is offered each tensor first.
    """
    expected = dict(model.named_parameters())
    expected.update((k, b) for k, b in model.named_buffers() if _is_persistent(model, k))
    for file in weight_files(path):
        pages = _FilePages(file)
        for key, tensor in iter_tensors(file):
            if IGNORED_KEYS.search(key):
                continue
            if only_prefix and not key.startswith(PREFIX_KEY):
                raise CheckpointError(f"{file}: {key} is not a prefix-encoder weight (expected only {PREFIX_KEY}*)")
            if key not in expected:
                raise CheckpointError(_unexpected_key_message(model, file, key))
            target = expected.pop(key)
            if tuple(target.shape) != tuple(tensor.shape):
                raise CheckpointError(_shape_message(model, file, key, target.shape, tensor.shape))
            if place is None or not place(key, tensor, pages):
                _assign(model, key, copy_out(key, tensor, dtype, pages))
            pages.release(tensor)
            del tensor
        pages.close()
        heap.trim()
    return sorted(expected)


COPY_CHUNK_BYTES = 4 << 20  # a large tensor is copied out of the file map this much at a time


def copy_out(key: str, tensor: torch.Tensor, dtype: torch.dtype, pages: _FilePages | None,
             prefix_key: str = PREFIX_KEY) -> torch.Tensor:
    """`tensor` in memory of its own (never a view of the file map), cast as `_cast` says for `key` (the
    prefix encoder's keys start with `prefix_key`), copied a chunk of rows at a time with each chunk's
    file pages released as soon as it is copied: loading a tensor costs its final size plus one chunk,
    whatever the source and target dtypes."""
    target = _cast(key, tensor[:0] if tensor.dim() else tensor, dtype, prefix_key).dtype
    out = heap.large_empty(tuple(tensor.shape), target)  # weights that decoding streams: 2 MB pages where offered
    if tensor.dim() == 0 or tensor.numel() == 0:
        return out.copy_(tensor)
    row_bytes = max(1, tensor[0].numel() * tensor.element_size())
    rows = max(1, COPY_CHUNK_BYTES // row_bytes)
    for start in range(0, tensor.shape[0], rows):
        chunk = tensor[start : start + rows]
        out[start : start + rows].copy_(chunk)
        if pages is not None:
            pages.release(chunk)
    return out


class _FilePages:
    """Releases the pages of one weight file's memory map once a tensor read from it has been copied.

    Only addresses inside a mapping of this very file (per /proc/self/maps, read after the file was
    opened) are touched: MADV_DONTNEED on such a private, never-written file mapping just drops clean
    page-cache copies (a later read would fetch them from the file again), never data. The same file range
    then leaves the page cache too (POSIX_FADV_DONTNEED): a checkpoint is read once, and the memory its pages would
    keep is what lets the weights get 2 MB pages (`heap.large_empty`; a 6B INT8 load beside 12 GB of cached fp16
    shards got 2.2-2.9 of its 6 GB in them, 6.1 with the cache empty). No-op off Linux.
    """

    _libc = None

    def __init__(self, file: Path):
        self.file = os.path.realpath(file)
        # (start, end, file offset) of each mapping: read lazily, the file is mapped by iter_tensors
        self.ranges: list[tuple[int, int, int]] | None = None
        self.fd: int | None = None

    def _maps(self) -> list[tuple[int, int, int]]:
        if self.ranges is None:
            self.ranges = []
            try:
                with open("/proc/self/maps") as maps:
                    for line in maps:
                        fields = line.split(None, 5)
                        if len(fields) == 6 and fields[5].rstrip("\n") == self.file:
                            lo, hi = (int(x, 16) for x in fields[0].split("-"))
                            self.ranges.append((lo, hi, int(fields[2], 16)))
                self.fd = os.open(self.file, os.O_RDONLY) if self.ranges and hasattr(os, "posix_fadvise") else None
            except OSError:
                pass
        return self.ranges

    def release(self, tensor: torch.Tensor) -> None:
        if not sys.platform.startswith("linux") or tensor.device.type != "cpu":
            return
        start = tensor.untyped_storage().data_ptr() + tensor.storage_offset() * tensor.element_size()
        end = start + tensor.numel() * tensor.element_size()
        page = mmap.PAGESIZE
        start, end = start - start % page, -(-end // page) * page
        for lo, hi, offset in self._maps():
            a, b = max(start, lo), min(end, hi)
            if a < b:
                self._madvise(a, b - a)
                if self.fd is not None:
                    os.posix_fadvise(self.fd, offset + a - lo, b - a, os.POSIX_FADV_DONTNEED)

    @classmethod
    def _madvise(cls, address: int, length: int) -> None:
        if cls._libc is None:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            cls._libc = libc
        cls._libc.madvise(address, length, mmap.MADV_DONTNEED)

    def close(self) -> None:
        self.ranges = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    __del__ = close  # a load that stops on bad input closes its file too


def resolve_dtype(dtype: torch.dtype | str | None, stored: torch.dtype | str | None) -> torch.dtype:
    """The compute dtype asked for: a torch dtype or its name; "auto" = `stored` (config.json's); None = float32."""
    if dtype is None:
        return torch.float32
    if dtype == "auto":
        dtype = stored or "float32"
    if isinstance(dtype, str):
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ValueError(f"unknown dtype {dtype!r}")
        dtype = getattr(torch, dtype)
    return dtype


def _is_persistent(model: nn.Module, key: str) -> bool:
    owner, _, name = key.rpartition(".")
    return name not in model.get_submodule(owner)._non_persistent_buffers_set


def _cast(key: str, tensor: torch.Tensor, dtype: torch.dtype, prefix_key: str = PREFIX_KEY) -> torch.Tensor:
    """Integers and the fp16 quantization scales as they are; the prefix encoder in float32; the rest in `dtype`."""
    if not tensor.is_floating_point() or key.endswith("weight_scale"):
        return tensor
    return tensor.to(torch.float32 if key.startswith(prefix_key) else dtype)


def _assign(model: nn.Module, key: str, value: torch.Tensor) -> None:
    """Make `value` the model's tensor `key`, a Parameter as trainable as the one it replaces (a swapped-in
    quantized layer's are frozen) when it is floating point."""
    owner, _, name = key.rpartition(".")
    module = model.get_submodule(owner)
    if name in module._parameters:
        trainable = module._parameters[name].requires_grad and value.is_floating_point()
        module._parameters[name] = nn.Parameter(value, requires_grad=trainable)
    else:
        module._buffers[name] = value


def _prefix_settings(shape, config) -> str:
    """What pre_seq_len / prefix_projection a prefix embedding of `shape` was trained with."""
    width = 2 * config.num_layers * config.hidden_size
    projection = shape[-1] != width
    return f"pre_seq_len={shape[0]}, prefix_projection={projection}"


def _unexpected_key_message(model, file, key) -> str:
    config = model.config
    if key.startswith(PREFIX_KEY):
        return (
            f"{file}: holds P-tuning weights ({key}) but the model has pre_seq_len={config.pre_seq_len}, "
            f"prefix_projection={config.prefix_projection}; load it with the pre_seq_len/prefix_projection "
            "it was trained with"
        )
    return f"{file}: unexpected key {key} (not a weight of this ChatGLM config)"


def _shape_message(model, file, key, expected, found) -> str:
    config = model.config
    msg = f"{file}: {key} has shape {list(found)}, the model expects {list(expected)}"
    if key == PREFIX_KEY + "embedding.weight":
        msg += (
            f"; the checkpoint was trained with {_prefix_settings(found, config)}, the model has "
            f"pre_seq_len={config.pre_seq_len}, prefix_projection={config.prefix_projection}"
        )
    elif not key.startswith(PREFIX_KEY):
        msg += "; does config.json match these weights?"
    return msg


def save_state_dict(state: dict[str, torch.Tensor], directory: str | os.PathLike, *, max_shard_bytes: int = 2 << 30,
                    progress: Callable[[int, int], None] = lambda done, total: None) -> None:
    """Write `state` as `model.safetensors` (or shards + index), each file atomically; `progress(bytes written,
    bytes of all the tensors)` is called before the first file of tensors and after each."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, tensor in state.items():
        n = tensor.numel() * tensor.element_size()
        if shards[-1] and size + n > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = tensor
        size += n
    total, done = sum(t.numel() * t.element_size() for t in state.values()), 0
    progress(0, total)
    if len(shards) == 1:
        atomic_write(directory / "model.safetensors", lambda p: save_file(shards[0], p, metadata={"format": "pt"}))
        progress(total, total)
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        atomic_write(directory / name, lambda p, s=shard: save_file(s, p, metadata={"format": "pt"}))
        weight_map.update(dict.fromkeys(shard, name))
        done += sum(t.numel() * t.element_size() for t in shard.values())
        progress(done, total)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    atomic_write(directory / "model.safetensors.index.json", lambda p: Path(p).write_text(json.dumps(index, indent=2)))


def atomic_write(path: Path, write) -> None:
    """Call `write(tmp_path)` then rename onto `path`: a crash leaves the old file intact, and the temporary file of
    a writer killed outright is removed by the next write of `path` (`leftovers`). The file gets the permissions a
    plain `open` would give it (`follow_umask`)."""
    path = Path(path)
    leftovers.remove_abandoned(path.parent, f".{path.name}.")  # what a writer killed outright left
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=leftovers.owned_prefix(f".{path.name}."), suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        follow_umask(Path(tmp))
        crashpoints.reached("atomic-write")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def follow_umask(path: Path) -> None:
    """Give `path` (a file, or every file under a directory) the mode a new file gets from the umask
    (0644 under umask 022). Temporary files (mkstemp, and safetensors' own writer) are 0600: renamed
    into place as they are, they would be unreadable to everyone but their owner."""
    mask = os.umask(0)
    os.umask(mask)
    files = [path] if path.is_file() else [f for f in path.rglob("*") if f.is_file()]
    for file in files:
        os.chmod(file, 0o666 & ~mask)


def read_config_file(directory: str | Path) -> dict:
    """The config.json of a model directory (or of the directory holding a weights file)."""
    path = Path(directory)
    if path.is_file():
        path = path.parent
    file = path / "config.json"
    if not file.exists():
        raise CheckpointError(f"{path}: no config.json beside the weights")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file}: not valid JSON ({e})") from e
