"""The GLM-4-9B tokenizer: byte-level BPE from its tiktoken rank file, exact to the official one.

Reproduces the official `ChatGLM4Tokenizer` (THUDM glm-4-9b-chat `tokenization_chatglm.py`) as run
under transformers 4.44.2; golden outputs in `tests/fixtures/tokenizer-glm.json` (`glm4`):

- the vocabulary is `tokenizer.model`, a tiktoken BPE file (base64 token, rank per line; 151329
  ranks), plus the special tokens of `tokenizer_config.json` after it (`<|endoftext|>` 151329 = eos
  and pad, `[gMASK]` 151331, `<sop>` 151333, `<|user|>` 151336, ...);
- text is split on special-token text first (transformers' added-token splitting: `"<|user|>"` typed
  in a string IS the special token, as officially), then each piece is pre-tokenized with GLM-4's
  regex and byte-level BPE-encoded; `encode` puts `[gMASK] <sop>` first;
- `decode` joins runs of text bytes (UTF-8, invalid bytes replaced) and the special tokens with a
  space between them (`spaces_between_special_tokens`): `"[gMASK] <sop> 你好"`;
- padding is on the left with `<|endoftext|>`, and returns `attention_mask` and `position_ids`
  (0 on pads, 0..n-1 on tokens) as the official `_pad`;
- `apply_chat_template` is transformers' own (its `tojson` keeps non-ASCII text, as the official).

Record text is data: `encode_text`, `build_single_message` and `encode_chat` never turn text into a
special token (`encode_chat` is the chat template with only the template's own tokens special).

`train_glm4_bpe` writes a small GLM-4 tokenizer for the tiny from-scratch model (`--model tiny-glm4`)
in these same files: a rank file of a byte-level BPE trained here on a corpus with GLM-4's regex, and
the official special tokens right after its ranks, so it loads like a real GLM-4 directory.

Why no tiktoken: the BPE runs in `tokenizers` (Rust, already a transformers dependency). The rank
file is read here (it is just base64 + rank) and turned into a BPE by transformers'
`TikTokenConverter` (whose only use of tiktoken is that file reader): every split of a token into
two tokens becomes a merge ranked by the token, and `ignore_merges` takes whole-vocabulary words
directly as tiktoken does, so the lowest-rank-first merging is tiktoken's. The same code serves the
released `glm-4-9b-chat-hf` directories (their `tokenizer.json` is that BPE), and `save_pretrained`
writes `tokenizer.json`, so a run directory loads without converting again.
"""

from __future__ import annotations

import base64
import json
import re
from collections import Counter
from pathlib import Path

from tokenizers import Tokenizer
from transformers.convert_slow_tokenizer import TikTokenConverter, bytes_to_unicode

from chatglm_tune.data.tokenizing import require_left_padding, vocabulary_path, word_runs
from chatglm_tune.models.glm.agent_format import GLM4_MOE, GLM4_MOE_LITE, GLM5, GLM47, GLM52, GLM53_FLASH
from chatglm_tune.models.glm.glm5_templates import (GLM5_TEMPLATE, GLM51_TEMPLATE, GLM52_TEMPLATE, GLM53_FLASH_TEMPLATE,
                                                    writes_effort_line)
from chatglm_tune.models.glm.formats import GLM4, GLM4_0414, GLM_EDGE
from chatglm_tune.models.glm.moe_templates import GLM4_MOE_LITE_TEMPLATE, GLM4_MOE_TEMPLATE, MOE_SPECIALS, glm47_form
from chatglm_tune.models.glm.tokenizer import ROLES, GLMFamilyTokenizer
from chatglm_tune.options import TINY_GLM4_VOCAB

TIKTOKEN_FILE = "tokenizer.model"
TOKENIZER_FILE = "tokenizer.json"
# The pre-tokenizer regex of the official ChatGLM4Tokenizer (= TikTokenConverter's default).
GLM4_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
EOS_TOKEN = "<|endoftext|>"
# The official special tokens, in their order after the ranks (tokenizer_config.json's added_tokens_decoder).
OFFICIAL_SPECIALS = (EOS_TOKEN, "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", *(f"<|{role}|>" for role in ROLES),
                     "<|begin_of_image|>", "<|end_of_image|>", "<|begin_of_video|>", "<|end_of_video|>")
# The official chat template with its function tools (the fixed prompts of its python, simple_browser and cogview
# tools are left out: a tiny tokenizer is not trained for them, and such a tool is refused rather than dropped).
OFFICIAL_SYSTEM_PROMPT = ("你是一个名为 ChatGLM 的人工智能助手。你是基于智谱AI训练的语言模型 GLM-4 模型开发的，"
                          "你的任务是针对用户的问题和要求提供适当的答复和支持。")
TOOL_PROMPT_TEXT = (OFFICIAL_SYSTEM_PROMPT
                    + "\n\n# 可用工具\n\n## \n\n在调用上述函数时，请使用 Json 格式表示调用的参数。")  # what it writes
FUNCTION_TOOLS_CHAT_TEMPLATE = (
    "[gMASK]<sop>{% for item in messages %}{% if item['tools'] is defined %}<|system|>\n" + OFFICIAL_SYSTEM_PROMPT
    + "\n\n# 可用工具{% set tools = item['tools'] %}{% for tool in tools %}{% if tool['type'] == 'function' %}\n\n"
    "## {{ tool['function']['name'] }}\n\n{{ tool['function'] | tojson(indent=4) }}\n"
    "在调用上述函数时，请使用 Json 格式表示调用的参数。{% else %}"
    "{{ raise_exception('this GLM-4 tokenizer takes function tools only, not ' ~ tool['type']) }}{% endif %}"
    "{% endfor %}{% endif %}{% if item['content'] %}<|{{ item['role'] }}|>{{ item['metadata'] }}\n{{ item['content'] }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# Special tokens the toolkit relies on; their ids are read from the tokenizer files.
REQUIRED_SPECIALS = (EOS_TOKEN, "[gMASK]", "<sop>", *(f"<|{role}|>" for role in ROLES))
# Private-use characters that mark special-token text inside data strings in `encode_chat`.
DATA_OPEN, DATA_CLOSE = "\ue0f1", "\ue0f2"
_BYTE_OF_CHAR = {char: byte for byte, char in bytes_to_unicode().items()}


def read_tiktoken_ranks(path: str | Path) -> dict[bytes, int]:
    """A tiktoken BPE file (one `base64(token) rank` per line) as {token bytes: rank}."""
    ranks = {}
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            fields = line.split()
            if len(fields) != 2 or not fields[1].isdigit():
                raise ValueError(f"{path} line {number}: expected 'base64-token rank', got {line[:80]!r}")
            ranks[base64.b64decode(fields[0], validate=True)] = int(fields[1])
    return ranks


def is_tiktoken_file(path: str | Path) -> bool:
    """True when `path` starts like a tiktoken rank file (a SentencePiece model is binary protobuf)."""
    with open(path, "rb") as f:
        first = f.readline(256).split()
    try:
        return len(first) == 2 and first[1].isdigit() and bool(base64.b64decode(first[0], validate=True))
    except ValueError:
        return False


class _RankFileConverter(TikTokenConverter):
    """transformers' converter, reading the rank file here instead of through tiktoken."""

    @staticmethod
    def load_tiktoken_bpe(tiktoken_url: str) -> dict[bytes, int]:
        return read_tiktoken_ranks(tiktoken_url)


def convert_tiktoken_file(path: str | Path, specials: dict[int, str]) -> Tokenizer:
    """The BPE of a tiktoken rank file as a `tokenizers.Tokenizer`, with `specials` ({id: text}) added
    as special tokens right after the ranks (they must be numbered on from the last rank)."""
    with open(path, "rb") as f:
        n_ranks = sum(1 for line in f if line.strip())
    expected = list(range(n_ranks, n_ranks + len(specials)))
    if sorted(specials) != expected:
        raise ValueError(f"special token ids {sorted(specials)} of {path} do not follow its {n_ranks} ranks")
    names = [specials[i] for i in expected]
    converter = _RankFileConverter(str(path), pattern=GLM4_PATTERN, extra_special_tokens=names)
    return converter.converted()


def added_tokens_of(tokenizer: Tokenizer) -> dict[int, str]:
    """{id: text} of the special tokens a `tokenizers.Tokenizer` carries."""
    return {i: t.content for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}


class GLM4Tokenizer(GLMFamilyTokenizer):
    """GLM-4 tokenizer over a tiktoken rank file (`vocab_file`) or a `tokenizer.json` (`tokenizer_file`).

    With a rank file, the special tokens come from `added_tokens_decoder` (the official
    tokenizer_config.json); a `tokenizer.json` carries its own. Padding is on the left.
    """

    vocab_files_names = {"vocab_file": TIKTOKEN_FILE, "tokenizer_file": TOKENIZER_FILE}
    prefix_texts = ("[gMASK]", "<sop>")
    prompt_format = GLM4
    chat_roles = ROLES  # the roles its chat template writes
    special_token_spaces = True  # a decode puts a space between special tokens and text (GLM-4-9B's slow tokenizer)

    def __init__(
        self,
        vocab_file: str | None = None,
        tokenizer_file: str | None = None,
        padding_side: str = "left",
        clean_up_tokenization_spaces: bool = False,
        eos_token: str = EOS_TOKEN,
        pad_token: str = EOS_TOKEN,
        **kwargs,
    ) -> None:
        require_left_padding(padding_side, "GLM-4")
        for key in ("auto_map", "additional_special_tokens", "extra_special_tokens", "tokenizer_object"):
            kwargs.pop(key, None)  # the remote-code pointer; the specials are read from the files below
        for key, expected in {"do_lower_case": False, "remove_space": False}.items():
            if kwargs.pop(key, expected) != expected:
                raise ValueError(f"GLM4Tokenizer supports only {key}={expected}")
        declared = {int(i): _token_text(t) for i, t in (kwargs.get("added_tokens_decoder") or {}).items()}
        if tokenizer_file is not None and Path(tokenizer_file).is_file():
            backend = Tokenizer.from_file(str(tokenizer_file))
            source = tokenizer_file
        elif vocab_file is not None and Path(vocab_file).is_file():
            backend = convert_tiktoken_file(vocab_file, declared)
            source = vocab_file
        else:
            raise ValueError(f"GLM4Tokenizer needs a {TIKTOKEN_FILE} rank file or a {TOKENIZER_FILE}, got "
                             f"vocab_file={vocab_file!r}, tokenizer_file={tokenizer_file!r}")
        specials = added_tokens_of(backend)
        missing = [t for t in REQUIRED_SPECIALS if t not in specials.values()]
        clash = {i: t for i, t in declared.items() if specials.get(i) != t}
        if missing or clash:
            raise ValueError(f"{source} is not a GLM-4 tokenizer: special tokens missing {missing}, "
                             f"or at other ids than tokenizer_config.json says {clash}")
        # `backend` (with the specials) is what save_pretrained writes; `_bpe` is the same BPE without them,
        # for the text between special tokens and for data text.
        self._backend = backend
        self._bpe = Tokenizer(backend.model)
        self._bpe.normalizer = backend.normalizer
        self._bpe.pre_tokenizer = backend.pre_tokenizer
        self._vocab = {t: i for t, i in backend.get_vocab(with_added_tokens=False).items() if i not in specials}
        self._tokens = {i: t for t, i in self._vocab.items()}
        self.special_ids = {t: i for i, t in specials.items()}
        self._special_re = re.compile("|".join(map(re.escape, sorted(self.special_ids, key=len, reverse=True))))
        self.vocab_file = vocab_file
        kwargs["added_tokens_decoder"] = {i: t for i, t in backend.get_added_tokens_decoder().items()}
        super().__init__(
            padding_side=padding_side,
            clean_up_tokenization_spaces=clean_up_tokenization_spaces,
            eos_token=eos_token,
            pad_token=pad_token,
            extra_special_tokens=[t for t in specials.values() if t not in (eos_token, pad_token)],
            **kwargs,
        )

    # ----- vocabulary -------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """The BPE ranks (151329 for GLM-4), without the special tokens after them (official)."""
        return len(self._vocab)

    def get_vocab(self) -> dict[str, int]:
        return {**self._vocab, **self.special_ids}

    @property
    def stop_token_ids(self) -> list[int]:
        """The official chat stops on `<|endoftext|>`, `<|user|>` and `<|observation|>`."""
        return [self.get_command(t) for t in (EOS_TOKEN, "<|user|>", "<|observation|>")]

    def _tokenize(self, text: str, **kwargs) -> list[str]:
        return self._bpe.encode(text, add_special_tokens=False).tokens

    def _convert_token_to_id(self, token: str) -> int:
        if token in self.special_ids:
            return self.special_ids[token]
        if token not in self._vocab:
            raise KeyError(f"{token!r} is not in the GLM-4 vocabulary")
        return self._vocab[token]

    def _convert_id_to_token(self, index: int) -> str:
        return self._tokens.get(index, "")

    def token_bytes(self) -> list[bytes | None]:
        """Each id's bytes in decoded text, by id; None for the special tokens (and the ids they leave free)."""
        return [bytes(_BYTE_OF_CHAR[c] for c in self._tokens[i]) if i in self._tokens else None
                for i in range(max(self._tokens.keys() | self.special_ids.values()) + 1)]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        data = bytes(_BYTE_OF_CHAR[c] for token in tokens for c in token)
        return data.decode("utf-8", errors="replace")

    # ----- encoding ---------------------------------------------------------------------------------
    def encode_text(self, text: str) -> list[int]:
        """`text` as data: BPE ids with no prefix, special-token text staying text."""
        return self._bpe.encode(text, add_special_tokens=False).ids

    def build_single_message(self, role: str, metadata: str, message: str, tokenize: bool = True) -> list[int] | str:
        """The official one-message block: `<|role|>` then `metadata + "\\n"` and the message as data text."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        if not tokenize:
            return f"<|{role}|>{metadata}\n{message}"
        return [self.get_command(f"<|{role}|>"), *self.encode_text(f"{metadata}\n"), *self.encode_text(message)]

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None, **template_kwargs) -> list[int]:
        """The chat template's ids with every string of `messages` and `tools` as data (only the template's
        own special tokens are special). Equals `apply_chat_template(messages, tokenize=True)` when no
        string holds special-token text; where one does, that text is BPE-encoded with its neighbours as
        plain text. Roles must be official (the template builds `<|role|>` from them); `template_kwargs` go to
        the template (GLM-4.5's `enable_thinking`)."""
        return self.encode_marked(self.render_marked(messages, add_generation_prompt, tools, **template_kwargs))

    def render_marked(self, messages: list[dict], add_generation_prompt: bool = True,
                      tools: list[dict] | None = None, **template_kwargs) -> str:
        """The chat template's text with the special-token text of every string of `messages` and `tools` marked
        as data (`DATA_OPEN` ... `DATA_CLOSE`): what `encode_marked` encodes, or cuts at the template's own special
        tokens first (`special_spans`)."""
        for message in messages:
            if message.get("role") not in self.chat_roles:
                raise ValueError(f"role must be one of {self.chat_roles}, got {message.get('role')!r}")
        return self.apply_chat_template(
            _mark_specials(messages, self._special_re), add_generation_prompt=add_generation_prompt,
            tools=_mark_specials(tools, self._special_re), tokenize=False, **template_kwargs,
        )

    def special_spans(self, marked: str) -> list[tuple[int, int]]:
        """(start, end) of each special token the template wrote in a `render_marked` text (marked data skipped)."""
        return [m.span() for m in re.finditer(f"{DATA_OPEN}[^{DATA_CLOSE}]*{DATA_CLOSE}|{self._special_re.pattern}",
                                              marked) if not m.group().startswith(DATA_OPEN)]

    def encode_marked(self, marked: str) -> list[int]:
        """The ids of a `render_marked` text (or a piece of one cut at its special tokens): only unmarked special-token
        text (written by the template) splits the string."""
        ids, start = [], 0
        for begin, end in self.special_spans(marked):
            ids += self.encode_text(_unmark(marked[start:begin]))
            ids.append(self.special_ids[marked[begin:end]])
            start = end
        return ids + self.encode_text(_unmark(marked[start:]))

    # ----- decoding and padding ---------------------------------------------------------------------
    def _decode(
        self,
        token_ids,
        skip_special_tokens: bool = False,
        clean_up_tokenization_spaces: bool | None = None,
        spaces_between_special_tokens: bool | None = None,
        **kwargs,
    ) -> str:
        """Runs of text tokens decode together; special tokens render as their text, joined to the runs
        with a space (official, transformers 4.44's slow `_decode`) where `spaces_between_special_tokens` (default:
        the class's `special_token_spaces`: none for the versions released with a `tokenizer.json`, as transformers'
        fast tokenizer decodes them)."""
        if spaces_between_special_tokens is None:
            spaces_between_special_tokens = self.special_token_spaces
        ids = [int(token_ids)] if isinstance(token_ids, int) else [int(i) for i in token_ids]
        parts, run = [], []
        for i in ids:
            if i in self.special_token_ids:
                if skip_special_tokens:
                    continue
                if run:
                    parts.append(self.convert_tokens_to_string(run))
                    run = []
                parts.append(self._backend.id_to_token(i))
            elif i in self._tokens:
                run.append(self._tokens[i])
            # ids past the vocabulary (the model pads it to 151552) decode to nothing
        if run:
            parts.append(self.convert_tokens_to_string(run))
        text = (" " if spaces_between_special_tokens else "").join(parts)
        return self._cleaned(text, clean_up_tokenization_spaces)

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str]:
        path = vocabulary_path(save_directory, filename_prefix, TOKENIZER_FILE)
        self._backend.save(str(path))
        return (str(path),)


class GLM40414Tokenizer(GLM4Tokenizer):
    """GLM-4-0414's (and GLM-Z1's) tokenizer: GLM-4's BPE and special tokens in a `tokenizer.json`, its own chat
    template."""

    prompt_format = GLM4_0414
    special_token_spaces = False  # released with a tokenizer.json: transformers' fast tokenizer decodes it


class GLMEdgeTokenizer(GLM4Tokenizer):
    """GLM-Edge's tokenizer: a smaller byte-level BPE with GLM-4's special tokens after it, in a `tokenizer.json`;
    its chat template starts a prompt with the first role token, so an encode adds no `[gMASK] <sop>`."""

    prefix_texts = ()
    prompt_format = GLM_EDGE
    special_token_spaces = False


def _token_text(token) -> str:
    """The text of an added token as tokenizer_config.json (a dict) or transformers (AddedToken) holds it."""
    return str(token["content"] if isinstance(token, dict) else getattr(token, "content", token))


def _mark_specials(value, special_re: re.Pattern):
    """Every string inside `value` with its special-token text wrapped in DATA_OPEN/DATA_CLOSE."""
    if isinstance(value, str):
        if DATA_OPEN in value or DATA_CLOSE in value:
            raise ValueError(f"text holds the private-use marker characters U+E0F1/U+E0F2: {value[:80]!r}")
        return special_re.sub(lambda m: f"{DATA_OPEN}{m.group()}{DATA_CLOSE}", value)
    if isinstance(value, dict):
        return {key: _mark_specials(v, special_re) for key, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_mark_specials(v, special_re) for v in value]
    return value


def _unmark(text: str) -> str:
    return text.replace(DATA_OPEN, "").replace(DATA_CLOSE, "")


class _MoeFormat:
    """`GLM4MoeTokenizer.prompt_format`: GLM-4.7's (`agent_format.GLM47`) for a tokenizer whose chat template has
    GLM-4.7's form (`moe_templates.glm47_form`), read at each use; else, and on the class, GLM-4.5's."""

    def __get__(self, tokenizer, owner=None):
        return moe_format(getattr(tokenizer, "chat_template", None) if tokenizer is not None else None)


def moe_format(chat_template):
    """The prompt format of a `glm4_moe` tokenizer with `chat_template`: GLM-4.7's for GLM-4.7's form, else
    GLM-4.5's."""
    return GLM47 if glm47_form(chat_template) else GLM4_MOE


class GLM4MoeTokenizer(GLM4Tokenizer):
    """GLM-4.5 / 4.6 / 4.7's tokenizer: GLM-4's BPE, its special tokens and the thinking and tool tokens after them
    (`moe_templates.MOE_SPECIALS`), in a `tokenizer.json`; its own chat template, GLM-4.5's form (GLM-4.5, 4.6) or
    GLM-4.7's (GLM-4.7), which its prompt format follows (`_MoeFormat`)."""

    prompt_format = _MoeFormat()
    special_token_spaces = False
    chat_roles = (*ROLES, "tool")  # its template writes a tool message's result (`<|observation|>`)


class GLM4MoeLiteTokenizer(GLM4MoeTokenizer):
    """GLM-4.7-Flash's tokenizer: as GLM-4.5's, with GLM-4.7's chat template form."""

    prompt_format = GLM4_MOE_LITE


def glm5_format(chat_template):
    """The prompt format of a `glm_moe_dsa` tokenizer with `chat_template`: GLM-5.2's where it writes a
    reasoning-effort line, else GLM-5's (GLM-5, GLM-5.1)."""
    return GLM52 if writes_effort_line(chat_template) else GLM5


class _Glm5Format:
    """`GLM5Tokenizer.prompt_format`: `glm5_format` of the tokenizer's chat template, read at each use."""

    def __get__(self, tokenizer, owner=None):
        return glm5_format(getattr(tokenizer, "chat_template", None) if tokenizer is not None else None)


# The versions whose tokenizer's prompt format follows its chat template's form.
TEMPLATE_FORMATS = {"glm4-moe": moe_format, "glm5": glm5_format}


class GLM5Tokenizer(GLM4MoeTokenizer):
    """GLM-5 / 5.1 / 5.2's tokenizer: as GLM-4.5's, with the release's chat template, whose form its prompt format
    follows (`glm5_format`)."""

    prompt_format = _Glm5Format()


class GLM53FlashTokenizer(GLM4MoeTokenizer):
    """GLM-5.3-Flash's tokenizer: as GLM-4.5's (its special tokens in the same order), with its own chat template."""

    prompt_format = GLM53_FLASH


TOKENIZER_CLASSES = {"glm4": GLM4Tokenizer, "glm4-0414": GLM40414Tokenizer, "glm-edge": GLMEdgeTokenizer,
                     "glm4-moe": GLM4MoeTokenizer, "glm4-moe-lite": GLM4MoeLiteTokenizer, "glm5": GLM5Tokenizer,
                     "glm53-flash": GLM53FlashTokenizer}


def load_glm4_tokenizer(directory: Path, version: str = "glm4", **kwargs) -> GLM4Tokenizer:
    """The tokenizer of a GLM-4, GLM-4-0414 or GLM-Edge directory (`version`): its tokenizer.json when converted
    already (preferred to a rank file beside it), else its tiktoken rank file; `kwargs` override
    tokenizer_config.json."""
    files = {"tokenizer_file": directory / TOKENIZER_FILE, "vocab_file": directory / TIKTOKEN_FILE}
    files = {k: str(p) for k, p in files.items() if p.is_file()}
    if "tokenizer_file" in files:
        files.pop("vocab_file", None)
    return TOKENIZER_CLASSES[version](**files, **{**glm4_config_kwargs(directory), **kwargs})


def glm4_config_kwargs(directory: Path) -> dict:
    """tokenizer_config.json's fields for `GLM4Tokenizer` (chat template included, from
    chat_template.jinja when the template was saved apart)."""
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
    template = directory / "chat_template.jinja"
    if "chat_template" not in config and template.is_file():
        config["chat_template"] = template.read_text(encoding="utf-8")
    for key in ("tokenizer_class", "name_or_path", "model_input_names", "tokenizer_file", "vocab_file"):
        config.pop(key, None)
    return config


# ----- a small GLM-4 tokenizer, trained here ------------------------------------------------------
def train_glm4_bpe(texts, output_dir: str | Path, *, vocab_size: int = TINY_GLM4_VOCAB, word_pieces: int = 0,
                   specials: tuple[str, ...] = OFFICIAL_SPECIALS) -> GLM4Tokenizer:
    """A small byte-level BPE of `texts` in GLM-4's layout, written to `output_dir` as a real GLM-4
    directory holds it (`tokenizer.model` ranks, tokenizer_config.json with the official special tokens at
    their official offsets after the ranks) and loaded back from there: the tokenizer of a tiny
    from-scratch GLM-4 (the real 151329 ranks are not needed to learn a small task).

    `vocab_size` counts ranks; every byte and every character of `texts` is one token whatever it says,
    so a corpus of many characters gets more (see `bpe_ranks`); `word_pieces` more ranks of text outside CJK
    and digits (`tokenizing.word_runs`). `specials`: the special tokens after the ranks."""
    if vocab_size < 256:
        raise ValueError(f"vocab_size must be >= 256 (every byte is a rank), got {vocab_size}")
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    ranks = bpe_ranks([t for t in texts if t], vocab_size, word_pieces)
    with open(output_dir / TIKTOKEN_FILE, "wb") as f:
        f.writelines(base64.b64encode(token) + b" %d\n" % rank for rank, token in enumerate(ranks))
    config = glm4_tokenizer_config(len(ranks), specials)
    (output_dir / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=2),
                                                      encoding="utf-8")
    return load_glm4_tokenizer(output_dir)


# The chat templates of the released GLM-4-0414 and GLM-Edge directories, in small: GLM-4-0414's starts with
# `[gMASK]<sop>`, writes the `tools` it is given as a system block before the messages (the release's "# 可用工具"
# with each function as indented JSON), a call as an assistant message whose `metadata` names the tool
# (`<|assistant|>name` "\n" arguments), a result as an `observation`, and ends its generation prompt with "\n";
# GLM-Edge's starts with the first role token, has no tool form and always ends with `<|assistant|>`. The
# mixture-of-experts versions' as released (`moe_templates`).
RELEASED_CHAT_TEMPLATES = {
    "glm4-0414": ("[gMASK]<sop>{%- if tools -%}<|system|>\n# 可用工具{%- for tool in tools -%}"
                  "{%- set function = tool['function'] if tool['function'] is defined else tool -%}"
                  "{{ '\\n\\n## ' ~ function['name'] ~ '\\n\\n' ~ (function | tojson(indent=4)) }}"
                  "{{ '\\n在调用上述函数时，请使用 Json 格式表示调用的参数。' }}{%- endfor -%}{%- endif -%}"
                  "{%- for m in messages %}{%- if m['role'] == 'assistant' and m['metadata'] is defined and "
                  "m['metadata'] %}<|assistant|>{{ m['metadata'] }}\n{{ m['content'] }}"
                  "{%- else %}<|{{ m['role'] }}|>\n{{ m['content'] }}{%- endif %}{%- endfor %}"
                  "{%- if add_generation_prompt %}<|assistant|>\n{% endif %}"),
    "glm-edge": ("{% for item in messages %}{% if item['role'] == 'system' %}<|system|>\n{{ item['content'] }}"
                 "{% elif item['role'] == 'user' %}<|user|>\n{{ item['content'] }}{% elif item['role'] == 'assistant' "
                 "%}<|assistant|>\n{{ item['content'] }}{% endif %}{% endfor %}<|assistant|>"),
    "glm4-moe": GLM4_MOE_TEMPLATE,
    "glm4-moe-lite": GLM4_MOE_LITE_TEMPLATE,
    "glm5": GLM5_TEMPLATE,
    "glm5.1": GLM51_TEMPLATE,  # not a version: GLM-5.1's template for a `glm5` tokenizer (a preset's)
    "glm5.2": GLM52_TEMPLATE,
    "glm53-flash": GLM53_FLASH_TEMPLATE,
}
# The special tokens of each released form after the ranks (the mixture-of-experts versions add theirs to GLM-4's).
RELEASED_SPECIALS = {"glm4-moe": (*OFFICIAL_SPECIALS, *MOE_SPECIALS),
                     "glm4-moe-lite": (*OFFICIAL_SPECIALS, *MOE_SPECIALS), "glm5": (*OFFICIAL_SPECIALS, *MOE_SPECIALS),
                     "glm53-flash": (*OFFICIAL_SPECIALS, *MOE_SPECIALS)}


def train_released_bpe(texts, output_dir: str | Path, version: str, *, vocab_size: int = TINY_GLM4_VOCAB,
                       word_pieces: int = 0, chat_template_of: str | None = None) -> GLM4Tokenizer:
    """A small byte-level BPE of `texts` (`train_glm4_bpe`) written as GLM-4-0414 and GLM-Edge are released: a
    `tokenizer.json` with the special tokens, tokenizer_config.json for transformers' `PreTrainedTokenizerFast`
    with the version's chat template (`RELEASED_CHAT_TEMPLATES`), or `chat_template_of`'s; no rank file."""
    output_dir = Path(output_dir)
    specials = RELEASED_SPECIALS.get(version, OFFICIAL_SPECIALS)
    train_glm4_bpe(texts, output_dir, vocab_size=vocab_size, word_pieces=word_pieces,
                   specials=specials).save_vocabulary(str(output_dir))
    (output_dir / TIKTOKEN_FILE).unlink()
    template = RELEASED_CHAT_TEMPLATES[chat_template_of or version]
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template,
              "clean_up_tokenization_spaces": False, "eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN,
              "padding_side": "left", "model_input_names": ["input_ids", "attention_mask"], "model_max_length": 128000}
    (output_dir / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=2),
                                                      encoding="utf-8")
    return load_glm4_tokenizer(output_dir, version)


def bpe_ranks(texts: list[str], vocab_size: int, word_pieces: int = 0) -> list[bytes]:
    """The tokens of a byte-level BPE of `texts`, lowest rank first, as tiktoken reads them (the lowest-rank
    adjacent pair merges first): the 256 bytes; then every multi-byte character of `texts`, most frequent
    first, through its byte prefixes (UTF-8 `e6 95 85` as `e6 95`, then `e6 95 85`); then the whole-character
    tokens that `tokenizers`' BPE trainer learns, in its order: up to `word_pieces` of them made of text
    outside CJK and digits (`tokenizing.word_runs`: Latin words, runs of spaces, JSON punctuation), and any
    others up to `vocab_size` ranks.

    Ranked before every longer token, characters always form first, so each character of the corpus
    is one token (the trainer alone learns byte pairs across characters too: those are left out, as
    are tokens that no split into two earlier tokens can make)."""
    ranks = [bytes([b]) for b in range(256)]
    known = set(ranks)

    def add(token: bytes) -> None:
        if token not in known:
            known.add(token)
            ranks.append(token)

    counts = Counter(char for text in texts for char in text)
    for char, _ in sorted(counts.items(), key=lambda item: (-item[1], item[0])):
        data = char.encode("utf-8")
        for end in range(2, len(data) + 1):
            add(data[:end])
    if word_pieces:
        _extend(ranks, known, _trained_tokens(word_runs(texts), 256 + 2 * word_pieces), len(ranks) + word_pieces)
    if len(ranks) < vocab_size:
        _extend(ranks, known, _trained_tokens(texts, vocab_size + len(ranks)), vocab_size)
    return ranks


def _extend(ranks: list[bytes], known: set[bytes], tokens: list[bytes], size: int) -> None:
    """Append to `ranks` (and `known`) each of `tokens`, in order, that is whole characters and splits into
    two known tokens, until there are `size` ranks."""
    for token in tokens:
        if len(ranks) >= size:
            return
        if token not in known and _is_text(token) and any(token[:i] in known and token[i:] in known
                                                          for i in range(1, len(token))):
            known.add(token)
            ranks.append(token)


def _trained_tokens(texts: list[str], vocab_size: int) -> list[bytes]:
    """The tokens `tokenizers`' byte-level BPE trainer makes of `texts` (GLM-4's pre-tokenizer regex), in
    the order of its merges."""
    from tokenizers import Regex, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(GLM4_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(texts, trainer)
    merges = json.loads(bpe.to_str())["model"]["merges"]
    return [bytes(_BYTE_OF_CHAR[c] for c in "".join(pair)) for pair in merges]


def _is_text(token: bytes) -> bool:
    """True when `token` is whole UTF-8 characters."""
    try:
        token.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def glm4_tokenizer_config(n_ranks: int, specials: tuple[str, ...] = OFFICIAL_SPECIALS) -> dict:
    """tokenizer_config.json of a GLM-4 tokenizer of `n_ranks` ranks, as the official one: the special tokens
    numbered on from the ranks in the official order, eos and pad `<|endoftext|>`, left padding (the chat
    template: the official one with function tools; no `auto_map`, no remote code is shipped)."""
    added = {str(n_ranks + i): {"content": token, "lstrip": False, "normalized": False, "rstrip": False,
                                "single_word": False, "special": True} for i, token in enumerate(specials)}
    return {"added_tokens_decoder": added, "additional_special_tokens": list(specials),
            "chat_template": FUNCTION_TOOLS_CHAT_TEMPLATE, "clean_up_tokenization_spaces": False,
            "do_lower_case": False, "eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN, "padding_side": "left",
            "remove_space": False, "tokenizer_class": "ChatGLM4Tokenizer"}
