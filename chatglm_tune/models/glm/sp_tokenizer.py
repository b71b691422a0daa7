"""The ChatGLM2-6B and ChatGLM3-6B tokenizers (SentencePiece), and training a small one.

Reproduces the official THUDM `tokenization_chatglm.py` of ChatGLM2-6B (as run under transformers
4.27.1) and ChatGLM3-6B (4.40.2); golden outputs in `tests/fixtures/tokenizer-glm.json`:

- one SentencePiece model (`tokenizer.model`, 64789 pieces) for both, then special tokens after it:
  `[MASK]` 64789, `[gMASK]` 64790, `[sMASK]` 64791, `sop` 64792, `eop` 64793; ChatGLM3 adds
  `<|system|>` 64794, `<|user|>` 64795, `<|assistant|>` 64796, `<|observation|>` 64797. eos is
  `</s>` (2), pad is `<unk>` (0);
- `encode` is SentencePiece alone and puts `[gMASK] sop` first; no text typed in a string becomes a
  special token (`"<|user|>"`, `"sop"`, `"</s>"` stay text);
- `decode`: ChatGLM2 drops the special ids; ChatGLM3 renders them as their names without spaces
  (`"[gMASK]sop 你好"`: then SentencePiece's own leading space); both drop eos/bos/pad;
- padding is on the left with `attention_mask` and `position_ids` (0 on pads, 0..n-1 on tokens), as
  the official `_pad`;
- chat prompts: ChatGLM2 `build_prompt(query, history)`; ChatGLM3 `build_chat_input(query, history,
  role)` (role token, `metadata + "\\n"`, content; tools of a system message as indented JSON).

Record text is data: `encode_text` gives its ids with no prefix, never a special id.
Each class carries its version's prompt format (`prompt_format`, `formats.py`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import sentencepiece as spm
import torch
from transformers import BatchEncoding
from transformers.utils import PaddingStrategy

from chatglm_tune.models.glm.formats import CHATGLM2, CHATGLM3
from chatglm_tune.models.glm.tokenizer import GLMFamilyTokenizer, GLM_SPECIALS, ROLES, ROLE_SPECIALS, left_pad
from chatglm_tune.options import TINY_WORD_PIECES
from chatglm_tune.data.tokenizing import (keeps_single, piece_bytes, require_left_padding, save_sentencepiece,
                                          train_sentencepiece, word_runs)

SENTENCEPIECE_FILE = "tokenizer.model"


class _SentencePieceGLMTokenizer(GLMFamilyTokenizer):
    """What ChatGLM2 and ChatGLM3 share: SentencePiece, the `[gMASK] sop` prefix."""

    vocab_files_names = {"vocab_file": SENTENCEPIECE_FILE}
    specials: tuple[str, ...] = GLM_SPECIALS
    decodes_specials: bool = False  # ChatGLM3 renders specials in decode, ChatGLM2 drops them

    def __init__(self, vocab_file: str, padding_side: str = "left", clean_up_tokenization_spaces: bool = False,
                 **kwargs) -> None:
        require_left_padding(padding_side, "ChatGLM")
        kwargs.pop("auto_map", None)  # the official remote-code pointer: this class replaces it
        for key, expected in {"do_lower_case": False, "remove_space": False, "eos_token": "</s>",
                              "pad_token": "<unk>", "unk_token": "<unk>"}.items():
            if str(kwargs.pop(key, expected)) != str(expected):
                raise ValueError(f"{type(self).__name__} supports only {key}={expected!r}")
        self.vocab_file = vocab_file
        self.sp_model = spm.SentencePieceProcessor(model_file=str(vocab_file))
        n = self.sp_model.get_piece_size()
        self.special_ids = {token: n + i for i, token in enumerate(self.specials)}
        self._special_names = {i: token for token, i in self.special_ids.items()}
        # Ids that decode to nothing (official): eos, bos, and pad = unk.
        self._silent_ids = {self.sp_model.eos_id(), self.sp_model.bos_id(), self.sp_model.unk_id()}
        super().__init__(padding_side=padding_side, clean_up_tokenization_spaces=clean_up_tokenization_spaces,
                         eos_token="</s>", pad_token="<unk>", unk_token="<unk>", **kwargs)

    @property
    def vocab_size(self) -> int:
        return self.sp_model.get_piece_size() + len(self.specials)

    def get_vocab(self) -> dict[str, int]:
        pieces = self.sp_model.id_to_piece(list(range(self.sp_model.get_piece_size())))
        return {**{p: i for i, p in enumerate(pieces)}, **self.special_ids}

    def token_bytes(self) -> list[bytes | None]:
        """Each id's bytes in decoded text, by id (`▁` a space, `<0xXX>` its byte); None for the control and
        special tokens."""
        return [None if self.sp_model.is_control(i) or self.sp_model.is_unknown(i) else piece_bytes(self.sp_model, i)
                for i in range(self.sp_model.get_piece_size())] + [None] * len(self.specials)

    def tokenize(self, text: str, **kwargs) -> list[str]:
        # Officially no added token is split out of text: `</s>`, `<unk>`, `sop` typed stay text.
        return self._tokenize(text)

    def _tokenize(self, text: str, **kwargs) -> list[str]:
        return self.sp_model.encode(text, out_type=str)

    def _convert_token_to_id(self, token: str) -> int:
        return self.special_ids[token] if token in self.special_ids else self.sp_model.piece_to_id(token)

    def _convert_id_to_token(self, index: int) -> str:
        """Official: specials by name (ChatGLM3) or "" (ChatGLM2); eos/bos/pad and ids outside the vocabulary ""."""
        if index in self._special_names:
            return self._special_names[index] if self.decodes_specials else ""
        if index in self._silent_ids or not 0 <= index < self.sp_model.get_piece_size():
            return ""
        return self.sp_model.id_to_piece(index)

    def _decode(self, token_ids, skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool | None = None,
                **kwargs) -> str:
        ids = [int(token_ids)] if isinstance(token_ids, int) else [int(i) for i in token_ids]
        if skip_special_tokens:
            ids = [i for i in ids if i not in self._special_names]
        # SentencePiece decodes the pieces, names of specials included, as the official decode_tokens.
        text = self.sp_model.decode_pieces([self._convert_id_to_token(i) for i in ids])
        return self._cleaned(text, clean_up_tokenization_spaces)

    def encode_text(self, text: str) -> list[int]:
        """`text` as data: SentencePiece ids with no prefix (never a special id)."""
        return self.sp_model.encode(text)

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str]:
        return save_sentencepiece(self.sp_model, save_directory, filename_prefix, SENTENCEPIECE_FILE)


class ChatGLM2Tokenizer(_SentencePieceGLMTokenizer):
    """ChatGLM2-6B: decode drops the special tokens; the chat prompt is `build_prompt`."""

    prompt_format = CHATGLM2
    specials = GLM_SPECIALS
    decodes_specials = False

    @property
    def stop_token_ids(self) -> list[int]:
        return [self.eos_token_id]

    @staticmethod
    def build_prompt(query: str, history: list[tuple[str, str]] | None = None) -> str:
        """The official chat prompt: `[Round N]\\n\\n问：{query}\\n\\n答：` after the earlier rounds."""
        rounds = [f"[Round {i}]\n\n问：{q}\n\n答：{r}\n\n" for i, (q, r) in enumerate(history or [], 1)]
        return "".join(rounds) + f"[Round {len(history or []) + 1}]\n\n问：{query}\n\n答："


class ChatGLM3Tokenizer(_SentencePieceGLMTokenizer):
    """ChatGLM3-6B: four role tokens more, decode renders specials; the chat prompt is `build_chat_input`.

    `encode_special_tokens=True` (official option, off by default) makes role-token text typed in a
    string the role token; `encode_text` and the chat methods never do.
    """

    prompt_format = CHATGLM3
    specials = GLM_SPECIALS + ROLE_SPECIALS
    decodes_specials = True

    def __init__(self, vocab_file: str, encode_special_tokens: bool = False, **kwargs) -> None:
        self.encode_special_tokens = encode_special_tokens
        super().__init__(vocab_file, encode_special_tokens=encode_special_tokens, **kwargs)

    @property
    def stop_token_ids(self) -> list[int]:
        """The official chat stops on eos, `<|user|>` and `<|observation|>`."""
        return [self.eos_token_id, self.get_command("<|user|>"), self.get_command("<|observation|>")]

    def _tokenize(self, text: str, **kwargs) -> list[str]:
        if not self.encode_special_tokens:
            return self.sp_model.encode(text, out_type=str)
        pieces = []
        for part in re.split(f"({'|'.join(map(re.escape, ROLE_SPECIALS))})", text):
            pieces += [part] if part in ROLE_SPECIALS else (self.sp_model.encode(part, out_type=str) if part else [])
        return pieces

    def build_single_message(self, role: str, metadata: str, message: str) -> list[int]:
        """`<|role|>`, then `metadata + "\\n"` and `message` encoded apart, as data (official)."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        return [self.get_command(f"<|{role}|>"), *self.encode_text(f"{metadata}\n"), *self.encode_text(message)]

    def build_chat_input(self, query: str, history: list[dict] | None = None, role: str = "user") -> BatchEncoding:
        """The official chat input: `[gMASK] sop`, each history message (`role`, `content`, optional `metadata`;
        a system message's `tools` appended as indented JSON), the query as `role`, then `<|assistant|>`.
        Returns `input_ids`, `attention_mask`, `position_ids` as tensors [1, s]."""
        ids = []
        for item in history or []:
            content = item["content"]
            if item["role"] == "system" and "tools" in item:
                content = content + "\n" + json.dumps(item["tools"], indent=4, ensure_ascii=False)
            ids += self.build_single_message(item["role"], item.get("metadata", ""), content)
        ids += self.build_single_message(role, "", query) + [self.get_command("<|assistant|>")]
        row = left_pad({"input_ids": self.build_inputs_with_special_tokens(ids)}, self.pad_token_id, None,
                       PaddingStrategy.DO_NOT_PAD, None, None)
        return BatchEncoding({k: torch.tensor([v]) for k, v in row.items()})


SENTENCEPIECE_CLASSES = {"chatglm2": ChatGLM2Tokenizer, "chatglm3": ChatGLM3Tokenizer}


def train_glm_sentencepiece(texts, output_dir: str | Path, *, version: str = "chatglm3",
                            word_pieces: int = TINY_WORD_PIECES):
    """A small SentencePiece BPE model of `texts` in the official layout (unk 0, <s> 1, </s> 2, byte
    fallback), written with its tokenizer files to `output_dir`: the tokenizer of a tiny from-scratch
    ChatGLM2/3 (the real 64789-piece model is not needed to learn a small task). Every character of `texts`
    is a piece; up to `word_pieces` merges are learnt of the text outside CJK and digits (`word_runs`), so
    a Chinese word or a number is its characters wherever it stands."""
    texts = list(texts)
    characters = {char for text in texts for char in text}
    singles = "".join(sorted(char for char in characters if keeps_single(char)))
    path = train_sentencepiece(
        word_runs(texts) or [" "],  # a corpus of CJK and digits alone: no run to learn from, only its characters
        output_dir, SENTENCEPIECE_FILE, model_type="bpe", required_chars=singles,
        vocab_size=3 + 256 + len(characters) + word_pieces, max_sentencepiece_length=16, unk_id=0, bos_id=1, eos_id=2,
        pad_id=-1,
        # newlines and runs of spaces are data (an answer has one triple a line), as in the real model
        normalization_rule_name="identity", remove_extra_whitespaces=False, allow_whitespace_only_pieces=True,
    )
    tokenizer = SENTENCEPIECE_CLASSES[version](str(path))
    tokenizer.save_pretrained(output_dir)
    return tokenizer
