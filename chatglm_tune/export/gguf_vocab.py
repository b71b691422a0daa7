"""The tokenizer of a ChatGLM2/3, GLM-4, GLM-4-0414 or GLM-Edge model inside its GGUF file, as llama.cpp reads it.

- ChatGLM2/3 (`tokenizer.ggml.model = llama`, SentencePiece; pre-tokenizer `chatglm-spm`): every piece of
  `tokenizer.model` with its score and type (normal, unknown, control, byte), then the special tokens that
  follow the pieces (`[MASK] [gMASK] [sMASK] sop eop`, ChatGLM3's role tokens) as control tokens, then
  `[PAD<id>]` unused entries up to the embedding's rows. `add_space_prefix` is the model's own (SentencePiece's
  dummy prefix "▁"), read from how it encodes a word.
- GLM-4, GLM-4-0414, GLM-Edge (`gpt2`, byte-level BPE): the BPE's tokens in byte-to-unicode form and its
  merges, the special tokens after the ranks as control tokens, then padding. The pre-tokenizer is GLM-4's regex
  under the name llama.cpp's converter gives it for the architecture (`PRE_TOKENIZERS`): `chatglm-bpe` in a
  `chatglm` file (GLM-4, GLM-Edge), `glm4` in a `glm4` file (GLM-4-0414) and in the
  `glm4moe` / `deepseek2` / `glm-dsa` files of GLM-4.5 / GLM-4.7-Flash / GLM-5, which also takes a word that is a
  whole token as that token, as the tokenizer.json's BPE does (`ignore_merges`).
- Special ids: eos, eot = `<|user|>`, eom = `<|observation|>` (llama.cpp ends generation on all three: the
  toolkit's stop ids), unk and pad as the tokenizer has them; no BOS is added (the chat template starts
  `[gMASK]`, GLM-Edge's with its first role token).
"""

from __future__ import annotations

import json

import gguf
from gguf import TokenType

from chatglm_tune.data.tokenizing import adds_dummy_prefix

# llama.cpp architecture -> its GLM-4 BPE pre-tokenizer
PRE_TOKENIZERS = {"chatglm": "chatglm-bpe", "glm4": "glm4", "glm4moe": "glm4", "deepseek2": "glm4", "glm-dsa": "glm4"}


def add_vocab(writer: gguf.GGUFWriter, tokenizer, rows: int) -> None:
    """Write the tokenizer (SentencePiece: ChatGLM2/3; byte-level BPE: GLM-4, GLM-4-0414, GLM-Edge) padded to `rows`
    entries (the embedding's) into `writer`."""
    tokens, types, scores = (_sentencepiece if hasattr(tokenizer, "sp_model") else _bpe)(writer, tokenizer)
    if len(tokens) > rows:
        raise ValueError(f"the tokenizer has {len(tokens)} tokens, more than the model's {rows} embedding rows")
    for i in range(len(tokens), rows):
        tokens.append(f"[PAD{i}]".encode())
        types.append(TokenType.UNUSED)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    if scores is not None:
        writer.add_token_scores(scores + [0.0] * (rows - len(scores)))
    specials = {"eos": tokenizer.eos_token_id, "pad": tokenizer.pad_token_id, "unk": tokenizer.unk_token_id}
    for role, kind in (("<|user|>", "eot"), ("<|observation|>", "eom")):
        if role in tokenizer.special_ids:
            specials[kind] = tokenizer.special_ids[role]
    for kind, token_id in specials.items():
        if token_id is not None:
            getattr(writer, f"add_{kind}_token_id")(token_id)
    writer.add_add_bos_token(False)
    writer.add_add_eos_token(False)


def _sentencepiece(writer, tokenizer) -> tuple[list[bytes], list[int], list[float]]:
    sp = tokenizer.sp_model
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        tokens.append(sp.id_to_piece(i).encode("utf-8"))
        scores.append(sp.get_score(i))
        types.append(TokenType.UNKNOWN if sp.is_unknown(i) else TokenType.CONTROL if sp.is_control(i)
                     else TokenType.UNUSED if sp.is_unused(i) else TokenType.BYTE if sp.is_byte(i)
                     else TokenType.NORMAL)
    for name, token_id in sorted(tokenizer.special_ids.items(), key=lambda item: item[1]):
        if token_id != len(tokens):
            raise ValueError(f"special token {name} has id {token_id}; expected the next after {len(tokens)} pieces")
        tokens.append(name.encode("utf-8"))
        scores.append(0.0)
        types.append(TokenType.CONTROL)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("chatglm-spm")
    writer.add_add_space_prefix(adds_dummy_prefix(sp))
    return tokens, types, scores


def _bpe(writer, tokenizer) -> tuple[list[bytes], list[int], None]:
    backend = tokenizer._backend  # the tokenizers.Tokenizer: ranks as BPE, special tokens added after them
    by_id = {i: t for t, i in backend.get_vocab(with_added_tokens=True).items()}
    if sorted(by_id) != list(range(len(by_id))):
        raise ValueError("the byte-level BPE tokenizer's ids are not contiguous")
    special = set(tokenizer.special_ids.values())
    tokens = [by_id[i].encode("utf-8") for i in range(len(by_id))]
    types = [TokenType.CONTROL if i in special else TokenType.NORMAL for i in range(len(by_id))]
    merges = json.loads(backend.to_str())["model"]["merges"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(PRE_TOKENIZERS[writer.arch])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    return tokens, types, None
