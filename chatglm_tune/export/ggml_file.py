"""chatglm.cpp's GGML file (the format its 0.4 releases read): ChatGLM-6B, which llama.cpp cannot run, and
ChatGLM2/3-6B.

Layout, all little-endian: `ggml`, the model type (1 ChatGLM-6B, 2 ChatGLM2, 3 ChatGLM3), the format
version 2, the ggml type of the matrices, then the config record (vocabulary, width, heads, KV heads, layers,
FFN width, norm epsilon, 0, rope base = 10000 x rope_ratio, max length, eos id, pad id), the tokenizer as a
length-prefixed serialized SentencePiece model, then per tensor: the length-prefixed name, the number of
dimensions, the shape (as the checkpoint has it), the ggml type, padding to 16 bytes, the data. Tensors come in
chatglm.cpp's order under the official keys; norms and biases in f32, matrices in f16 or ggml's q8_0 / q4_0 blocks
(gguf-py's quantizer, ggml's reference). ChatGLM-6B's head is its embedding (tied) and is not written.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable
from pathlib import Path

from gguf import GGMLQuantizationType as Q

from chatglm_tune.export.gguf_file import encode, stored_type
from chatglm_tune.runtime import crashpoints

GGML_TYPES = {"f16": Q.F16, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0}  # --type -> the matrices' ggml type
CHATGLM6B = 1  # chatglm.cpp's model type of ChatGLM-6B (2, 3: ChatGLM2, ChatGLM3; the `Version`s say theirs)


def _chatglm6b_layout(config: dict) -> tuple[tuple, list[tuple[str, bool]]]:
    """ChatGLM-6B's config record and its tensors (official key, is a matrix) in chatglm.cpp's order."""
    record = (config["vocab_size"], config["hidden_size"], config["num_attention_heads"], config["num_attention_heads"],
              config["num_layers"], config["inner_hidden_size"], config["layernorm_epsilon"], 0, 10000.0,
              config["max_sequence_length"], config["eos_token_id"], config["pad_token_id"])
    keys = [("transformer.word_embeddings.weight", True)]
    for i in range(config["num_layers"]):
        p = f"transformer.layers.{i}."
        for module, matrix in (("input_layernorm", False), ("attention.query_key_value", True),
                               ("attention.dense", True), ("post_attention_layernorm", False),
                               ("mlp.dense_h_to_4h", True), ("mlp.dense_4h_to_h", True)):
            keys += [(p + module + ".weight", matrix), (p + module + ".bias", False)]
    return record, keys + [("transformer.final_layernorm.weight", False), ("transformer.final_layernorm.bias", False)]


def _chatglm2_layout(config: dict) -> tuple[tuple, list[tuple[str, bool]]]:
    """ChatGLM2/3's config record and tensors, the untied head last."""
    record = (config["padded_vocab_size"], config["hidden_size"], config["num_attention_heads"],
              config["multi_query_group_num"], config["num_layers"], config["ffn_hidden_size"],
              config["layernorm_epsilon"], 0, 10000.0 * (config.get("rope_ratio") or 1), config["seq_length"],
              config["eos_token_id"], config["pad_token_id"])
    keys = [("transformer.embedding.word_embeddings.weight", True)]
    for i in range(config["num_layers"]):
        p = f"transformer.encoder.layers.{i}."
        keys += [(p + "input_layernorm.weight", False), (p + "self_attention.query_key_value.weight", True),
                 (p + "self_attention.query_key_value.bias", False), (p + "self_attention.dense.weight", True),
                 (p + "post_attention_layernorm.weight", False), (p + "mlp.dense_h_to_4h.weight", True),
                 (p + "mlp.dense_4h_to_h.weight", True)]
    return record, keys + [("transformer.encoder.final_layernorm.weight", False),
                           ("transformer.output_layer.weight", True)]


def write_ggml(out: Path, model_type: int, config: dict, tensor: Callable, tokenizer_proto: bytes, kind: str,
               progress: Callable[[int, int], None] = lambda done, total: None) -> dict:
    """Write chatglm.cpp's file of `model_type` (1 ChatGLM-6B, 2 ChatGLM2, 3 ChatGLM3) to `out`: `config` is the
    official config.json dict, `tensor(key)` gives each official tensor (read one at a time), `tokenizer_proto`
    the serialized SentencePiece model. {"tensors": n, "bytes": size}. `progress(tensors written, tensors of the
    file)` is called before the first tensor and after each."""
    if kind not in GGML_TYPES:
        raise ValueError(f"--type for a GGML file must be one of {', '.join(GGML_TYPES)}, got {kind!r}")
    qtype = GGML_TYPES[kind]
    record, keys = (_chatglm6b_layout if model_type == CHATGLM6B else _chatglm2_layout)(config)
    tmp = out.with_name(out.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(b"ggml" + struct.pack("iii", model_type, 2, int(qtype)))
            f.write(struct.pack("iiiiiififiii", *record))
            f.write(struct.pack("i", len(tokenizer_proto)) + tokenizer_proto)
            progress(0, len(keys))
            for done, (key, matrix) in enumerate(keys, 1):
                t = tensor(key)
                ttype = stored_type(qtype, tuple(t.shape)) if matrix else Q.F32
                f.write(struct.pack("i", len(key.encode())) + key.encode())
                f.write(struct.pack("i" * (2 + t.dim()), t.dim(), *t.shape, int(ttype)))
                f.seek((f.tell() + 15) // 16 * 16)
                f.write(encode(t, ttype).tobytes())
                crashpoints.reached("export-tensor")
                progress(done, len(keys))
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return {"tensors": len(keys), "bytes": out.stat().st_size}


def official_layout(model) -> tuple[dict, dict]:
    """(official config.json dict, state dict under the official keys) of a loaded float model."""
    if getattr(model.config, "chatglm_version", None) is None:  # ChatGLM-6B's own modeling keeps the official keys
        return model.config.to_dict(), model.state_dict()
    from chatglm_tune.models.glm.config import official_config
    from chatglm_tune.models.glm.weights import to_official

    return official_config(model.config), to_official(model.state_dict())
