"""ChatGLM2-6B, ChatGLM3-6B, GLM-4-9B, GLM-4-0414, GLM-Edge, GLM-4.5 / 4.6 / 4.7, GLM-4.7-Flash, GLM-5 and
GLM-5.3-Flash as the rest of the toolkit sees them (`models.version.Version`): one model (`modeling.py`: transformers'
GlmForCausalLM, or Glm4ForCausalLM, Glm4MoeForCausalLM, Glm4MoeLiteForCausalLM or GlmMoeDsaForCausalLM for the later
ones, GLM-5.3-Flash's text model as `next_model.py` runs it, with the P-tuning prefix; `experts.py`: the routed
experts' released layout), a prompt format each (`formats.py`, `agent_format.py`), two tokenizers (SentencePiece for
ChatGLM2/3 in `sp_tokenizer.py`, GLM-4's byte-level BPE in `glm4_tokenizer.py`, which the later versions ship as a
`tokenizer.json`); and how their files are recognised (`detect`, `detect_tokenizer`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from chatglm_tune.models.glm.config import (LATENT_LORA_TARGETS, LATENT_QUANTIZABLE_LINEARS, LORA_TARGETS,
                                            MOE_QUANTIZABLE_LINEARS, NEXT_LORA_TARGETS, NEXT_QUANTIZABLE_LINEARS,
                                            QUANTIZABLE_LINEARS, TRANSFORMERS_FORMS, ChatGLMFamilyConfig,
                                            ChatGLMMoeConfig, ChatGLMMoeDsaConfig, ChatGLMMoeLiteConfig,
                                            ChatGLMNextConfig, GLM4_PROMPT_START, chat_template_of, detect_version,
                                            glm_config, mismatch_hint)
from chatglm_tune.models.glm.agent_format import GLM4_MOE, GLM4_MOE_LITE, GLM5, GLM53_FLASH
from chatglm_tune.models.glm.formats import CHATGLM2, CHATGLM3, GLM4, GLM4_0414, GLM_EDGE
from chatglm_tune.models.version import Version
from chatglm_tune.options import TINY_CONTEXT, TINY_WORD_PIECES


@dataclass(frozen=True)
class GLMVersion(Version):
    """One version of the family: the model and its P-tuning prefix are the same for all three."""

    config_class: type = ChatGLMFamilyConfig
    lora_targets: tuple[str, ...] = LORA_TARGETS
    quantizable_linears: tuple[str, ...] = QUANTIZABLE_LINEARS
    prefix_module: str = "prefix_encoder"

    def load_model(self, path, **kwargs):
        from chatglm_tune.models.glm.modeling import load_glm

        return load_glm(path, **kwargs)

    def mismatch_hint(self, theirs: str, config_file) -> str:
        return mismatch_hint(theirs, self.name, Path(config_file).parent)

    def load_tokenizer(self, directory, **kwargs):
        """The SentencePiece tokenizer of a ChatGLM2/3 directory (official or saved); `kwargs` override
        tokenizer_config.json."""
        from chatglm_tune.models.glm.sp_tokenizer import SENTENCEPIECE_CLASSES, SENTENCEPIECE_FILE

        directory = _directory(directory)
        if not (directory / SENTENCEPIECE_FILE).is_file():
            raise ValueError(f"{directory} has no {SENTENCEPIECE_FILE} for a {self.title} tokenizer")
        return SENTENCEPIECE_CLASSES[self.name].from_pretrained(str(directory), **kwargs)

    def train_tokenizer(self, corpus: list[str], directory: Path, *, chat_template_of: str | None = None) -> None:
        """A small SentencePiece BPE of `corpus`: its characters and word pieces (`train_glm_sentencepiece`);
        `chat_template_of` (a released chat template to carry instead of the version's): only the versions released
        with a `tokenizer.json` take one."""
        from chatglm_tune.models.glm.sp_tokenizer import train_glm_sentencepiece

        if chat_template_of is not None:
            raise ValueError(f"{self.title}'s tokenizer has its own chat prompt, no template to choose")

        train_glm_sentencepiece(corpus, directory, version=self.name)

    def config_eos(self, tokenizer):
        """The tiny config's `eos_token_id`."""
        return tokenizer.eos_token_id

    def tiny_tokenizer(self, corpus: list[str], directory: Path, *, chat_template_of: str | None = None):
        """The version's own tokenizer files, small (`train_tokenizer`), the official special tokens after them."""
        directory = Path(directory)
        if not (directory / "tokenizer_config.json").exists():  # a resumed run keeps its tokenizer
            self.train_tokenizer(corpus, directory, chat_template_of=chat_template_of)
        return self.load_tokenizer(directory)

    def tiny(self, corpus: list[str], directory: Path, *, context: int = TINY_CONTEXT, chat_template_of=None,
             **config_overrides):
        """(random tiny model, tokenizer trained on `corpus`, written to `directory`): a 2-layer model of this
        architecture and its `tiny_tokenizer`."""
        from chatglm_tune.models.glm.modeling import GlmForCausalLMWithPrefix

        tokenizer = self.tiny_tokenizer(corpus, directory, chat_template_of=chat_template_of)
        # 8 KV groups (the real models have 2 of 128 dims): with 16-dim heads, 2 groups held the tiny ChatGLM3
        # demo at dev F1 0.865 (lr 4e-3, 3200 steps); 8 reached 0.955.
        raw = {"model_type": "chatglm", "num_layers": 2, "hidden_size": 128, "num_attention_heads": 8,
               "kv_channels": 16, "multi_query_group_num": 8, "ffn_hidden_size": 384,
               "padded_vocab_size": -(-len(tokenizer) // 64) * 64, "layernorm_epsilon": 1e-5, "add_qkv_bias": True,
               "seq_length": context, "eos_token_id": self.config_eos(tokenizer),
               "pad_token_id": tokenizer.pad_token_id, "rmsnorm": True, "post_layer_norm": True, **config_overrides}
        return GlmForCausalLMWithPrefix(glm_config(raw, version=self.name)), tokenizer


@dataclass(frozen=True)
class GLM4Version(GLMVersion):
    def load_tokenizer(self, directory, **kwargs):
        """GLM-4's tokenizer (official rank file, `-hf` tokenizer.json, or saved)."""
        from chatglm_tune.models.glm.glm4_tokenizer import load_glm4_tokenizer

        return load_glm4_tokenizer(_directory(directory), self.name, **kwargs)

    def train_tokenizer(self, corpus: list[str], directory: Path, *, chat_template_of: str | None = None) -> None:
        """A byte-level BPE rank file of `corpus` and the chat template's tool prompt: its characters and word
        pieces (`train_glm4_bpe`); no `chat_template_of` (GLM-4-9B's chat prompt is its own)."""
        from chatglm_tune.models.glm.glm4_tokenizer import TOOL_PROMPT_TEXT, train_glm4_bpe

        if chat_template_of is not None:
            raise ValueError(f"{self.title}'s tokenizer has its own chat prompt, no template to choose")

        train_glm4_bpe([*corpus, TOOL_PROMPT_TEXT], directory, word_pieces=TINY_WORD_PIECES)

    def config_eos(self, tokenizer):
        """GLM-4's config says it as the official one does: its eos ids are its stop ids."""
        return tokenizer.stop_token_ids


# The tiny presets' architecture fields beyond the shared ones (`ReleasedFormVersion.tiny`): GLM-4-0414 and
# GLM-Edge as GLM-4's tiny (16-dim heads, rotary on half); GLM-4.5 with a dense first layer and a routed one of 8
# experts (2 a token) beside a shared one, q/k norms and GLM-4.5's routed scale; GLM-4.7-Flash with latent
# attention (a 32-wide key/value latent, 8 rotary dims kept apart, a 48-wide query latent), the same experts.
_TINY_ATTENTION = {"head_dim": 16, "attention_bias": True, "partial_rotary_factor": 0.5}
_TINY_EXPERTS = {"moe_intermediate_size": 64, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
                 "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "num_nextn_predict_layers": 0}
TINY_FIELDS = {
    "glm4-0414": _TINY_ATTENTION, "glm-edge": _TINY_ATTENTION,
    "glm4-moe": {**_TINY_ATTENTION, **_TINY_EXPERTS, "first_k_dense_replace": 1, "use_qk_norm": True,
                 "routed_scaling_factor": 2.5},
    "glm4-moe-lite": {**_TINY_EXPERTS, "kv_lora_rank": 32, "q_lora_rank": 48, "qk_rope_head_dim": 8,
                      "qk_nope_head_dim": 16, "v_head_dim": 16, "rope_interleave": True,
                      "mlp_layer_types": ["dense", "sparse"], "routed_scaling_factor": 1.8, "attention_bias": False},
    "glm5": {**_TINY_EXPERTS, "kv_lora_rank": 32, "q_lora_rank": 48, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16,
             "v_head_dim": 16, "mlp_layer_types": ["dense", "sparse"], "routed_scaling_factor": 2.5,
             "attention_bias": False, "index_topk": 8, "index_head_dim": 16, "index_n_heads": 8,
             "indexer_types": ["full", "shared"]},
    # GLM-5.3-Flash: 4 layers, three KDA linear attention (8 heads of 16) and a sparse one (latent attention without
    # rotary dims, an indexer of 8 heads picking 8 tokens in pools of 4), 4 residual streams; the experts as above; a
    # small vision encoder in its composite config.json (transformers builds the whole class from it: `TINY_VISION`)
    "glm53-flash": {**{k: v for k, v in _TINY_EXPERTS.items() if k != "num_nextn_predict_layers"},
                    "num_hidden_layers": 4, "kv_lora_rank": 32, "q_lora_rank": 48, "qk_rope_head_dim": 0,
                    "qk_nope_head_dim": 16, "v_head_dim": 16, "routed_scaling_factor": 2.5, "attention_bias": False,
                    "layer_types": ["linear_attention"] * 3 + ["indexed_attention"],
                    "mlp_layer_types": ["dense"] + ["sparse"] * 3, "indexer_types": ["full"] * 4, "index_topk": 8,
                    "index_head_dim": 16, "index_n_heads": 8, "index_kpool": 4, "linear_head_dim": 16,
                    "linear_num_heads": 8, "hc_mult": 4, "hc_sinkhorn_iters": 4},
}
# GLM-5.3-Flash's tiny vision encoder: one block; its output as wide as the tiny text model (128)
TINY_VISION = {"depth": 1, "hidden_size": 32, "num_heads": 2, "intermediate_size": 32, "out_hidden_size": 128,
               "projection_intermediate_size": 32, "patch_size": 2, "image_size": 8}


@dataclass(frozen=True)
class ReleasedFormVersion(GLM4Version):
    """GLM-4-0414 (`Glm4ForCausalLM`), GLM-Edge (`GlmForCausalLM`), GLM-4.5 / 4.6 / 4.7 (`Glm4MoeForCausalLM`) and
    GLM-4.7-Flash (`Glm4MoeLiteForCausalLM`): released in transformers' own form (transformers' keys and
    config.json, a `tokenizer.json` with the chat template), which the toolkit reads and writes as it is
    (`config.TRANSFORMERS_FORMS`)."""

    layers_field: str = "num_hidden_layers"

    @property
    def tiny_fields(self) -> dict:
        return TINY_FIELDS[self.name]

    def prompt_format_of(self, directory=None, *, chat_template_of: str | None = None):
        """A `glm4_moe` tokenizer's format follows its chat template's form (GLM-4.5's or GLM-4.7's), a `glm_moe_dsa`
        one's too (GLM-5's, or GLM-5.2's with its reasoning-effort line)."""
        from chatglm_tune.models.glm.glm4_tokenizer import RELEASED_CHAT_TEMPLATES, TEMPLATE_FORMATS, glm4_config_kwargs

        if self.name not in TEMPLATE_FORMATS:
            return self.format
        template = (RELEASED_CHAT_TEMPLATES[chat_template_of or self.name] if directory is None
                    else glm4_config_kwargs(_directory(directory)).get("chat_template"))
        return TEMPLATE_FORMATS[self.name](template)

    def train_tokenizer(self, corpus: list[str], directory: Path, *, chat_template_of: str | None = None) -> None:
        """A byte-level BPE of `corpus` (its characters and word pieces) in a `tokenizer.json`, with the
        version's chat template, or `chat_template_of`'s (`train_released_bpe`)."""
        from chatglm_tune.models.glm.glm4_tokenizer import train_released_bpe

        train_released_bpe(corpus, directory, self.name, word_pieces=TINY_WORD_PIECES,
                           chat_template_of=chat_template_of)

    def tiny(self, corpus: list[str], directory: Path, *, context: int = TINY_CONTEXT, chat_template_of=None,
             **config_overrides):
        """(random tiny model, tokenizer trained on `corpus`, written to `directory`): 2 layers of this
        architecture in transformers' config fields (overrides by those names, and P-tuning's `pre_seq_len` /
        `prefix_projection`), the tokenizer as the version is released."""
        from chatglm_tune.models.glm.modeling import model_class

        prefix = {name: config_overrides.pop(name) for name in ("pre_seq_len", "prefix_projection")
                  if name in config_overrides}
        tokenizer = self.tiny_tokenizer(corpus, directory, chat_template_of=chat_template_of)
        raw = {"model_type": TRANSFORMERS_FORMS[self.name], "num_hidden_layers": 2, "hidden_size": 128,
               "num_attention_heads": 8, "num_key_value_heads": 8, "intermediate_size": 384,
               "vocab_size": -(-len(tokenizer) // 64) * 64, "rms_norm_eps": 1e-5, "max_position_embeddings": context,
               "eos_token_id": tokenizer.stop_token_ids, "pad_token_id": tokenizer.pad_token_id, "rope_theta": 10000.0,
               "hidden_act": "silu", "tie_word_embeddings": False, "chatglm_version": self.name, **self.tiny_fields}
        unknown = sorted(set(config_overrides) - set(raw))
        if unknown:  # an official name (num_layers, ...) would be kept as an unused attribute
            raise ValueError(f"{self.title}'s config has no field {', '.join(unknown)} (transformers' names: "
                             f"{', '.join(sorted(raw))})")
        raw.update(config_overrides)
        raw.update({k: v for k, v in self.layer_plan(raw["num_hidden_layers"]).items() if k not in config_overrides})
        return model_class(self.name)(glm_config(raw, version=self.name, **prefix)), tokenizer

    def layer_plan(self, layers: int) -> dict:
        """The per-layer fields of a tiny model `layers` deep (those `tiny_fields` has): a dense first MLP layer, then
        experts; GLM-5's full indexer every other layer (the others share its choice)."""
        plan = {}
        if "mlp_layer_types" in self.tiny_fields:
            plan["mlp_layer_types"] = ["dense"] + ["sparse"] * (layers - 1)
        if "indexer_types" in self.tiny_fields:
            plan["indexer_types"] = ["shared" if i % 2 else "full" for i in range(layers)]
        return plan


@dataclass(frozen=True)
class NextVersion(ReleasedFormVersion):
    """GLM-5.3-Flash (`modeling.Glm5NextForCausalLMWithPrefix`: its text model), released as transformers' composite
    `glm5_next` (`config.COMPOSITE`)."""

    def layer_plan(self, layers: int) -> dict:
        """As released: every fourth layer sparse attention, the others KDA linear attention, and the last layer sparse
        at any depth (a tiny model of fewer than 4 layers has one too); every sparse layer runs its own indexer."""
        plan = super().layer_plan(layers)
        plan["layer_types"] = ["indexed_attention" if i % 4 == 3 or i == layers - 1 else "linear_attention"
                               for i in range(layers)]
        plan["indexer_types"] = ["full"] * layers
        return plan

    def tiny(self, corpus: list[str], directory: Path, *, context: int = TINY_CONTEXT, chat_template_of=None,
             **config_overrides):
        """`ReleasedFormVersion.tiny`, its composite config.json holding `TINY_VISION` beside the text model."""
        model, tokenizer = super().tiny(corpus, directory, context=context, chat_template_of=chat_template_of,
                                        **config_overrides)
        model.config.composite_fields = {"vision_config": dict(TINY_VISION)}
        return model, tokenizer


_NO_GGML = "chatglm.cpp's {} file is not written here: use --format gguf (llama.cpp, ollama)"
# GLM-5.3-Flash's "gguf" refusal (`export_refusals`): transformers' Glm5Next (linear attention layers and
# hyper-connections beside GLM-5's sparse attention), which gguf-py 0.19 (the `export` extra) has no architecture for.
_NO_GGUF_GLM53_FLASH = ("GLM-5.3-Flash's llama.cpp architecture (glm5-next: linear attention layers and "
                        "hyper-connections beside the sparse attention) is not one gguf-py 0.19 knows, so no GGUF "
                        "file is written here: use --format hf (transformers, vLLM)")
VERSIONS = (GLMVersion(CHATGLM2, ggml_model_type=2), GLMVersion(CHATGLM3, ggml_model_type=3),
            GLM4Version(GLM4, export_refusals={"ggml": _NO_GGML.format("GLM-4")}),
            ReleasedFormVersion(GLM4_0414, export_refusals={"ggml": _NO_GGML.format("GLM-4-0414")}),
            ReleasedFormVersion(GLM_EDGE, export_refusals={"ggml": _NO_GGML.format("GLM-Edge")}),
            ReleasedFormVersion(GLM4_MOE, ChatGLMMoeConfig, quantizable_linears=MOE_QUANTIZABLE_LINEARS,
                                export_refusals={"ggml": _NO_GGML.format("GLM-4.5")}),
            ReleasedFormVersion(GLM4_MOE_LITE, ChatGLMMoeLiteConfig, LATENT_LORA_TARGETS, LATENT_QUANTIZABLE_LINEARS,
                                export_refusals={"ggml": _NO_GGML.format("GLM-4.7-Flash")}),
            ReleasedFormVersion(GLM5, ChatGLMMoeDsaConfig, LATENT_LORA_TARGETS, LATENT_QUANTIZABLE_LINEARS,
                                export_refusals={"ggml": _NO_GGML.format("GLM-5")}),
            NextVersion(GLM53_FLASH, ChatGLMNextConfig, NEXT_LORA_TARGETS, NEXT_QUANTIZABLE_LINEARS,
                        export_refusals={"ggml": "chatglm.cpp has no GLM-5.3-Flash file: use --format hf",
                                         "gguf": _NO_GGUF_GLM53_FLASH},
                        packing_refusal="GLM-5.3-Flash trains on one example a row: its KDA linear attention layers "
                                        "would carry one example's recurrent state into the next of a packed row "
                                        "(train without --packing)"))
detect = detect_version  # what the registry asks: the version of a config.json dict, or None
# What the registry reads of this family: config.json's model_type of its versions (the official one, and
# transformers' GlmForCausalLM, Glm4ForCausalLM, Glm4MoeForCausalLM, Glm4MoeLiteForCausalLM, GlmMoeDsaForCausalLM and
# Glm5NextForConditionalGeneration), and tokenizer_config.json's tokenizer_class of each version (ours, and the official
# GLM-4 one).
MODEL_TYPES = ("chatglm", "glm", "glm4", "glm4_moe", "glm4_moe_lite", "glm_moe_dsa", "glm5_next")
TOKENIZER_CLASSES = {"ChatGLM2Tokenizer": "chatglm2", "ChatGLM3Tokenizer": "chatglm3", "GLM4Tokenizer": "glm4",
                     "ChatGLM4Tokenizer": "glm4", "GLM40414Tokenizer": "glm4-0414", "GLMEdgeTokenizer": "glm-edge",
                     "GLM4MoeTokenizer": "glm4-moe", "GLM4MoeLiteTokenizer": "glm4-moe-lite",
                     "GLM5Tokenizer": "glm5", "GLM53FlashTokenizer": "glm53-flash"}


def _tokenizer_json_version(directory: Path) -> str:
    """GLM-4, GLM-4-0414, GLM-Edge, GLM-4.5 / 4.6 / 4.7 or GLM-4.7-Flash for a tokenizer.json with GLM-4's special
    tokens: the config.json beside it where there is one (`detect_version`: its model_type tells `glm4_moe` from
    `glm4_moe_lite`), else the chat template (GLM-Edge's starts with no `[gMASK]<sop>`; the mixture-of-experts
    releases' write `<arg_key>` tool calls).

    Without config.json the template does not tell GLM-4.7 from GLM-4.7-Flash: both ship GLM-4.7's form
    (`moe_templates`). Such a directory is read as `glm4-moe`, as one of GLM-4.5's form is: its tokenizer renders
    prompts through the directory's template either way, in GLM-4.7's form for this one (`GLM4MoeTokenizer`). A
    GLM-4.7-Flash tokenizer directory is told apart by the config.json beside it, or by a tokenizer_config.json that
    names the toolkit's class (`GLM4MoeLiteTokenizer`, which a saved tokenizer writes)."""
    raw = _read_json(directory / "config.json")
    version = detect_version(raw, directory) if raw else None
    if version is not None:
        return version
    template = chat_template_of(directory) or ""
    if "<arg_key>" in template:
        return "glm4-moe"
    return "glm-edge" if template and GLM4_PROMPT_START not in template else "glm4"


def load_glm_tokenizer(directory: str | Path, version: str, **kwargs):
    """The tokenizer of a ChatGLM2, ChatGLM3 or GLM-4 directory (official, `-hf`, or saved by
    `save_pretrained`) of `version`; `kwargs` override tokenizer_config.json."""
    by_name = {v.name: v for v in VERSIONS}
    if version not in by_name:
        raise ValueError(f"version must be one of {tuple(by_name)}, got {version!r}")
    return by_name[version].load_tokenizer(directory, **kwargs)


def _directory(directory) -> Path:
    directory = Path(directory)
    if not directory.is_dir():
        raise ValueError(f"{directory} is not a directory")
    return directory


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def detect_tokenizer(directory: str | Path) -> str | None:
    """Which tokenizer of this family a directory holds, by its files: "glm4" (a tiktoken rank file, or a
    tokenizer.json with GLM-4's special tokens), "chatglm2" or "chatglm3" (a SentencePiece tokenizer.model:
    the official ChatGLM2 and ChatGLM3 directories differ only in their name, `name_or_path` or config.json's
    `_name_or_path`; ValueError when nothing tells them apart); None for none of these."""
    from chatglm_tune.models.glm.glm4_tokenizer import TOKENIZER_FILE, is_tiktoken_file
    from chatglm_tune.models.glm.sp_tokenizer import SENTENCEPIECE_FILE

    directory = Path(directory)
    config = _read_json(directory / "tokenizer_config.json")
    model_file = directory / SENTENCEPIECE_FILE
    if model_file.is_file() and is_tiktoken_file(model_file):
        return "glm4"
    if (directory / TOKENIZER_FILE).is_file():
        added = {t.get("content") for t in _read_json(directory / TOKENIZER_FILE).get("added_tokens", [])}
        if {"[gMASK]", "<sop>", "<|user|>"} <= added:
            return _tokenizer_json_version(directory)
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
    return None


