"""A ChatGLM2/3, GLM-4, GLM-4-0414, GLM-Edge, GLM-4.5, GLM-4.7-Flash or GLM-5 model as one GGUF file for llama.cpp /
ollama.

The architecture is the one llama.cpp's own converter gives the model's transformers class (`ARCHES`):
`GlmForCausalLM` (ChatGLM2/3, GLM-4, GLM-Edge) is `chatglm`; `Glm4ForCausalLM` (GLM-4-0414, GLM-Z1) is `glm4`,
the same graph with an RMSNorm after attention and after the MLP, each before its residual add;
`Glm4MoeForCausalLM` (GLM-4.5 / 4.6 / 4.7) is `glm4moe`, `Glm4MoeLiteForCausalLM` (GLM-4.7-Flash) `deepseek2` and
`GlmMoeDsaForCausalLM` (GLM-5) `glm-dsa`, whose tensors and hyperparameters export/gguf_moe.py writes
(`tensor_layout`; a router stays F32 in every `--type`, as llama.cpp keeps it, and so do GLM-5's indexer weights).
What the `chatglm` / `glm4` graphs read, and what is written here for them:
- tensors under its names (`models.glm.weights.gguf_name`): from an official checkpoint, q|k|v rows fused into
  `attn_qkv` with its bias and dense_h_to_4h's gate|up rows as `ffn_up`; from one in transformers' own form
  (GLM-4-0414, GLM-Edge), `attn_q` / `attn_k` / `attn_v` apart (as llama.cpp's converter writes them),
  `gate_up_proj` as `ffn_up`, GLM-4-0414's extra norms as `post_attention_norm` / `post_ffw_norm`; the untied
  head as `output`;
- hyperparameters: layers, width, heads, KV groups, `key_length` / `value_length` (= kv_channels), the FFN
  width, RMSNorm epsilon, context length (`seq_length`), rotary on half of each head (`rope.dimension_count` =
  kv_channels / 2, adjacent pairs as the official code rotates them) with `rope.freq_base` = 10000 x rope_ratio
  (transformers' `rope_theta`); a scaled rotary (`rope_type` other than default) is refused;
- the tokenizer (gguf_vocab.py) and the version's Jinja chat template (`PromptFormat.chat_template`, with the
  toolkit's render defaults for llama.cpp: `answering.template_defaults`);
- norms and biases in F32; the matrices (embedding, head, block Linears) in the `--type`: F16, BF16, or ggml's
  blocks of 32 weights, Q8_0 (an fp16 scale absmax / 127 and 32 int8) or Q4_0 (an fp16 scale and 16 bytes of
  nibbles), quantized by gguf-py exactly as ggml's reference quantizer; a q4_0 file keeps the head in Q8_0 (llama.cpp's
  own q4_0 keeps it above 4 bits, in Q6_K, which gguf-py cannot write). A matrix whose rows are not whole blocks
  stays F16.
Tensors are converted and written one at a time (quantized in slices of rows), from a loaded model or straight
from a checkpoint's files (export/tensors.py): beside their source, memory holds one tensor. The file is
written under a temporary name and renamed when complete.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from itertools import chain
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from chatglm_tune.export.answering import engine_fields, template_defaults
from chatglm_tune.export.gguf_moe import LATENT_ATTENTION, MOE_ARCHES, GgufTensor, moe_hyperparameters, moe_layout
from chatglm_tune.export.gguf_vocab import add_vocab
from chatglm_tune.models.glm.config import transformers_form
from chatglm_tune.models.glm.weights import gguf_name
from chatglm_tune.options import SamplingOptions
from chatglm_tune.runtime import crashpoints

# transformers class -> llama.cpp architecture (the mixture-of-experts ones: export/gguf_moe.py)
ARCHES = {"GlmForCausalLM": "chatglm", "Glm4ForCausalLM": "glm4", **MOE_ARCHES}
# whether the architecture's attention output is hidden x hidden (`chatglm`), not heads x kv_channels (`glm4`)
SQUARE_ATTENTION_OUTPUT = {"chatglm": True, "glm4": False}
TYPES = {"f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0}  # --type -> ggml type of the matrices
FILE_TYPES = {"f16": gguf.LlamaFileType.MOSTLY_F16, "bf16": gguf.LlamaFileType.MOSTLY_BF16,
              "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}
SLICE_WEIGHTS = 1 << 22  # weights quantized at a time (16 MB of float32)
# matrices kept in F32 whatever the --type: a router's, as llama.cpp does; GLM-5's indexer weights, as transformers
# computes them (export/gguf_moe.py)
F32_MATRICES = (".ffn_gate_inp.weight", ".indexer.proj.weight")


def tensor_type(name: str, shape: tuple[int, ...], kind: str) -> Q:
    """The ggml type a tensor is stored in for `--type kind`."""
    qtype = TYPES[kind]
    if name.endswith(F32_MATRICES):
        return Q.F32
    if qtype == Q.Q4_0 and name == "output.weight":
        qtype = Q.Q8_0
    return stored_type(qtype, shape)


def stored_type(qtype: Q, shape: tuple[int, ...]) -> Q:
    """`qtype` for a matrix whose rows are whole blocks of it; F16 for another matrix; F32 for a vector (norms,
    biases)."""
    if len(shape) == 1:
        return Q.F32
    return qtype if shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0] == 0 else Q.F16


def encode(tensor: torch.Tensor, qtype: Q) -> np.ndarray:
    """`tensor` as the bytes (or values) of ggml type `qtype`, row-major."""
    if qtype == Q.F32:
        return tensor.float().numpy()
    if qtype == Q.F16:
        return tensor.half().numpy()
    if qtype == Q.BF16:
        return tensor.bfloat16().view(torch.int16).numpy().view(np.uint16)
    rows = tensor.reshape(-1, tensor.shape[-1])
    out = np.empty(gguf.quants.quant_shape_to_byte_shape(tuple(rows.shape), qtype), dtype=np.uint8)
    step = max(1, SLICE_WEIGHTS // rows.shape[-1])
    for i in range(0, rows.shape[0], step):  # a slice of rows at a time, into the one output array
        out[i:i + step] = gguf.quants.quantize(rows[i:i + step].float().numpy(), qtype)
    return out


def architecture(config) -> str:
    """llama.cpp's architecture of a model of this family (its config)."""
    return ARCHES[transformers_form(config)["architectures"][0]]


def hyperparameters(writer: gguf.GGUFWriter, config, kind: str) -> None:
    if SQUARE_ATTENTION_OUTPUT.get(writer.arch) and config.num_attention_heads * config.head_dim != config.hidden_size:
        raise ValueError(f"llama.cpp's chatglm architecture needs heads x kv_channels = hidden_size; this model has "
                         f"{config.num_attention_heads} x {config.head_dim} != {config.hidden_size}")
    rope_type = config.rope_parameters.get("rope_type", "default")
    if rope_type != "default":
        raise ValueError(f"this model's rotary embedding is scaled ({rope_type}), which is not written into GGUF files "
                         "here")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_head_count(config.num_attention_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    if writer.arch in MOE_ARCHES.values():
        moe_hyperparameters(writer, config, writer.arch)
    if writer.arch not in LATENT_ATTENTION:  # grouped-query attention
        writer.add_head_count_kv(config.num_key_value_heads)
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
        writer.add_rope_dimension_count(int(config.head_dim * config.rope_parameters.get("partial_rotary_factor", 0.5)))
    writer.add_file_type(FILE_TYPES[kind])


def add_sampling(writer, sampling: SamplingOptions) -> None:
    """`general.sampling.temp`, `.top_p`, `.top_k`: llama.cpp's defaults for what a request does not set."""
    fields = engine_fields(sampling)
    writer.add_sampling_temp(fields["temperature"])
    writer.add_sampling_top_p(fields["top_p"])
    if "top_k" in fields:
        writer.add_sampling_top_k(fields["top_k"])


def dense_layout(tensors) -> list[GgufTensor]:
    """The GGUF tensors of a `chatglm` / `glm4` model: each source tensor under its name, read in the source's
    order (one pass over its files)."""
    stream = iter(tensors)

    def take(key: str, shape: tuple[int, ...]) -> list[torch.Tensor]:
        got, tensor = next(stream, (None, None))
        if got != key or tuple(tensor.shape) != shape:
            found = "nothing" if got is None else f"{got} {list(tensor.shape)}"
            raise ValueError(f"{found} came where the header holds {key} {list(shape)}")
        return [tensor]

    return [GgufTensor(gguf_name(key), shape, lambda key=key, shape=shape: take(key, shape))
            for key, shape in tensors.shapes()]


def tensor_layout(arch: str, config, tensors) -> list[GgufTensor]:
    """The tensors of the file in the order they are written (`moe_layout` for the mixture-of-experts ones)."""
    return moe_layout(arch, config, tensors) if arch in MOE_ARCHES.values() else dense_layout(tensors)


def stored_bytes(shape: tuple[int, ...], qtype: Q) -> int:
    block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    return int(np.prod(shape[:-1])) * shape[-1] // block * block_bytes


def encode_tensor(tensor: GgufTensor, qtype: Q) -> np.ndarray:
    """The tensor's bytes in `qtype`: a single part encoded as it is; parts (stacked experts) each encoded into
    their place in one output array, so that no stacked float copy is made."""
    parts = iter(tensor.parts())
    first = next(parts)
    if tuple(first.shape) == tensor.shape:
        return encode(first, qtype)
    out = np.empty(stored_bytes(tensor.shape, qtype), dtype=np.uint8)
    at = rows = 0
    for part in chain([first], parts):
        if tuple(part.shape[1:]) != tensor.shape[1:] or rows + part.shape[0] > tensor.shape[0]:
            raise ValueError(f"{tensor.name}: a part of shape {list(part.shape)} does not fit {list(tensor.shape)}")
        data = np.ascontiguousarray(encode(part, qtype)).reshape(-1).view(np.uint8)
        out[at:at + data.size] = data
        at, rows = at + data.size, rows + part.shape[0]
    if rows != tensor.shape[0]:
        raise ValueError(f"{tensor.name}: its parts hold {rows} of {tensor.shape[0]} rows")
    return out


def write_gguf(path: Path, config, tokenizer, tensors, kind: str, *, name: str = "", chat_template: str | None = None,
               sampling: SamplingOptions | None = None,
               progress: Callable[[int, int], None] = lambda done, total: None) -> dict:
    """Write a model of this family (its config, its tokenizer, `tensors`: an `export.tensors` source of its
    float tensors under checkpoint keys) as the GGUF file `path`; {"tensors": n, "bytes": size}. `chat_template`:
    the Jinja template it carries (None: the version's, with its render defaults: `answering.template_defaults`);
    `sampling`: the defaults llama.cpp takes from it (`general.sampling.*`; None: none written).
    `progress(tensors written, tensors of the file)` is called before the first tensor and after each."""
    if kind not in TYPES:
        raise ValueError(f"--type must be one of {', '.join(TYPES)}, got {kind!r}")
    arch = architecture(config)
    plan = tensor_layout(arch, config, tensors)
    tmp = path.with_name(path.name + ".tmp")
    writer = gguf.GGUFWriter(tmp, arch)
    try:
        writer.add_name(name or path.stem)
        hyperparameters(writer, config, kind)
        add_vocab(writer, tokenizer, rows=config.vocab_size)
        writer.add_chat_template(chat_template or template_defaults(tokenizer.prompt_format, llama_cpp=True)
                                 + tokenizer.prompt_format.chat_template(tokenizer))
        if sampling is not None:
            add_sampling(writer, sampling)
        for tensor in plan:
            qtype = tensor_type(tensor.name, tensor.shape, kind)
            writer.add_tensor_info(tensor.name, tensor.shape, np.dtype(np.float32), stored_bytes(tensor.shape, qtype),
                                   raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        progress(0, len(plan))
        for done, tensor in enumerate(plan, 1):
            writer.write_tensor_data(encode_tensor(tensor, tensor_type(tensor.name, tensor.shape, kind)))
            crashpoints.reached("export-tensor")
            progress(done, len(plan))
        writer.close()
        os.replace(tmp, path)
    finally:
        writer.close()
        tmp.unlink(missing_ok=True)
    return {"tensors": len(plan), "bytes": path.stat().st_size}
