"""The ChatGLM2-6B and ChatGLM3-6B tokenizers (SentencePiece), and loading any GLM-family tokenizer.

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
`load_glm_tokenizer(directory)` reads an official ChatGLM2/ChatGLM3/GLM-4 directory, a
`glm-4-9b-chat-hf` one, or one written by `save_pretrained`, and returns the right tokenizer.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import sentencepiece as spm
import torch
from transformers import BatchEncoding, PreTrainedTokenizer
from transformers.utils import PaddingStrategy

from chatglm_tune.tokenizer import (
    pair_inputs,
    require_left_padding,
    save_sentencepiece,
    special_tokens_mask,
    train_sentencepiece,
)

SENTENCEPIECE_FILE = "tokenizer.model"
GLM_SPECIALS = ("[MASK]", "[gMASK]", "[sMASK]", "sop", "eop")
ROLES = ("system", "user", "assistant", "observation")
ROLE_SPECIALS = tuple(f"<|{role}|>" for role in ROLES)
VERSIONS = ("chatglm2", "chatglm3", "glm4")


def left_pad(
    encoded_inputs,
    pad_token_id: int,
    max_length: int | None,
    padding_strategy: PaddingStrategy,
    pad_to_multiple_of: int | None,
    padding_side: str | None,
) -> dict:
    """The official `_pad` of ChatGLM2/3 and GLM-4 for one row: `attention_mask` [s] (1 = token) and
    `position_ids` [s] (0..n-1 on the tokens) are added when missing, then the row is padded on the
    left with `pad_token_id`, 0 in both."""
    if padding_side not in (None, "left"):
        raise ValueError(f"GLM prompts must be left-padded, got padding_side={padding_side!r}")
    ids = list(encoded_inputs["input_ids"])
    if padding_strategy == PaddingStrategy.LONGEST:
        max_length = len(ids)
    if max_length is not None and pad_to_multiple_of is not None and max_length % pad_to_multiple_of:
        max_length = (max_length // pad_to_multiple_of + 1) * pad_to_multiple_of
    if "attention_mask" not in encoded_inputs:
        encoded_inputs["attention_mask"] = [1] * len(ids)
    if "position_ids" not in encoded_inputs:
        encoded_inputs["position_ids"] = list(range(len(ids)))
    if padding_strategy != PaddingStrategy.DO_NOT_PAD and max_length is not None and len(ids) < max_length:
        n_pad = max_length - len(ids)
        encoded_inputs["input_ids"] = [pad_token_id] * n_pad + ids
        for key, fill in (("attention_mask", 0), ("position_ids", 0), ("special_tokens_mask", 1)):
            if key in encoded_inputs:
                encoded_inputs[key] = [fill] * n_pad + list(encoded_inputs[key])
    return encoded_inputs


class GLMFamilyTokenizer(PreTrainedTokenizer):
    """What every ChatGLM2/3 and GLM-4 tokenizer shares: its special tokens by text (`special_ids`, set by
    the subclass), and the official left padding with 1D positions (`left_pad`)."""

    model_input_names = ["input_ids", "attention_mask", "position_ids"]
    padding_side = "left"
    special_ids: dict[str, int]
    prefix_texts: tuple[str, str] = ("[gMASK]", "sop")  # what every encode starts with (GLM-4: <sop>)

    def get_prefix_tokens(self) -> list[int]:
        return [self.get_command(t) for t in self.prefix_texts]

    def _cleaned(self, text: str, clean_up_tokenization_spaces: bool | None) -> str:
        """A decode's text, with transformers' clean-up where asked (None: the tokenizer's setting)."""
        clean = self.clean_up_tokenization_spaces if clean_up_tokenization_spaces is None else clean_up_tokenization_spaces
        return self.clean_up_tokenization(text) if clean else text

    def build_inputs_with_special_tokens(self, token_ids_0: list[int], token_ids_1: list[int] | None = None) -> list[int]:
        """`[gMASK] sop a`, or `[gMASK] sop a b <eos>` for a pair (official)."""
        return pair_inputs(self.get_prefix_tokens() + token_ids_0, token_ids_1, self.eos_token_id)

    def get_special_tokens_mask(self, token_ids_0, token_ids_1=None, already_has_special_tokens=False) -> list[int]:
        if already_has_special_tokens:
            return [int(i in self.special_token_ids) for i in token_ids_0]
        return special_tokens_mask(self.build_inputs_with_special_tokens, token_ids_0, token_ids_1)

    def get_command(self, token: str) -> int:
        """The id of a special token by its official text (`"[gMASK]"`, `"sop"`, `"<|user|>"`)."""
        if token not in self.special_ids:
            raise KeyError(f"{token!r} is not a special token of {type(self).__name__}")
        return self.special_ids[token]

    @property
    def special_token_ids(self) -> frozenset[int]:
        return frozenset(self.special_ids.values())

    def _pad(self, encoded_inputs, max_length=None, padding_strategy=PaddingStrategy.DO_NOT_PAD,
             pad_to_multiple_of=None, padding_side=None, return_attention_mask=None) -> dict:
        return left_pad(encoded_inputs, self.pad_token_id, max_length, padding_strategy, pad_to_multiple_of, padding_side)


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

    version = "chatglm2"
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

    version = "chatglm3"
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
# tokenizer_class values that name the version outright (ours, and GLM-4's official class).
CLASS_VERSIONS = {"ChatGLM2Tokenizer": "chatglm2", "ChatGLM3Tokenizer": "chatglm3",
                  "GLM4Tokenizer": "glm4", "ChatGLM4Tokenizer": "glm4"}


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def detect_tokenizer_version(directory: str | Path) -> str:
    """Which tokenizer a directory holds: "chatglm" (ChatGLM-6B v1, `ice_text.model`), "chatglm2",
    "chatglm3" or "glm4", from tokenizer_config.json's class and the files. The official ChatGLM2 and
    ChatGLM3 directories differ only in their name (`name_or_path`, or config.json `_name_or_path`)."""
    from chatglm_tune.glm4_tokenizer import TOKENIZER_FILE, is_tiktoken_file

    directory = Path(directory)
    config = _read_json(directory / "tokenizer_config.json")
    if config.get("tokenizer_class") in CLASS_VERSIONS:
        return CLASS_VERSIONS[config["tokenizer_class"]]
    if (directory / "ice_text.model").is_file():
        return "chatglm"
    model_file = directory / SENTENCEPIECE_FILE
    if model_file.is_file() and is_tiktoken_file(model_file):
        return "glm4"
    if (directory / TOKENIZER_FILE).is_file():
        added = {t.get("content") for t in _read_json(directory / TOKENIZER_FILE).get("added_tokens", [])}
        if {"[gMASK]", "<sop>", "<|user|>"} <= added:
            return "glm4"
    if model_file.is_file():
        names = [str(config.get(k, "")) for k in ("name_or_path", "_name_or_path")]
        names.append(str(_read_json(directory / "config.json").get("_name_or_path", "")))
        found = {v for v in ("chatglm2", "chatglm3") for name in names if v in name.lower()}
        if "<|user|>" in json.dumps(config, ensure_ascii=False):  # later ChatGLM3 configs list the role tokens
            found.add("chatglm3")
        if len(found) == 1:
            return found.pop()
        raise ValueError(
            f"{directory}: a SentencePiece tokenizer.model, but nothing tells ChatGLM2 from ChatGLM3 "
            f"(tokenizer_config.json name_or_path is {config.get('name_or_path')!r}); pass version='chatglm2' "
            "or 'chatglm3'"
        )
    raise ValueError(
        f"{directory} is not a ChatGLM2/ChatGLM3/GLM-4 tokenizer directory: expected tokenizer.model "
        "(SentencePiece or tiktoken) or tokenizer.json, with tokenizer_config.json"
    )


def load_glm_tokenizer(directory: str | Path, version: str | None = None, **kwargs):
    """The tokenizer of a ChatGLM2, ChatGLM3 or GLM-4 directory (official, `-hf`, or saved by
    `save_pretrained`); `version` overrides detection. `kwargs` override tokenizer_config.json."""
    from chatglm_tune.glm4_tokenizer import TIKTOKEN_FILE, TOKENIZER_FILE, GLM4Tokenizer, glm4_config_kwargs

    directory = Path(directory)
    if not directory.is_dir():
        raise ValueError(f"{directory} is not a directory")
    version = version or detect_tokenizer_version(directory)
    if version == "chatglm":
        raise ValueError(f"{directory} holds a ChatGLM-6B (v1) tokenizer: load it with chatglm_tune.tokenizer")
    if version not in VERSIONS:
        raise ValueError(f"version must be one of {VERSIONS}, got {version!r}")
    if version == "glm4":
        files = {"tokenizer_file": directory / TOKENIZER_FILE, "vocab_file": directory / TIKTOKEN_FILE}
        files = {k: str(p) for k, p in files.items() if p.is_file()}
        if "tokenizer_file" in files:  # converted already: prefer it to a rank file beside it
            files.pop("vocab_file", None)
        return GLM4Tokenizer(**files, **{**glm4_config_kwargs(directory), **kwargs})
    if not (directory / SENTENCEPIECE_FILE).is_file():
        raise ValueError(f"{directory} has no {SENTENCEPIECE_FILE} for a {version} tokenizer")
    return SENTENCEPIECE_CLASSES[version].from_pretrained(str(directory), **kwargs)


def train_glm_sentencepiece(texts, output_dir: str | Path, *, version: str = "chatglm3", vocab_size: int = 4000):
    """A small character-level SentencePiece model of `texts` in the official layout (unk 0, <s> 1,
    </s> 2, byte fallback), written with its tokenizer files to `output_dir`: the tokenizer of a tiny
    from-scratch ChatGLM2/3 (the real 64789-piece model is not needed to learn a small task)."""
    path = train_sentencepiece(
        texts, output_dir, SENTENCEPIECE_FILE, vocab_size=vocab_size, max_sentencepiece_length=1,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        # newlines and runs of spaces are data (an answer has one triple a line), as in the real model
        normalization_rule_name="identity", remove_extra_whitespaces=False, allow_whitespace_only_pieces=True,
    )
    tokenizer = SENTENCEPIECE_CLASSES[version](str(path))
    tokenizer.save_pretrained(output_dir)
    return tokenizer
