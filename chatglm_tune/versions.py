"""What differs between the ChatGLM versions, in one place per version.

Every layer above (data, training, generation, extraction, quantization, run directories) asks a
`Version` instead of testing the version itself. A version knows:
- how to load its model and tokenizer from a directory (`load_model`, `load_tokenizer`);
- how a record becomes a prompt and a training row, as its official fine-tuning builds them
  (`prompt_ids`, `answer_ids`, `labelled_prompt_tokens`), with record text always encoded as data
  (a `<|user|>` typed in a record never becomes a control token);
- its stop ids, whether the batch carries position ids (ChatGLM-6B's 2D GLM positions) or the model
  derives them from the attention mask (ChatGLM2/3, GLM-4), where its prefix encoder lives, which Linears
  LoRA and quantization target.

    ChatGLM-6B   prompt + text [gMASK] <sop> | answer <eop>                      (ptuning/main.py)
    ChatGLM2-6B  [gMASK] sop prompt "[Round 1]\\n\\n问：{text}\\n\\n答：" | answer </s>      (ptuning/main.py)
    ChatGLM3-6B  [gMASK] sop <|user|> \\n prompt + text <|assistant|> | \\n answer </s>    (finetune_demo)
    GLM-4-9B     [gMASK] <sop> <|user|> \\n prompt + text <|assistant|> | \\n answer <|user|>  (finetune.py)

Labels cover the part after `|` (ChatGLM-6B also `<sop>`, the last prompt token, as officially).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .options import EncodingOptions, raise_problems

TOKENIZER_FILES = ("tokenizer_config.json", "ice_text.model", "tokenizer.model", "tokenizer.json")


@dataclass(frozen=True)
class Version:
    """The interface; `ChatGLM6B` and `GLMFamilyVersion` below are the two implementations."""

    name: str
    lora_targets: tuple[str, ...]
    quantizable_linears: tuple[str, ...]
    prefix_module: str  # where the P-tuning prefix encoder lives in the model
    labelled_prompt_tokens: int  # trailing prompt tokens that are trained on (ChatGLM-6B: <sop>)

    def prefix_encoder(self, model):
        return model.get_submodule(self.prefix_module)

    def prefix_state(self, model) -> dict:
        """The trainable P-tuning weights of `model` (what a P-tuning run saves)."""
        prefix = self.prefix_module + "."
        return {k: v for k, v in model.state_dict().items() if k.startswith(prefix)}

    def decode_answer(self, tokenizer, new_ids: list[int]) -> str:
        """The text of generated ids, without the stop id that ended them."""
        if new_ids and new_ids[-1] in self.stop_ids(tokenizer):
            new_ids = new_ids[:-1]
        return tokenizer.decode(new_ids).strip()

    def check_tokenizer(self, tokenizer, config) -> None:
        """ValueError unless the tokenizer's vocabulary fits the model (and, for ChatGLM-6B, its special ids
        equal the config's)."""
        if len(tokenizer) > config.vocab_size:
            raise ValueError(f"the tokenizer does not belong to this model: vocabulary: tokenizer {len(tokenizer)} tokens, "
                             f"model {config.vocab_size} rows")

    def training_row(self, tokenizer, record, options: EncodingOptions):
        """The `EncodedExample` of a record with a gold answer."""
        from .data import training_example

        if record.answer is None:
            raise ValueError(f"{record.source or 'record'}: has no gold answer, cannot build a training example")
        prompt, prompt_cut = self.prompt_ids(tokenizer, record, options)
        answer, answer_cut = self.answer_ids(tokenizer, record.answer, options)
        return training_example(prompt, answer, self.labelled_prompt_tokens, prompt_truncated=prompt_cut,
                                answer_truncated=answer_cut, origin=record.source)


@dataclass(frozen=True)
class ChatGLM6B(Version):
    name: str = "chatglm"
    lora_targets: tuple[str, ...] = ("query_key_value",)
    quantizable_linears: tuple[str, ...] = ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h")
    prefix_module: str = "transformer.prefix_encoder"
    labelled_prompt_tokens: int = 1

    def load_model(self, path, *, quantize_embedding: bool = False, **kwargs):
        from .model import ChatGLMForConditionalGeneration

        return ChatGLMForConditionalGeneration.from_pretrained(path, quantize_embedding=quantize_embedding, **_v1_names(kwargs))

    def load_tokenizer(self, directory):
        from .tokenizer import ChatGLMTokenizer

        return ChatGLMTokenizer.from_pretrained(directory)

    def prompt_ids(self, tokenizer, record, options: EncodingOptions) -> tuple[list[int], bool]:
        """`encode(prompt + text)` cut to `max_src_len - 1`, then `[gMASK] <sop>` (history: the official rounds)."""
        from .data import chat_prompt

        ids = tokenizer.encode(options.prompt + chat_prompt(record.text, record.history), add_special_tokens=False)
        kept = ids[: options.max_source_tokens]
        return kept + [tokenizer.gmask_token_id, tokenizer.bos_token_id], len(kept) < len(ids)

    def answer_ids(self, tokenizer, answer: str, options: EncodingOptions) -> tuple[list[int], bool]:
        ids = tokenizer.encode(answer, add_special_tokens=False)
        return ids[: options.max_answer_tokens] + [tokenizer.eos_token_id], len(ids) > options.max_answer_tokens

    def stop_ids(self, tokenizer) -> list[int]:
        return [tokenizer.eos_token_id]

    def check_tokenizer(self, tokenizer, config) -> None:
        from dataclasses import asdict

        from .data import SpecialIds

        ours, theirs = SpecialIds.of(tokenizer), SpecialIds.of(config)
        problems = [f"{k}: tokenizer {v}, model {getattr(theirs, k)}" for k, v in asdict(ours).items() if v != getattr(theirs, k)]
        raise_problems(problems, "the tokenizer does not belong to this model: ")
        super().check_tokenizer(tokenizer, config)

    def tiny(self, corpus: list[str], directory: Path, **config_overrides):
        """(random tiny model, tokenizer trained on `corpus`, written to `directory`): the from-scratch demo."""
        from .config import ChatGLMConfig
        from .model import ChatGLMForConditionalGeneration
        from .tokenizer import ChatGLMTokenizer, train_tokenizer

        if (Path(directory) / "tokenizer_config.json").exists():  # a resumed run keeps its tokenizer
            tokenizer = ChatGLMTokenizer.from_pretrained(directory)
        else:
            tokenizer = train_tokenizer(corpus, directory, max_piece_length=1)  # character-level: see train_tokenizer
        config = ChatGLMConfig.from_name("tiny", **config_overrides, **tokenizer.config_overrides())
        return ChatGLMForConditionalGeneration(config), tokenizer

    def positions(self, config, input_ids, attention_mask):
        """ChatGLM-6B's 2D GLM positions [b, 2, s] (`positions.build_position_ids`)."""
        from .positions import build_position_ids

        return build_position_ids(input_ids, bos_token_id=config.bos_token_id, gmask_token_id=config.gmask_token_id,
                                  mask_token_id=config.mask_token_id, pad_mask=attention_mask)


@dataclass(frozen=True)
class GLMFamilyVersion(Version):
    """ChatGLM2-6B, ChatGLM3-6B and GLM-4-9B: one architecture (`glm.py`), three prompt formats."""

    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")
    quantizable_linears: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj")
    prefix_module: str = "prefix_encoder"
    labelled_prompt_tokens: int = 0

    def load_model(self, path, **kwargs):
        from .glm import load_glm

        return load_glm(path, **kwargs)

    def load_tokenizer(self, directory):
        from .glm_tokenizer import load_glm_tokenizer

        return load_glm_tokenizer(directory, version=self.name)

    def prompt_ids(self, tokenizer, record, options: EncodingOptions) -> tuple[list[int], bool]:
        """The chat prompt of the version around `prompt + text`, the text cut to fit `max_src_len`."""
        history = record.history or ()
        if self.name == "chatglm2":
            return self._chatglm2_prompt(tokenizer, options.prompt, record.text, history, options.max_src_len)
        head, tail = self._around_query(tokenizer, history)
        query = tokenizer.encode_text(self._after_role(options.prompt + record.text))
        room = max(1, options.max_src_len - len(head) - len(tail))
        return head + query[:room] + tail, len(query) > room

    def answer_ids(self, tokenizer, answer: str, options: EncodingOptions) -> tuple[list[int], bool]:
        if self.name == "chatglm3":  # "\n" and the answer encoded apart, as its build_single_message
            lead, ids = tokenizer.encode_text("\n"), tokenizer.encode_text(answer)
        else:  # GLM-4's template renders "\n" + answer as one text; ChatGLM2 answers bare
            lead, ids = [], tokenizer.encode_text(self._after_role(answer))
        room = options.answer_budget - len(lead) - 1
        return lead + ids[:room] + [self._end_id(tokenizer)], len(ids) > room

    def stop_ids(self, tokenizer) -> list[int]:
        return list(tokenizer.stop_token_ids)

    def chat_ids(self, tokenizer, messages: list[dict]) -> list[int]:
        """The official chat() prompt of ChatGLM3 / GLM-4 for `messages` (`role`, `content`, optional `metadata`,
        a system message's `tools`), the last one being the query: ChatGLM3 its tokenizer's `build_chat_input`,
        GLM-4 its chat template (`encode_chat`: message text stays data). Ends with `<|assistant|>`."""
        if self.name == "chatglm3":
            *history, last = messages
            return tokenizer.build_chat_input(last["content"], history, role=last["role"])["input_ids"][0].tolist()
        if self.name == "glm4":
            return tokenizer.encode_chat(messages)
        raise ValueError(f"{self.name} chats in (query, response) pairs, not role messages")

    def tiny(self, corpus: list[str], directory: Path, **config_overrides):
        """(random tiny model, tokenizer trained on `corpus`, written to `directory`): a 2-layer model of this
        architecture and the version's own tokenizer files, small: ChatGLM2/3 a character-level SentencePiece
        model (`train_glm_sentencepiece`), GLM-4 a byte-level BPE rank file (`train_glm4_bpe`), the official
        special tokens after either. GLM-4's config says it as the official one does: eos ids are its stop ids."""
        from .glm import GlmForCausalLMWithPrefix
        from .glm_config import glm_config
        from .glm_tokenizer import load_glm_tokenizer, train_glm_sentencepiece
        from .glm4_tokenizer import train_glm4_bpe

        directory = Path(directory)
        if not (directory / "tokenizer_config.json").exists():  # a resumed run keeps its tokenizer
            if self.name == "glm4":
                train_glm4_bpe(corpus, directory)
            else:
                train_glm_sentencepiece(corpus, directory, version=self.name)
        tokenizer = load_glm_tokenizer(directory, version=self.name)
        eos = tokenizer.stop_token_ids if self.name == "glm4" else tokenizer.eos_token_id
        # 8 KV groups (the real models have 2 of 128 dims): with 16-dim heads, 2 groups held the tiny ChatGLM3
        # demo at dev F1 0.865 (lr 4e-3, 3200 steps); 8 reached 0.955.
        raw = {"model_type": "chatglm", "num_layers": 2, "hidden_size": 128, "num_attention_heads": 8, "kv_channels": 16,
               "multi_query_group_num": 8, "ffn_hidden_size": 384, "padded_vocab_size": -(-len(tokenizer) // 64) * 64,
               "layernorm_epsilon": 1e-5, "add_qkv_bias": True, "seq_length": 512, "eos_token_id": eos,
               "pad_token_id": tokenizer.pad_token_id, "rmsnorm": True, "post_layer_norm": True, **config_overrides}
        return GlmForCausalLMWithPrefix(glm_config(raw, version=self.name)), tokenizer

    def positions(self, config, input_ids, attention_mask):
        return None  # the model derives them from the attention mask (cumsum - 1)

    # -- the three formats

    def _after_role(self, text: str) -> str:
        """Text that follows a role token: GLM-4's template puts the "\n" in the same text."""
        return "\n" + text if self.name == "glm4" else text

    @staticmethod
    def _chatglm2_prompt(tokenizer, prefix: str, query: str, history, max_len: int) -> tuple[list[int], bool]:
        """ChatGLM2's official prompt, `prefix + build_prompt(query, history)`, encoded as one text (as its
        `ptuning/main.py` does: SentencePiece joins across the template and the query); a query too long
        loses its end, whole characters at a time, until the prompt fits `max_len` tokens."""
        def encode(text: str) -> list[int]:
            return tokenizer.get_prefix_tokens() + tokenizer.encode_text(prefix + tokenizer.build_prompt(text, list(history)))

        ids, kept = encode(query), query
        while len(ids) > max_len and kept:
            kept = kept[: len(kept) - max(1, len(ids) - max_len)]
            ids = encode(kept)
        return ids, kept != query

    def _around_query(self, tokenizer, history) -> tuple[list[int], list[int]]:
        """(ids before the query's own ids, ids after them), ChatGLM3 and GLM-4."""
        command = tokenizer.get_command
        head = [command("[gMASK]"), command("sop" if self.name == "chatglm3" else "<sop>")]
        for query, response in history:
            head += self._message(tokenizer, "user", query) + self._message(tokenizer, "assistant", response)
        head += [command("<|user|>")] + (tokenizer.encode_text("\n") if self.name == "chatglm3" else [])
        return head, [command("<|assistant|>")]

    def _message(self, tokenizer, role: str, content: str) -> list[int]:
        if self.name == "chatglm3":  # role, then "\n" and the content encoded apart (official)
            return [tokenizer.get_command(f"<|{role}|>"), *tokenizer.encode_text("\n"), *tokenizer.encode_text(content)]
        return [tokenizer.get_command(f"<|{role}|>"), *tokenizer.encode_text("\n" + content)]  # GLM-4's template

    def _end_id(self, tokenizer) -> int:
        return tokenizer.get_command("<|user|>") if self.name == "glm4" else tokenizer.eos_token_id


VERSIONS: dict[str, Version] = {
    "chatglm": ChatGLM6B(),
    "chatglm2": GLMFamilyVersion("chatglm2"),
    "chatglm3": GLMFamilyVersion("chatglm3"),
    "glm4": GLMFamilyVersion("glm4"),
}


def of_directory(directory) -> Version:
    """The version of a model directory, from its config.json's fields."""
    from .glm_config import detect_version, read_config_file

    return VERSIONS[detect_version(read_config_file(directory), directory)]


def of_config(config) -> Version:
    """The version of a loaded model's config (ChatGLM-6B's config class, or a GlmConfig that names it)."""
    return VERSIONS[getattr(config, "chatglm_version", None) or "chatglm"]


TOKENIZER_VERSIONS = {"ChatGLMTokenizer": "chatglm", "ChatGLM2Tokenizer": "chatglm2", "ChatGLM3Tokenizer": "chatglm3",
                      "GLM4Tokenizer": "glm4"}


def of_tokenizer(tokenizer) -> Version:
    return VERSIONS[TOKENIZER_VERSIONS[type(tokenizer).__name__]]


def from_pretrained(directory, **kwargs):
    """The model of any version from its directory (`Version.load_model`'s arguments: dtype, device,
    pre_seq_len, prefix_projection, quantization_bit, group_size, quantize_embedding).

    A train.py P-tuning or LoRA run directory (its run_args.json names the base) loads as that base with
    the run's prefix or LoRA adapter (`rundir.load_adapted`, `rundir.load_model`: the base quantized as the
    run trained on it unless quantization_bit says otherwise; an adapter merged into a float base, beside
    the integer weights of a quantized one)."""
    from . import rundir

    source = rundir.adapter_run(directory)
    if source is not None:
        return rundir.load_adapted(source, **kwargs)
    return of_directory(directory).load_model(directory, **kwargs)


def load_tokenizer(directory):
    """The tokenizer of any version from its directory (tokenizer_config.json and files tell which)."""
    from .glm_tokenizer import detect_tokenizer_version

    return VERSIONS[detect_tokenizer_version(directory)].load_tokenizer(directory)


def has_tokenizer(directory: Path) -> bool:
    return any((Path(directory) / name).exists() for name in TOKENIZER_FILES)


def _v1_names(kwargs: dict) -> dict:
    """`load_model`'s common arguments in ChatGLM-6B's `from_pretrained` names."""
    out = dict(kwargs)
    if "group_size" in out:
        out["quantization_group_size"] = out.pop("group_size")
    return out
