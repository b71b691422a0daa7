"""ChatGLM2-6B / ChatGLM3-6B / GLM-4-9B config.json <-> transformers' `GlmConfig`, and which version a config is
(GLM-4-0414, GLM-Edge, GLM-4.5 / 4.6 / 4.7, GLM-4.7-Flash, GLM-5 and GLM-5.3-Flash too, whose config.json is
transformers' own: `transformers_form`).

GLM-5.3-Flash's config.json is transformers' composite `glm5_next` (`Glm5NextForConditionalGeneration`: a
`text_config` and a `vision_config`, the image and video token ids beside them); the toolkit runs its text model
(`ChatGLMNextConfig`, transformers' `Glm5NextTextConfig`), read from `text_config` (or, as transformers reads a
text-only checkpoint, from the top level), the toolkit's own fields (`chatglm_version`, P-tuning, INT format) at the
top level. What the composite holds beside the text model is kept as `config.composite_fields` and written back as
read, so a saved or exported directory is still the composite transformers builds `Glm5NextForConditionalGeneration`
from (a tiny preset's holds a small `vision_config` of its own for that).

The official `configuration_chatglm.py` of all three names its fields Megatron-style (`num_layers`,
`padded_vocab_size`, `kv_channels`, `multi_query_group_num`, `ffn_hidden_size`, `layernorm_epsilon`,
`seq_length`, GLM-4's `rope_ratio`); the architecture is transformers 5's own `GlmForCausalLM` with
rotary on half of each head (`partial_rotary_factor` 0.5), `head_dim = kv_channels`,
`num_key_value_heads = multi_query_group_num`, a bias on q/k/v only and
`rope_theta = 10000 * rope_ratio` (absent = 1). References: the official checkpoint layout and the
official `modeling_chatglm.py` (ChatGLM2 `syjjhl/chatglm2-6b`, ChatGLM3 `czk1997/chatglm3-copy`).
transformers' own converter reads `rope_ratio` from the wrong place and always gets 1: here it is read
from the config.json itself.

The official config.json a model was read from is kept as `config.official_config` (a dict) so that
saving writes it back field for field; `config.chatglm_version` names the version, and
`config.pre_seq_len` / `config.prefix_projection` are the P-tuning v2 settings (None / False = none);
`config.quantization_bit` (0 = float weights, 4, 8: the official field) and `config.quantization_group_size`
(ours, INT4 group-wise scales; 0 = per-row, the official format) describe INT weights.
The released `glm-4-9b-chat-hf` form (`model_type: glm`, transformers' own fields) is read as is.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import Glm4MoeConfig, Glm4MoeLiteConfig, GlmConfig, GlmMoeDsaConfig
from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig

from chatglm_tune.models.glm.agent_format import GLM4_MOE, GLM4_MOE_LITE, GLM5, GLM53_FLASH
from chatglm_tune.models.glm.formats import CHATGLM2, CHATGLM3, GLM4, GLM4_0414, GLM_EDGE
from chatglm_tune.models.prefix import check_prefix_version
from chatglm_tune.runtime.checkpoint import CheckpointError, read_config_file

FORMATS = {f.name: f for f in (CHATGLM2, CHATGLM3, GLM4, GLM4_0414, GLM_EDGE, GLM4_MOE, GLM4_MOE_LITE,
                               GLM5, GLM53_FLASH)}  # by name

ROPE_BASE = 10000.0
FAMILY_FIELDS = ("multi_query_group_num", "kv_channels")  # ChatGLM2/3 and GLM-4 only
# Module names (inside `model.layers.N`, transformers' names) that LoRA targets, and that INT8/INT4
# quantization swaps for `quant.modules.QuantizedLinear`s (the attention and MLP Linears).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj")
QUANTIZABLE_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj")
# The mixture-of-experts versions: the dense and shared-expert MLPs have a gate, an up and a down Linear; the
# routed experts are 3D weights (`quant.experts`); GLM-4.7-Flash's latent attention has its own projections.
MOE_QUANTIZABLE_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LATENT_LORA_TARGETS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
LATENT_QUANTIZABLE_LINEARS = (*LATENT_LORA_TARGETS, "o_proj", "gate_proj", "up_proj", "down_proj")
# GLM-5's sparse attention adds an indexer (`self_attn.indexer.wq_b`, `wk`, `weights_proj`), which stays float: its
# scores choose which tokens a query sees (a top-k: an INT error could change the choice, not just the output), and
# transformers keeps its `weights_proj` in float32 whatever the model's dtype; LoRA and INT take the latent
# projections as GLM-4.7-Flash's.
# GLM-5.3-Flash: LoRA takes the attention projections of both kinds of layer (the sparse layers' latent ones, the KDA
# layers' q / k / v), INT those, the output projections and the MLPs' and shared experts' gate / up / down (the routed
# experts: `quant.experts`). What stays float, and why: the indexer (GLM-5's reason: its scores choose the tokens); the
# KDA layers' forget gate (`forget_gate.f_a_proj` / `f_b_proj`, `A_log`, `dt_bias`: the per-channel decay, which an
# error compounds over every later token of the recurrence), `b_proj` (the write strength beta, a few outputs a
# head), `g_a_proj` / `g_b_proj` (the output gate's low-rank pair, small) and the short convolution (`conv1d`, a few
# taps a channel); the hyper-connections' mixing (`attn_hc` / `ffn_hc`: small, and Sinkhorn-normalised, transformers
# keeps their bias and scale in float32); the router and the norms, as in every version.
NEXT_LORA_TARGETS = (*LATENT_LORA_TARGETS, "q_proj", "k_proj", "v_proj")
NEXT_QUANTIZABLE_LINEARS = (*NEXT_LORA_TARGETS, "o_proj", "gate_proj", "up_proj", "down_proj")


def quantizable_linears(version: str) -> tuple[str, ...]:
    """The Linears INT8 / INT4 swaps in a version's blocks (its routed experts are `quant.experts`' business)."""
    return {"glm4-moe": MOE_QUANTIZABLE_LINEARS, "glm4-moe-lite": LATENT_QUANTIZABLE_LINEARS,
            "glm5": LATENT_QUANTIZABLE_LINEARS,
            "glm53-flash": NEXT_QUANTIZABLE_LINEARS}.get(version, QUANTIZABLE_LINEARS)
GLM4_VOCAB = 151552
GLM4_PROMPT_START = "[gMASK]<sop>"  # how GLM-4's chat template begins every prompt (GLM-Edge's does not)
# The versions whose released form is transformers' own (config.json's `model_type`, transformers' key
# names), with the transformers class they are: their own directories are written back in that form.
TRANSFORMERS_FORMS = {"glm4-0414": "glm4", "glm-edge": "glm", "glm4-moe": "glm4_moe", "glm4-moe-lite": "glm4_moe_lite",
                      "glm5": "glm_moe_dsa", "glm53-flash": "glm5_next"}
# config.json's model_type -> (architecture, its fields written by `transformers_form`)
_COMMON_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "hidden_act", "attention_dropout", "max_position_embeddings",
                  "rms_norm_eps", "attention_bias", "pad_token_id")
GLM_FIELDS = (*_COMMON_FIELDS, "head_dim")
_EXPERT_FIELDS = ("moe_intermediate_size", "num_experts_per_tok", "n_shared_experts", "n_routed_experts",
                  "routed_scaling_factor", "n_group", "topk_group", "norm_topk_prob")
ARCHITECTURES = {
    "glm": ("GlmForCausalLM", GLM_FIELDS),
    "glm4": ("Glm4ForCausalLM", GLM_FIELDS),
    "glm4_moe": ("Glm4MoeForCausalLM", (*GLM_FIELDS, *_EXPERT_FIELDS, "first_k_dense_replace", "use_qk_norm",
                                        "num_nextn_predict_layers")),
    "glm4_moe_lite": ("Glm4MoeLiteForCausalLM", (*_COMMON_FIELDS, *_EXPERT_FIELDS, "kv_lora_rank", "q_lora_rank",
                                                 "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
                                                 "rope_interleave", "mlp_layer_types", "num_nextn_predict_layers")),
    "glm_moe_dsa": ("GlmMoeDsaForCausalLM", (*_COMMON_FIELDS, *_EXPERT_FIELDS, "kv_lora_rank", "q_lora_rank",
                                             "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "mlp_layer_types",
                                             "index_topk", "index_head_dim", "index_n_heads", "indexer_types",
                                             "num_nextn_predict_layers")),
    # the fields of its `text_config` (the composite's own: `composite_fields`)
    "glm5_next": ("Glm5NextForConditionalGeneration", (*_COMMON_FIELDS, *_EXPERT_FIELDS, "kv_lora_rank", "q_lora_rank",
                                                       "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
                                                       "mlp_layer_types", "layer_types", "index_topk", "index_head_dim",
                                                       "index_n_heads", "indexer_types", "index_kpool",
                                                       "index_kpool_always_select_tail", "swiglu_limit",
                                                       "linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim",
                                                       "linear_lower_bound", "hc_mult", "hc_eps", "hc_sinkhorn_iters",
                                                       "router_aux_loss_coef", "initializer_range")),
}
# The composite forms: config.json's model_type -> its `text_config`'s (the model the toolkit runs)
COMPOSITE = {"glm5_next": "glm5_next_text"}
# The fields of a composite config.json beside `text_config` that a text-only (flat) one may hold at the top level too
_COMPOSITE_ONLY = ("vision_config", "image_token_id", "video_token_id", "image_start_token_id", "image_end_token_id",
                   "video_start_token_id", "video_end_token_id")
# The toolkit's fields of a transformers-form config.json, at its top level (`transformers_form`)
TOOLKIT_FIELDS = ("chatglm_version", "pre_seq_len", "prefix_projection", "quantization_bit", "quantization_group_size")
_REQUIRED = object()  # no default: a config.json without the field is refused
# The fields that map one to one, as (official config.json name, `GlmConfig` name, default when config.json
# lacks it), read by `glm_config` and written back by `official_config` in this order.
_FIELDS = (
    ("num_layers", "num_hidden_layers", _REQUIRED),
    ("hidden_size", "hidden_size", _REQUIRED),
    ("ffn_hidden_size", "intermediate_size", _REQUIRED),
    ("num_attention_heads", "num_attention_heads", _REQUIRED),
    ("kv_channels", "head_dim", _REQUIRED),
    ("multi_query_group_num", "num_key_value_heads", _REQUIRED),
    ("padded_vocab_size", "vocab_size", _REQUIRED),
    ("layernorm_epsilon", "rms_norm_eps", 1e-5),
    ("add_qkv_bias", "attention_bias", True),
    ("seq_length", "max_position_embeddings", 8192),
    ("eos_token_id", "eos_token_id", None),
    ("pad_token_id", "pad_token_id", None),
)
# Official architecture switches this model supports, with the only value it supports.
_FIXED = {"rmsnorm": True, "post_layer_norm": True, "add_bias_linear": False,
          "apply_residual_connection_post_layernorm": False}
# What an official config.json holds when it has to be written from scratch (a -hf model saved officially).
_OFFICIAL_TEMPLATE = {
    "model_type": "chatglm",
    "architectures": ["ChatGLMModel"],
    "add_bias_linear": False,
    "add_qkv_bias": True,
    "apply_query_key_layer_scaling": True,
    "apply_residual_connection_post_layernorm": False,
    "attention_dropout": 0.0,
    "attention_softmax_in_fp32": True,
    "bias_dropout_fusion": True,
    "fp32_residual_connection": False,
    "hidden_dropout": 0.0,
    "multi_query_attention": True,
    "original_rope": True,
    "post_layer_norm": True,
    "rmsnorm": True,
    "use_cache": True,
    "tie_word_embeddings": False,
}


def detect_version(raw: dict, directory: str | Path | None = None) -> str | None:
    """"chatglm2", "chatglm3", "glm4", "glm4-0414" or "glm-edge" for a config.json dict of this family (and its
    directory), else None.

    transformers' own forms name their class: `model_type: glm4` is GLM-4-0414 (`Glm4ForCausalLM`), `glm4_moe`
    GLM-4.5 / 4.6 / 4.7, `glm4_moe_lite` GLM-4.7-Flash; `model_type: glm` is glm-4-9b-chat-hf or GLM-Edge
    (`glm_type_version`).
    ChatGLM-6B says `model_type: chatglm` too, so the fields decide: this family has
    `multi_query_group_num` / `kv_channels`. GLM-4 has a list of eos ids and a 151552 vocab.
    ChatGLM2 and ChatGLM3 are one architecture with one SentencePiece model, and their config.json files
    differ only in `_name_or_path`, `seq_length` and `transformers_version`; they are told apart, in this
    order, by: an explicit `chatglm_version` field; `_name_or_path` (config.json, then
    tokenizer_config.json's `name_or_path`); the shipped `tokenization_chatglm.py` (only ChatGLM3's has
    `build_chat_input`); and last `transformers_version` (THUDM wrote ChatGLM2-6B's with 4.27.1, ChatGLM3's
    with 4.30 and later). Only the prompt format depends on the answer; the model is the same.
    """
    released = {model_type: version for version, model_type in TRANSFORMERS_FORMS.items() if model_type != "glm"}
    if raw.get("model_type") in released:
        return released[raw["model_type"]]
    if raw.get("model_type") == "glm":
        return glm_type_version(raw, directory)
    if not all(k in raw for k in FAMILY_FIELDS):
        return None
    if raw.get("chatglm_version") in ("chatglm2", "chatglm3", "glm4"):
        return raw["chatglm_version"]
    if isinstance(raw.get("eos_token_id"), list) or raw.get("padded_vocab_size") == GLM4_VOCAB:
        return "glm4"
    names = [raw.get("_name_or_path", "")]
    folder = Path(directory) if directory is not None else None
    if folder is not None and folder.is_file():
        folder = folder.parent
    if folder is not None and (folder / "tokenizer_config.json").exists():
        try:
            names.append(json.loads((folder / "tokenizer_config.json").read_text()).get("name_or_path", ""))
        except json.JSONDecodeError:
            pass
    for name in (str(n).lower() for n in names):
        for version, needles in (("glm4", ("glm-4", "glm4")), ("chatglm3", ("chatglm3",)), ("chatglm2", ("chatglm2",))):
            if any(n in name for n in needles):
                return version
    code = folder / "tokenization_chatglm.py" if folder is not None else None
    if code is not None and code.exists():  # read as text, never imported
        return "chatglm3" if "build_chat_input" in code.read_text(errors="replace") else "chatglm2"
    written_with = tuple(int(p) for p in str(raw.get("transformers_version", "4.30")).split(".")[:2] if p.isdigit())
    return "chatglm2" if written_with < (4, 30) else "chatglm3"


def glm_type_version(raw: dict, directory: str | Path | None = None) -> str:
    """"glm4" or "glm-edge" for a `model_type: glm` config.json: both are transformers' `GlmForCausalLM`.

    In this order: our own `chatglm_version` field (a directory the toolkit wrote); GLM-4-9B's 151552-token
    vocabulary (GLM-Edge's has 59264); a `_name_or_path` that names either; the directory's chat template,
    which for GLM-4 begins every prompt with `[gMASK]<sop>` and for GLM-Edge with the first role token. With
    none of these (weights and config.json alone), GLM-4.
    """
    if raw.get("chatglm_version") in ("glm4", "glm-edge"):
        return raw["chatglm_version"]
    if raw.get("vocab_size") == GLM4_VOCAB:
        return "glm4"
    name = str(raw.get("_name_or_path", "")).lower()
    if "edge" in name:
        return "glm-edge"
    if "glm-4" in name or "glm4" in name:
        return "glm4"
    template = chat_template_of(directory)
    if template is not None:
        return "glm4" if GLM4_PROMPT_START in template else "glm-edge"
    return "glm4"


def chat_template_of(directory: str | Path | None) -> str | None:
    """The chat template a model directory ships (tokenizer_config.json's `chat_template`, or
    chat_template.jinja), None where it has none."""
    if directory is None:
        return None
    folder = Path(directory) if Path(directory).is_dir() else Path(directory).parent
    template = folder / "chat_template.jinja"
    if template.is_file():
        return template.read_text(encoding="utf-8")
    try:
        value = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8")).get("chat_template")
    except (OSError, json.JSONDecodeError):
        return None
    return value if isinstance(value, str) else None


def read_version(raw: dict, directory: str | Path | None = None) -> str:
    """`detect_version`, or CheckpointError for a config.json of another model."""
    version = detect_version(raw, directory)
    if version is None:
        raise CheckpointError("config.json is not a ChatGLM2/3 or GLM-4 config: it lacks "
                              f"{' and '.join(k for k in FAMILY_FIELDS if k not in raw)}")
    return version


def check_prefix_config(source, version: str, model="this model", error: type[Exception] | None = None) -> None:
    """Refuse a P-tuning checkpoint whose config.json says another version of this family than `version`
    (ChatGLM3-6B and GLM-4 prefixes can be of equal shape), naming both; one without a config.json, or
    with one of another model or too bare to tell, is left to the shape checks."""
    try:
        theirs = detect_version(read_config_file(source), source)
    except CheckpointError:
        theirs = None
    check_prefix_version(source, theirs and FORMATS[theirs].title, FORMATS[version].title, model, error,
                         mismatch_hint(theirs, version, source))


def mismatch_hint(theirs: str | None, ours: str, source) -> str:
    """What to add when a config.json says ChatGLM2-6B where ChatGLM3-6B was meant, or the reverse."""
    if {theirs, ours} != {"chatglm2", "chatglm3"}:
        return ""
    where = Path(source) if Path(source).is_dir() else Path(source).parent
    return (f" (ChatGLM2-6B and ChatGLM3-6B config.json files differ only in their names; if {where / 'config.json'} "
            f'is wrong, add "chatglm_version": "{ours}" to it)')


class _FamilyConfig:
    """What this family's config classes add to transformers' own: `model_type: chatglm` (the official
    config.json's: transformers' own type would pick its own classes for a run directory), and `from_dict`."""

    model_type = "chatglm"

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        """An official config.json (ChatGLM2/3 and GLM-4 keys: `padded_vocab_size`, ...) or one in transformers'
        form (`TRANSFORMERS_FORMS`) reads as `glm_config` makes it, with its version, as `AutoConfig` reads it
        (peft's save compares the vocabulary size of the base this way); other fields read as transformers' class
        reads them."""
        if "padded_vocab_size" not in config_dict and config_dict.get("model_type") not in ARCHITECTURES:
            return super().from_dict(config_dict, **kwargs)
        config = glm_config(config_dict, version=read_version(config_dict))
        return (config, {k: v for k, v in kwargs.items()
                         if k != "return_unused_kwargs"}) if kwargs.get("return_unused_kwargs") \
            else config


class ChatGLMFamilyConfig(_FamilyConfig, GlmConfig):
    """transformers' `GlmConfig`, under a class of ours so that the Auto classes map it to our model
    (`auto.py`): ChatGLM2/3 and GLM-4 checkpoints need their official key map and the P-tuning prefix."""


class ChatGLMMoeConfig(_FamilyConfig, Glm4MoeConfig):
    """transformers' `Glm4MoeConfig` (GLM-4.5 / 4.6 / 4.7), under a class of ours."""


class ChatGLMMoeLiteConfig(_FamilyConfig, Glm4MoeLiteConfig):
    """transformers' `Glm4MoeLiteConfig` (GLM-4.7-Flash), under a class of ours."""


class ChatGLMMoeDsaConfig(_FamilyConfig, GlmMoeDsaConfig):
    """transformers' `GlmMoeDsaConfig` (GLM-5 / 5.1 / 5.2 / 5.3), under a class of ours."""


class ChatGLMNextConfig(_FamilyConfig, Glm5NextTextConfig):
    """transformers' `Glm5NextTextConfig` (GLM-5.3-Flash's text model, read from its composite config.json: the
    module docstring), under a class of ours."""

    # The release ships a multi-token-prediction layer past the last, which its config names nowhere (transformers skips
    # its keys): `experts.is_prediction_layer` skips it too.
    prediction_layer_past_last = True


CONFIG_CLASSES = {"glm": ChatGLMFamilyConfig, "glm4": ChatGLMFamilyConfig, "glm4_moe": ChatGLMMoeConfig,
                  "glm4_moe_lite": ChatGLMMoeLiteConfig, "glm_moe_dsa": ChatGLMMoeDsaConfig,
                  "glm5_next": ChatGLMNextConfig}  # by config.json's model_type


def glm_config(raw: dict, *, version: str, pre_seq_len: int | None = None,
               prefix_projection: bool | None = None) -> GlmConfig:
    """transformers' `GlmConfig` for an official (or -hf) config.json dict of `version`.

    `pre_seq_len` / `prefix_projection` override the config.json's (None = keep them).
    """
    if version not in FORMATS:
        raise CheckpointError(f"{version!r} is not a version of this model (one of {', '.join(FORMATS)})")
    if raw.get("model_type") in ARCHITECTURES:
        return _hf_config(raw, version, pre_seq_len, prefix_projection)
    missing = [official for official, _, default in _FIELDS if default is _REQUIRED and official not in raw]
    if missing:
        raise CheckpointError(f"config.json lacks {', '.join(missing)}")
    unsupported = [f"{k}={raw[k]}" for k, v in _FIXED.items() if k in raw and raw[k] != v]
    if unsupported:
        raise CheckpointError(f"config.json has {', '.join(unsupported)}: not the ChatGLM2/3/GLM-4 architecture")
    fields = {ours: raw.get(official, default) for official, ours, default in _FIELDS}
    if not raw.get("multi_query_attention", True):
        fields["num_key_value_heads"] = raw["num_attention_heads"]
    rope_ratio = raw.get("rope_ratio") or 1
    return ChatGLMFamilyConfig(
        **fields,
        hidden_act="silu",
        attention_dropout=raw.get("attention_dropout", 0.0),
        use_cache=raw.get("use_cache", True),
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_BASE * rope_ratio, "partial_rotary_factor": 0.5},
        bos_token_id=None,
        pre_seq_len=raw.get("pre_seq_len") if pre_seq_len is None else pre_seq_len,
        prefix_projection=bool(raw.get("prefix_projection", False) if prefix_projection is None else prefix_projection),
        chatglm_version=version,
        official_config=dict(raw),
        **stored_format(raw),
    )


def _hf_config(raw: dict, version: str, pre_seq_len: int | None, prefix_projection: bool | None) -> GlmConfig:
    """transformers' own form (glm-4-9b-chat-hf, GLM-4-0414, GLM-Edge, the mixture-of-experts versions): its fields
    as they are, plus our P-tuning settings. (`Glm4Config` holds the same fields as `GlmConfig`: one config class
    serves both.) A composite one (GLM-5.3-Flash's) as its text model (`text_fields`)."""
    if raw.get("model_type") in COMPOSITE:
        raw = text_fields(raw)
    fields = {k: v for k, v in raw.items() if k not in ("architectures", "transformers_version", "model_type")}
    fields["pre_seq_len"] = fields.get("pre_seq_len") if pre_seq_len is None else pre_seq_len
    fields["prefix_projection"] = bool(fields.get("prefix_projection", False) if prefix_projection is None
                                       else prefix_projection)
    fields["chatglm_version"] = version
    fields["official_config"] = None
    fields.update(stored_format(raw))
    fields.pop("torch_dtype", None)  # the compute dtype is the loader's choice
    fields.pop("dtype", None)
    config = CONFIG_CLASSES[raw["model_type"]](**fields)
    if config.tie_word_embeddings:
        raise CheckpointError(f"config.json ties the embeddings to the head: {FORMATS[version].title} never does")
    return config


def text_fields(raw: dict) -> dict:
    """A composite config.json (`COMPOSITE`) as its text model's flat fields: `text_config`'s (or, without one, the top
    level's, as transformers reads a text-only checkpoint), the toolkit's top-level fields, and the composite's other
    fields as `composite_fields` (the module docstring)."""
    if isinstance(raw.get("text_config"), dict):
        others = {k: v for k, v in raw.items() if k not in ("text_config", "architectures", "model_type", "dtype",
                                                             "torch_dtype", "transformers_version",
                                                             "tie_word_embeddings", *TOOLKIT_FIELDS)}
        text = {**raw["text_config"], **{k: raw[k] for k in TOOLKIT_FIELDS if k in raw}}
    else:
        others = {k: raw[k] for k in _COMPOSITE_ONLY if k in raw}
        text = {k: v for k, v in raw.items() if k not in _COMPOSITE_ONLY}
    return {**text, "model_type": raw["model_type"], "composite_fields": others}


def transformers_form(config: GlmConfig, dtype: torch.dtype | None = None, *, toolkit_fields: bool = True) -> dict:
    """config.json in transformers' own form: `GlmForCausalLM` (`model_type: glm`), or the class of the version's
    `TRANSFORMERS_FORMS` (`ARCHITECTURES`); `rope_theta` and `partial_rotary_factor` also at the top level, where
    transformers 4 reads them; a composite form (GLM-5.3-Flash's) with the fields in its `text_config`, the others as
    read (`composite_fields`). `toolkit_fields`: our `chatglm_version` (GLM-Edge and glm-4-9b-chat-hf share
    `model_type: glm`), P-tuning settings and INT format where set, at the top level; without them, what any
    transformers reads (export)."""
    model_type = TRANSFORMERS_FORMS.get(config.chatglm_version, "glm")
    architecture, fields = ARCHITECTURES[model_type]
    own = {**{k: getattr(config, k) for k in fields if hasattr(config, k)}, "eos_token_id": config.eos_token_id,
           "tie_word_embeddings": False}
    if model_type in COMPOSITE:
        out = {"architectures": [architecture], "model_type": model_type, **(config.composite_fields or {}),
               "text_config": {"model_type": COMPOSITE[model_type], **own, "use_cache": True},
               "tie_word_embeddings": False}
    else:
        rope = dict(config.rope_parameters)
        out = {"architectures": [architecture], "model_type": model_type, **own, "rope_parameters": rope,
               "rope_theta": rope["rope_theta"], "use_cache": True}
        if "partial_rotary_factor" in rope or model_type in ("glm", "glm4"):
            out["partial_rotary_factor"] = rope.get("partial_rotary_factor", 0.5)
    if dtype is not None:
        out["dtype"] = str(dtype).removeprefix("torch.")
    if not toolkit_fields:
        return out
    out["chatglm_version"] = config.chatglm_version
    if getattr(config, "pre_seq_len", None):
        out.update(pre_seq_len=config.pre_seq_len, prefix_projection=bool(config.prefix_projection))
    bits = getattr(config, "quantization_bit", 0) or 0
    if bits:
        out["quantization_bit"] = bits
        if getattr(config, "quantization_group_size", 0):
            out["quantization_group_size"] = config.quantization_group_size
    return out


def stored_format(raw: dict) -> dict:
    """`quantization_bit` (0, 4 or 8) and `quantization_group_size` (0 = per-row scales) of a config.json:
    the official field, and ours for group-wise INT4 (written only when non-zero)."""
    bits = raw.get("quantization_bit") or 0
    group_size = raw.get("quantization_group_size") or 0
    if bits not in (0, 4, 8):
        raise CheckpointError(f"config.json has quantization_bit={bits}: only 4 and 8 exist (INT4, INT8)")
    if not isinstance(group_size, int) or group_size < 0 or (group_size and bits != 4):
        raise CheckpointError(f"config.json has quantization_group_size={group_size} with quantization_bit={bits}: "
                              "group-wise scales are an INT4 extension (a positive column count)")
    return {"quantization_bit": bits, "quantization_group_size": group_size}


def official_config(config: GlmConfig, dtype: torch.dtype | None = None) -> dict:
    """The official config.json dict for `config` (the one it was read from, updated; or built afresh).

    `dtype`: the dtype the saved weights are in (written as `torch_dtype`).
    """
    out = dict(getattr(config, "official_config", None) or _OFFICIAL_TEMPLATE)
    theta = config.rope_parameters["rope_theta"]
    if (config.rope_parameters.get("partial_rotary_factor", 0.5) != 0.5
        or config.rope_parameters["rope_type"] != "default"):
        raise ValueError(f"rope {config.rope_parameters} has no official ChatGLM equivalent")
    # groups == heads is plain multi-head attention, which the official code spells either way
    multi_query = (config.num_key_value_heads != config.num_attention_heads
                   or bool(out.get("multi_query_attention", True)))
    out.update(model_type="chatglm", multi_query_attention=multi_query, tie_word_embeddings=False)
    out.update({official: getattr(config, ours) for official, ours, _ in _FIELDS})
    ratio = theta / ROPE_BASE
    if ratio != 1 or "rope_ratio" in out:
        out["rope_ratio"] = int(ratio) if float(ratio).is_integer() else ratio
    if "num_hidden_layers" in out or getattr(config, "chatglm_version", None) == "glm4":  # GLM-4 writes both
        out["num_hidden_layers"] = config.num_hidden_layers
    pre_seq_len = getattr(config, "pre_seq_len", None)
    if pre_seq_len or "pre_seq_len" in out:
        out["pre_seq_len"] = pre_seq_len
        out["prefix_projection"] = bool(getattr(config, "prefix_projection", False))
    if dtype is not None:
        out["torch_dtype"] = str(dtype).removeprefix("torch.")
    bits = getattr(config, "quantization_bit", 0) or 0
    group_size = getattr(config, "quantization_group_size", 0) or 0
    out.pop("quantization_group_size", None)
    if bits:
        out["quantization_bit"] = bits
        if group_size:  # ours: the official format has per-row scales only
            out["quantization_group_size"] = group_size
    elif out.get("quantization_bit"):
        out["quantization_bit"] = 0  # read from an INT checkpoint, written as half/float weights
    return out
