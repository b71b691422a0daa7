"""Putting quantized layers into a model: swapping Linears (`quantize_model`), quantizing while loading
(`QuantizeOnLoad`), the INT8 embedding and head (`quantize_embedding`), and bitsandbytes (`to_bitsandbytes`).

Which Linears are swapped is the caller's `targets` (a version's `quantizable_linears`: ChatGLM-6B's four
block Linears, ChatGLM2/3 and GLM-4's attention and MLP projections), always inside `layers.N` blocks;
embeddings, norms and the P-tuning prefix encoder stay in float. Opt-in, beyond the official format:
`quantize_embedding` holds the word embedding and `lm_head` in INT8, ChatGLM-6B's tied pair as one copy,
the untied ChatGLM2/3 / GLM-4 pair as one each (a runtime form, never saved).
"""

from __future__ import annotations

import re

import torch
from torch import Tensor, nn

from chatglm_tune.quant import cpu_matmul
from chatglm_tune.quant.format import quantize_rows
from chatglm_tune.quant.modules import QuantizedEmbedding, QuantizedLinear


def quantize_embedding(model: nn.Module, *, empty_init: bool = False, dtype: torch.dtype | None = None) -> nn.Module:
    """Replace, in place, the float word embedding and `lm_head` of a model by INT8 rows (per-row scales, the
    official rule): the head becomes a `QuantizedLinear` (its decode matmul the int8pack kernel), the
    embedding a `QuantizedEmbedding`; tied (ChatGLM-6B) as one copy that both read, untied (ChatGLM2/3,
    GLM-4) as one each, the float embedding freed before the head is quantized. Beyond the official format
    (which keeps them in half: 1.07 GB at ChatGLM-6B, 2 x 1.24 GB at GLM-4-9B): half their memory and the
    fastest head on CPU, for a small logit error (tested). A runtime form for inference and for P-tuning/LoRA
    on a frozen base; saving the whole model refuses it (`refuse_int8_embedding`). `empty_init=True` (untied
    only; a tied pair is quantized as its tensor is read, `QuantizeOnLoad`) creates empty INT8 forms on the
    weights' device: a meta model that a loader then quantizes into. `dtype`: what the rows are quantized in
    and a lookup computes in (default: the float embedding's). Returns `model`.
    """
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    if (not isinstance(embedding, nn.Embedding) or type(head) not in (nn.Linear, cpu_matmul.Linear)
        or head.bias is not None):
        raise TypeError(f"quantize_embedding needs a float nn.Embedding and a bias-free nn.Linear head, not "
                        f"{type(embedding).__name__} and {type(head).__name__} (load the model without "
                        "quantize_embedding)")
    dtype, tied = dtype or embedding.weight.dtype, head.weight is embedding.weight
    if tied and empty_init:
        raise ValueError("empty_init is for an untied embedding and head: a tied one is quantized as it is read "
                         "(QuantizeOnLoad)")

    def int8_rows(weight: Tensor) -> tuple[Tensor, Tensor]:  # (int8 [rows, cols], fp16 scales [rows])
        if empty_init:
            scale = torch.empty(weight.shape[0], dtype=torch.float16, device=weight.device)
            return torch.empty_like(weight, dtype=torch.int8), scale
        return quantize_rows(weight.detach(), dtype, 8, 0)

    if tied:
        install_int8_embedding(model, *int8_rows(embedding.weight), dtype)  # the float weight is then unreferenced
        return model
    model.set_input_embeddings(QuantizedEmbedding.from_parts(*int8_rows(embedding.weight), dtype))
    del embedding  # freed before the head's quantization temporaries exist
    model.set_output_embeddings(QuantizedLinear.from_parts(*int8_rows(head.weight), None, 8))
    return model


def install_int8_embedding(model: nn.Module, weight: Tensor, weight_scale: Tensor, dtype: torch.dtype) -> None:
    """Make INT8 rows `weight [vocab, hidden]` with fp16 `weight_scale [vocab]` the model's tied head and
    input embedding (computing in `dtype`); also used by the loader, which quantizes them while reading."""
    embedding = QuantizedEmbedding.from_parts(weight, weight_scale, dtype)
    model.set_input_embeddings(embedding)
    model.set_output_embeddings(QuantizedLinear.from_parts(embedding.weight, embedding.weight_scale, None,
                                                           8, shared=True))


def refuse_int8_embedding(state: dict[str, Tensor], scale_keys: tuple[str, ...]) -> None:
    """ValueError when the state dict to save holds an INT8 embedding or head (`quantize_embedding`: one of
    `scale_keys`, their `weight_scale` keys), a runtime form that no official layout has."""
    held = [k for k in scale_keys if k in state]
    if held:
        raise ValueError(f"this model holds its embedding in INT8 (quantize_embedding: {', '.join(held)}), a runtime "
                         "form with no official layout: save a model loaded without it")


# ------------------------------------------------------------------------------------------------
# Module swaps
# ------------------------------------------------------------------------------------------------

_BLOCK = re.compile(r"(^|\.)layers\.\d+(\.|$)")


def _target_slots(model: nn.Module, targets: tuple[str, ...]) -> list[tuple[nn.Module, str, str]]:
    """(parent, attribute, full name) of every target child inside a `layers.N` block, all checked to
    be plain `nn.Linear` before anything is swapped. Holds parents only, so that a swapped-out Linear
    is freed at once."""
    slots, problems = [], []
    for name, module in model.named_modules():
        if not _BLOCK.search(name):
            continue
        for attr, child in module.named_children():
            if attr not in targets:
                continue
            full = f"{name}.{attr}"
            if type(child) not in (nn.Linear, cpu_matmul.Linear):
                problems.append(f"{full} is {type(child).__name__}")
            slots.append((module, attr, full))
    if problems:
        raise TypeError(
            "only plain nn.Linear layers can be swapped; " + ", ".join(problems) + ". A LoRA-wrapped "
            "Linear would lose its adapter: merge the adapter first, or quantize the base before wrapping."
        )
    if not slots:
        raise ValueError(f"no Linear named one of {targets} inside a `layers.N` block")
    return slots


def quantize_model(
    model: nn.Module,
    bits: int,
    group_size: int = 0,
    *,
    targets: tuple[str, ...],
    empty_init: bool = False,
) -> nn.Module:
    """Swap, in place, every `nn.Linear` named in `targets` inside a `layers.N` block for a
    `QuantizedLinear` (official `model.quantize(bits)`); embeddings, LayerNorms, `lm_head` and the
    prefix encoder are untouched. Layer by layer: each float weight is freed as soon as its quantized
    form exists, so peak memory stays about one copy of the model. `empty_init=True` creates empty
    quantized layers on the Linears' device (use a meta model, then `load_state_dict(assign=True)`).
    The model's config (when it has one) records `quantization_bit` and `quantization_group_size`.
    Returns `model`.
    """
    _record_format(model, bits, group_size)
    for parent, attr, _ in _target_slots(model, targets):
        linear = getattr(parent, attr)
        if empty_init:
            new = QuantizedLinear(
                linear.in_features, linear.out_features, bits, group_size, bias=linear.bias is not None,
                device=linear.weight.device, dtype=linear.weight.dtype,
            )
        else:
            new = QuantizedLinear.from_linear(linear, bits, group_size)
        setattr(parent, attr, new)
        del linear, new  # the float weight goes now, not at the end of the loop
    return model


def _record_format(model: nn.Module, bits: int, group_size: int) -> None:
    config = getattr(model, "config", None)
    if config is not None:
        config.quantization_bit, config.quantization_group_size = bits, group_size


class QuantizeOnLoad:
    """A checkpoint placement (`checkpoint.Placement`) that quantizes while loading: each block Linear
    weight named in `targets` becomes INT`bits` rows as it is read (its layer swapped for a
    `QuantizedLinear` whose bias the loader then assigns), and with `embedding` the tied word
    embedding becomes one INT8 copy (`install_int8_embedding`). No whole float weight ever exists:
    `quantize_rows` reads a few rows at a time and releases their file pages."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, bits: int = 0, group_size: int = 0, *,
                 embedding: bool = False, embedding_key: str = "transformer.word_embeddings.weight",
                 targets: tuple[str, ...]):
        self.model, self.dtype, self.bits, self.group_size = model, dtype, bits, group_size
        self.embedding_key = embedding_key if embedding else None
        self.linears = {f"{name}.weight": name for _, _, name in _target_slots(model, targets)} if bits else {}
        if bits:
            _record_format(model, bits, group_size)

    def __call__(self, key: str, tensor: Tensor, pages) -> bool:
        if key == self.embedding_key:
            install_int8_embedding(self.model, *quantize_rows(tensor, self.dtype, 8, 0, pages.release), self.dtype)
        elif key in self.linears:
            owner, _, attr = self.linears[key].rpartition(".")
            parent = self.model.get_submodule(owner)
            bias = getattr(parent, attr).bias  # meta: the loader assigns the real one when it reads it
            q, scale = quantize_rows(tensor, self.dtype, self.bits, self.group_size, pages.release)
            setattr(parent, attr, QuantizedLinear.from_parts(q, scale, bias, self.bits, self.group_size))
        else:
            return False
        return True


def to_bitsandbytes(model: nn.Module, mode: str, *, targets: tuple[str, ...]) -> nn.Module:
    """Swap, in place, the same Linears as `quantize_model` for bitsandbytes layers (the QLoRA base):
    `mode="int8"` -> `Linear8bitLt` (LLM.int8(), outlier threshold 6.0), `mode="nf4"` -> `Linear4bit`
    (NF4, computing in the Linear's dtype). Quantizes on the Linear's device; the bias is kept, frozen.
    Returns `model`.
    """
    if mode not in ("int8", "nf4"):
        raise ValueError(f"mode must be 'int8' or 'nf4', got {mode!r}")
    try:
        import bitsandbytes as bnb
    except ImportError as e:
        raise ImportError("to_bitsandbytes needs bitsandbytes: pip install 'chatglm_tune[bnb]'") from e
    for parent, attr, _ in _target_slots(model, targets):
        linear = getattr(parent, attr)
        weight, device, has_bias = linear.weight.detach(), linear.weight.device, linear.bias is not None
        if mode == "int8":
            new = bnb.nn.Linear8bitLt(linear.in_features, linear.out_features, bias=has_bias,
                                      has_fp16_weights=False, threshold=6.0, device="meta")
            # Int8Params quantizes when moved off the CPU-held float data (bitsandbytes 0.50).
            new.weight = bnb.nn.Int8Params(weight.cpu(), requires_grad=False, has_fp16_weights=False).to(device)
        else:
            new = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=has_bias,
                                    compute_dtype=weight.dtype, quant_type="nf4", device="meta")
            new.weight = bnb.nn.Params4bit(weight, requires_grad=False, quant_type="nf4").to(device)
        if has_bias:
            new.bias = nn.Parameter(linear.bias.detach(), requires_grad=False)
        setattr(parent, attr, new)
        del linear, weight, new
    return model
