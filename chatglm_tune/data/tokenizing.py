"""What the tokenizers of every model family share: the pair layout (`pair_inputs`) and the special-tokens
mask read off it, the left-padding rule, where `save_vocabulary` writes, training and saving a small
SentencePiece model, the text a small tokenizer may learn word pieces of (`word_runs`), and reading what a
SentencePiece model is (its model type, its dummy prefix), and a piece's bytes in decoded text (`piece_bytes`).
"""

from __future__ import annotations

import io
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

import sentencepiece as spm

SPIECE = "\u2581"  # SentencePiece's space


def require_left_padding(padding_side: str, prompts: str) -> None:
    """ValueError unless `padding_side` is "left": a batch of `prompts` (ChatGLM, GLM-4) is generated on from
    its last column, so every row must end there."""
    if padding_side != "left":
        raise ValueError(f"{prompts} prompts must be left-padded, got padding_side={padding_side!r}")


def pair_inputs(prompt: list[int], token_ids_1: list[int] | None, eos_token_id: int) -> list[int]:
    """`prompt` (the first sequence with its special tokens), then for a pair `b <eos>`: every version's
    training layout."""
    return prompt if token_ids_1 is None else prompt + token_ids_1 + [eos_token_id]


def special_tokens_mask(build_inputs, token_ids_0: list[int], token_ids_1: list[int] | None = None) -> list[int]:
    """1 on each token that `build_inputs` (a tokenizer's `build_inputs_with_special_tokens`) adds, 0 on the
    given ids: read off the layout itself, so that the mask and the layout cannot disagree."""
    placeholders = [None] * len(token_ids_0), None if token_ids_1 is None else [None] * len(token_ids_1)
    return [int(i is not None) for i in build_inputs(*placeholders)]


_BYTE_PIECE = re.compile(r"<0x([0-9A-F]{2})>")


def piece_bytes(sp_model, index: int, whole: Mapping[str, str] | None = None) -> bytes:
    """The bytes SentencePiece piece `index` stands for in decoded text: `<0xXX>` its byte, a piece of `whole` (a
    tokenizer's own user-defined pieces, which SentencePiece never joins to others) its text, else the piece with
    `▁` a space."""
    piece = sp_model.id_to_piece(index)
    if sp_model.is_byte(index) and (byte := _BYTE_PIECE.fullmatch(piece)):
        return bytes([int(byte.group(1), 16)])
    if whole and piece in whole:
        return whole[piece].encode("utf-8")
    return piece.replace(SPIECE, " ").encode("utf-8")


def vocabulary_path(save_directory: str, filename_prefix: str | None, file_name: str) -> Path:
    """Where `save_vocabulary` writes `file_name`: in `save_directory`, under transformers' optional prefix."""
    return Path(save_directory) / ((f"{filename_prefix}-" if filename_prefix else "") + file_name)


def save_sentencepiece(sp_model, save_directory: str, filename_prefix: str | None, file_name: str) -> tuple[str]:
    """`save_vocabulary` of a SentencePiece tokenizer: the model's bytes, as `file_name`."""
    path = vocabulary_path(save_directory, filename_prefix, file_name)
    path.write_bytes(sp_model.serialized_model_proto())
    return (str(path),)


def train_sentencepiece(sentences: Iterable[str], output_dir: str | Path, file_name: str, *,
                        model_type: str = "unigram", **options) -> Path:
    """Train a small SentencePiece model (`model_type` "unigram" or "bpe") on `sentences` and write it as
    `output_dir / file_name` (the folder made if need be); returns that path. What every small tokenizer
    trained here shares: every character of the corpus may get a piece (the vocabulary size is a soft
    limit), others fall back to bytes, digits are split, one thread (deterministic), quiet. `options`: the
    trainer's other settings."""
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences), model_writer=model, model_type=model_type, hard_vocab_limit=False,
        character_coverage=1.0, byte_fallback=True, split_digits=True, num_threads=1, minloglevel=2, **options,
    )
    path = Path(output_dir) / file_name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(model.getvalue())
    return path


# Characters a small tokenizer keeps one a token: CJK (ideographs, their punctuation, full-width forms) and
# digits. A name or a number in a text and in an answer are then the same tokens, which a tiny model copies.
_SINGLE = re.compile(r"([\u2e80-\u303f\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uff00-\uffef]|\d)")


def word_runs(texts: Iterable[str]) -> list[str]:
    """The runs of `texts` between the characters kept single (CJK and digits): what a small tokenizer
    learns word pieces of (Latin words, runs of spaces, JSON punctuation: a tool definition)."""
    return [run for text in texts for run in _SINGLE.split(text) if run and not _SINGLE.fullmatch(run)]


def keeps_single(text: str) -> bool:
    """True when `text` holds a character that a small tokenizer keeps one a token (`word_runs`)."""
    return _SINGLE.search(text) is not None


def adds_dummy_prefix(sp) -> bool:
    """Whether a SentencePiece model puts "▁" before a text (its normalizer's add_dummy_prefix), read from how it
    encodes one."""
    return sp.encode("a", out_type=str)[0].startswith(SPIECE)


def sentencepiece_model_type(sp) -> str:
    """"unigram", "bpe", "word" or "char": `trainer_spec.model_type` read from the serialized model (protobuf
    field 2 of the model, field 3 of it; read here without the protobuf package)."""
    data = sp.serialized_model_proto()
    spec = _field(data, 2)
    kind = _field(spec, 3) if spec is not None else None
    return {1: "unigram", 2: "bpe", 3: "word", 4: "char"}.get(kind if kind is not None else 1, "unigram")


def _varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[at]
        value |= (byte & 0x7F) << shift
        at += 1
        if byte < 0x80:
            return value, at
        shift += 7


def _field(data: bytes, number: int):
    """The first value of field `number` in a protobuf message: bytes (length-delimited) or int (varint)."""
    at = 0
    while at < len(data):
        key, at = _varint(data, at)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, at = _varint(data, at)
        elif wire == 2:
            length, at = _varint(data, at)
            value, at = data[at:at + length], at + length
        elif wire == 5:
            value, at = data[at:at + 4], at + 4
        elif wire == 1:
            value, at = data[at:at + 8], at + 8
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        if field == number:
            return value
    return None
