"""The ChatGLM-6B tokenizer (a transformers 5 slow tokenizer over SentencePiece), and training a small one.

Reproduces the official THUDM/chatglm-6b `tokenization_chatglm.py` as run under transformers 4.27.1
(golden outputs in `tests/fixtures/tokenizer_golden.json`):

- encoding: `\\n` -> `<n>`, `\\t` -> `<|tab|>`, runs of 80..2 spaces -> `<|blank_N|>`, then the
  SentencePiece unigram model `ice_text.model` (NFKC, dummy prefix, byte fallback);
- ids are SentencePiece ids + `num_image_tokens` (default 0 here: the official class default of
  20000 is the pre-"slim" layout and shifts every id);
- the literal texts `<sop> <eop> <unk> <pad> [MASK]` are special tokens (whitespace around them is
  stripped, as transformers 4.27 did); `[gMASK]` typed as text is not;
- prompts end `[gMASK] <sop>`; decoding drops `<pad>`, CONTROL pieces decode to "", the whitespace codes
  are undone, and the transformers 4.27 `clean_up_tokenization` is applied;
- padding is on the left; a padded batch carries the GLM mask `[1, s, s]` (True = blocked) and the 2D
  position ids `[2, s]` per row, as the official `_pad` builds them (see `positions.py`).

Every special id is read from the SentencePiece model, so `train_tokenizer` can build a small
vocabulary with the same special pieces in another layout.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import sentencepiece as spm
import torch
from transformers import PreTrainedTokenizer
from transformers.tokenization_utils_base import AddedToken
from transformers.utils import PaddingStrategy

from chatglm_tune.models.chatglm6b.format import FORMAT
from chatglm_tune.models.chatglm6b.positions import build_attention_mask, build_position_ids
from chatglm_tune.data.tokenizing import (pair_inputs, piece_bytes, require_left_padding, save_sentencepiece,
                                          special_tokens_mask, train_sentencepiece)

VOCAB_FILE = "ice_text.model"
NEWLINE_PIECE = "<n>"
TAB_PIECE = "<|tab|>"
MAX_BLANK_LENGTH = 80
BLANK_PIECES = tuple(f"<|blank_{n}|>" for n in range(2, MAX_BLANK_LENGTH + 1))
# The text of each whitespace piece (user-defined pieces: never part of another piece)
WHITESPACE_TEXT = {NEWLINE_PIECE: "\n", TAB_PIECE: "\t", **{piece: " " * n for n, piece in enumerate(BLANK_PIECES, 2)}}
# CONTROL pieces of ice_text.model, in its order (ids 130000..130007 there).
CONTROL_PIECES = ("[MASK]", "[gMASK]", "[sMASK]", "<unused_0>", "<sop>", "<eop>", "<ENC>", "<dBLOCK>")
# The named special tokens of the official tokenizer_config.json; these (and only these) are split out
# of raw text.
SPECIAL_TOKENS = {
    "bos_token": "<sop>", "eos_token": "<eop>", "unk_token": "<unk>", "pad_token": "<pad>", "mask_token": "[MASK]"
}
GMASK_PIECE = "[gMASK]"
# Other fields of the official tokenizer_config.json; this class implements only these values.
FIXED_OPTIONS = {"gmask_token": GMASK_PIECE, "end_token": "</s>", "do_lower_case": False, "remove_space": False}
# transformers 4.27's `clean_up_tokenization`, which the official decode applies by default.
CLEANUP_REPLACEMENTS = (
    (" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
    (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"),
)
# Target vocabulary of `train_tokenizer`: a soft limit that counts the 348 special and byte pieces, and
# must leave room for one piece per distinct character of the corpus (character_coverage=1.0).
DEFAULT_TRAIN_VOCAB_SIZE = 4000


def encode_whitespace(text: str) -> str:
    """The official pre-processing: newlines, tabs and runs of 2..80 spaces become their pieces."""
    text = text.replace("\n", NEWLINE_PIECE).replace("\t", TAB_PIECE)
    for n in range(MAX_BLANK_LENGTH, 1, -1):
        text = text.replace(" " * n, f"<|blank_{n}|>")
    return text


def decode_whitespace(text: str) -> str:
    """Inverse of `encode_whitespace` on decoded text."""
    for piece, whitespace in WHITESPACE_TEXT.items():
        text = text.replace(piece, whitespace)
    return text


class ChatGLMTokenizer(PreTrainedTokenizer):
    """ChatGLM-6B tokenizer over `ice_text.model` (or a model from `train_tokenizer`).

    `num_image_tokens`: offset added to every SentencePiece id (0 for the released model).
    `glm_masks`: when padding, return the official GLM mask `[1, s, s]` (True = blocked) per row; when
    False, the standard mask `[s]` (1 = token, 0 = pad). Both return `position_ids` `[2, s]` per row.
    """

    vocab_files_names = {"vocab_file": VOCAB_FILE}
    model_input_names = ["input_ids", "attention_mask", "position_ids"]
    prompt_format = FORMAT
    padding_side = "left"

    def __init__(
        self,
        vocab_file: str,
        num_image_tokens: int = 0,
        glm_masks: bool = True,
        padding_side: str = "left",
        clean_up_tokenization_spaces: bool = True,
        **kwargs,
    ) -> None:
        require_left_padding(padding_side, "ChatGLM")
        # The official config names the remote code; this class replaces it.
        kwargs.pop("auto_map", None)
        # `from_pretrained` moves unknown `*_token` fields (gmask_token, end_token) into this dict.
        options = dict(kwargs.pop("model_specific_special_tokens", None) or {})
        for key, expected in {**SPECIAL_TOKENS, **FIXED_OPTIONS}.items():
            value = options.pop(key, kwargs.pop(key, expected))
            if str(value) != str(expected):
                raise ValueError(f"ChatGLMTokenizer supports only {key}={expected!r}, got {value!r}")
        if options:
            raise ValueError(f"ChatGLMTokenizer supports no extra special tokens, got {options}")

        # The SentencePiece model must exist before the base __init__, which calls get_vocab().
        self.vocab_file = vocab_file
        self.num_image_tokens = num_image_tokens
        self.glm_masks = glm_masks
        self.sp_model = spm.SentencePieceProcessor(model_file=str(vocab_file))
        missing = [p for p in (NEWLINE_PIECE, TAB_PIECE, *BLANK_PIECES, *CONTROL_PIECES, *SPECIAL_TOKENS.values())
                   if self.sp_model.id_to_piece(self.sp_model.piece_to_id(p)) != p]
        if missing:
            raise ValueError(f"{vocab_file} is not a ChatGLM SentencePiece model: it lacks the pieces {missing}")
        # transformers 4.27 stripped the whitespace around special tokens found in raw text.
        self._added_tokens_decoder = {
            self._convert_token_to_id(t): AddedToken(t, lstrip=True, rstrip=True, normalized=False, special=True)
            for t in SPECIAL_TOKENS.values()
        }
        super().__init__(**SPECIAL_TOKENS, num_image_tokens=num_image_tokens, glm_masks=glm_masks,
                         padding_side=padding_side, clean_up_tokenization_spaces=clean_up_tokenization_spaces, **kwargs)

    @property
    def vocab_size(self) -> int:
        return self.num_image_tokens + self.sp_model.get_piece_size()

    @property
    def gmask_token_id(self) -> int:
        return self._convert_token_to_id(GMASK_PIECE)

    def get_vocab(self) -> dict[str, int]:
        pieces = self.sp_model.id_to_piece(list(range(self.sp_model.get_piece_size())))  # one batched call
        vocab = {f"<image_{i}>": i for i in range(self.num_image_tokens)}
        vocab.update((piece, i + self.num_image_tokens) for i, piece in enumerate(pieces))
        vocab.update(self._added_tokens_encoder)
        return vocab

    def token_bytes(self) -> list[bytes | None]:
        """Each id's bytes in decoded text, by id (`<n>` a newline, `<|tab|>` a tab, `<|blank_n|>` n spaces); None
        for the image ids and the control and special pieces."""
        silent = {self.sp_model.piece_to_id(p) for p in (*CONTROL_PIECES, *SPECIAL_TOKENS.values())}
        pieces = [None if i in silent or self.sp_model.is_control(i) or self.sp_model.is_unknown(i)
                  else piece_bytes(self.sp_model, i, WHITESPACE_TEXT) for i in range(self.sp_model.get_piece_size())]
        return [None] * self.num_image_tokens + pieces

    def _tokenize(self, text: str, **kwargs) -> list[str]:
        return self.sp_model.encode(encode_whitespace(text), out_type=str)

    def _convert_token_to_id(self, token: str) -> int:
        if token.startswith("<image_") and token.endswith(">") and token[7:-1].isdigit():
            return int(token[7:-1])
        return self.sp_model.piece_to_id(token) + self.num_image_tokens

    def _convert_id_to_token(self, index: int) -> str:
        if not 0 <= index < self.vocab_size:
            raise ValueError(f"token id {index} is outside the vocabulary [0, {self.vocab_size})")
        if index < self.num_image_tokens:
            return f"<image_{index}>"
        return self.sp_model.id_to_piece(index - self.num_image_tokens)

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return decode_whitespace(self.sp_model.decode_pieces(tokens))

    def _decode(self, token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=None, **kwargs) -> str:
        ids = [int(token_ids)] if isinstance(token_ids, int) else [int(i) for i in token_ids]
        ids = [i for i in ids if i != self.pad_token_id]  # the official decode drops pad ids first
        bad = [i for i in ids if not self.num_image_tokens <= i < self.vocab_size]
        if bad:
            raise ValueError(
                f"cannot decode ids {bad[:10]}: text tokens are {self.num_image_tokens}..{self.vocab_size - 1} "
                "(mask larger ids out of the logits, or never sample them)"
            )
        return super()._decode(ids, skip_special_tokens, clean_up_tokenization_spaces, **kwargs)

    def clean_up_tokenization(self, text: str) -> str:
        """transformers 4.27's clean-up (spaces before `. ? ! ,` and English contractions), pinned here."""
        for before, after in CLEANUP_REPLACEMENTS:
            text = text.replace(before, after)
        return text

    def build_inputs_with_special_tokens(self, token_ids_0: list[int],
                                         token_ids_1: list[int] | None = None) -> list[int]:
        """`a [gMASK] <sop>`, or `a [gMASK] <sop> b <eop>` for a pair (the training layout)."""
        return pair_inputs(token_ids_0 + [self.gmask_token_id, self.bos_token_id], token_ids_1, self.eos_token_id)

    def get_special_tokens_mask(self, token_ids_0, token_ids_1=None, already_has_special_tokens=False) -> list[int]:
        if already_has_special_tokens:
            return super().get_special_tokens_mask(token_ids_0, token_ids_1, already_has_special_tokens=True)
        return special_tokens_mask(self.build_inputs_with_special_tokens, token_ids_0, token_ids_1)

    def _pad(
        self,
        encoded_inputs,
        max_length: int | None = None,
        padding_strategy: PaddingStrategy = PaddingStrategy.DO_NOT_PAD,
        pad_to_multiple_of: int | None = None,
        padding_side: str | None = None,
        return_attention_mask: bool | None = None,
    ) -> dict:
        """Left-pad one row; with a padding length, also build its mask and position ids (official `_pad`).

        Without a padding length (no padding, no max_length) the official tokenizer returns the ids alone
        and the model builds the mask and positions; `glm_masks=False` keeps the standard 1D mask there.
        Rows must contain `<sop>` and `[gMASK]` (or `[MASK]`) once padded.
        """
        if (padding_side or self.padding_side) != "left":
            raise ValueError("ChatGLM batches must be left-padded (right padding breaks inference, issue #327)")
        ids = list(encoded_inputs["input_ids"])
        if padding_strategy == PaddingStrategy.LONGEST:
            max_length = len(ids)
        if max_length is None:
            if self.glm_masks:
                return encoded_inputs
            return super()._pad(encoded_inputs, None, padding_strategy, pad_to_multiple_of, "left",
                                return_attention_mask)
        if pad_to_multiple_of is not None and max_length % pad_to_multiple_of:
            max_length = (max_length // pad_to_multiple_of + 1) * pad_to_multiple_of
        n_pad = 0 if padding_strategy == PaddingStrategy.DO_NOT_PAD else max(0, max_length - len(ids))

        encoded_inputs["input_ids"] = [self.pad_token_id] * n_pad + ids
        for key, fill in (("token_type_ids", self.pad_token_type_id), ("special_tokens_mask", 1)):
            if key in encoded_inputs:
                encoded_inputs[key] = [fill] * n_pad + list(encoded_inputs[key])
        row = torch.tensor([encoded_inputs["input_ids"]])  # [1, s]
        pad_mask = torch.tensor([[0] * n_pad + [1] * len(ids)])  # [1, s], 1 = token
        # The official `_pad` looks for [MASK] before [gMASK] (the model does the opposite),
        # hence the two ids swapped in this call.
        encoded_inputs["position_ids"] = build_position_ids(
            row, bos_token_id=self.bos_token_id, gmask_token_id=self.mask_token_id,
            mask_token_id=self.gmask_token_id, pad_mask=pad_mask,
        )[0].numpy()  # [2, s]
        if return_attention_mask is not False:
            if self.glm_masks:
                mask = build_attention_mask(row, bos_token_id=self.bos_token_id, pad_mask=pad_mask)
                encoded_inputs["attention_mask"] = mask[0].numpy()  # [1, s, s] bool, True = blocked
            else:
                encoded_inputs["attention_mask"] = pad_mask[0].tolist()  # [s]
        return encoded_inputs

    def config_overrides(self) -> dict[str, int]:
        """The `ChatGLMConfig` fields that must match this tokenizer (vocab rounded up to a multiple of 64)."""
        return {
            "vocab_size": -(-len(self) // 64) * 64,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "mask_token_id": self.mask_token_id,
            "gmask_token_id": self.gmask_token_id,
            "pad_token_id": self.pad_token_id,
        }

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str]:
        return save_sentencepiece(self.sp_model, save_directory, filename_prefix, VOCAB_FILE)


def train_tokenizer(
    texts: Iterable[str],
    output_dir: str | Path,
    *,
    vocab_size: int = DEFAULT_TRAIN_VOCAB_SIZE,
    max_piece_length: int = 16,
) -> ChatGLMTokenizer:
    """Train a SentencePiece unigram model on `texts` with the special pieces and normalisation of
    `ice_text.model`, write a tokenizer directory to `output_dir` and return the tokenizer loaded from it.

    The special pieces sit at other ids than in the 6B layout (unk/<s>/</s>/<pad> = 0..3, then the
    CONTROL pieces, then `<n>`, `<|tab|>`, the blanks, then the 256 byte pieces); the tokenizer and
    `config_overrides()` read them from the model. Every character of the corpus gets its own piece
    (sentencepiece raises "Vocabulary size is smaller than required_chars" when `vocab_size` leaves no
    room for them); characters outside the corpus fall back to bytes. Single-threaded, deterministic.
    `max_piece_length=1` gives a character-level vocabulary: a span is then the same pieces inside a
    text and inside an answer, which a small model trained from scratch needs to learn to copy.
    """
    path = train_sentencepiece(
        (encode_whitespace(t) for t in texts), output_dir, VOCAB_FILE,
        vocab_size=vocab_size, max_sentencepiece_length=max_piece_length,
        normalization_rule_name="nmt_nfkc", add_dummy_prefix=True, remove_extra_whitespaces=True,
        unk_id=0, bos_id=1, eos_id=2, pad_id=3,
        unk_piece="<unk>", bos_piece="<s>", eos_piece="</s>", pad_piece="<pad>",
        control_symbols=list(CONTROL_PIECES), user_defined_symbols=[NEWLINE_PIECE, TAB_PIECE, *BLANK_PIECES],
    )
    ChatGLMTokenizer(path).save_pretrained(output_dir)
    return ChatGLMTokenizer.from_pretrained(output_dir)
