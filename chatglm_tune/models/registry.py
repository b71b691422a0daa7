"""The one table of model versions: which version a directory, a config or a tokenizer is, and its `Version`.

    chatglm    ChatGLM-6B        models/chatglm6b   its own modeling (GLM 2D positions, tied head)
    chatglm2   ChatGLM2-6B       models/glm         transformers' GlmForCausalLM, one prompt format each
    chatglm3   ChatGLM3-6B       models/glm
    glm4       GLM-4-9B          models/glm
    glm4-0414  GLM-4-0414        models/glm         transformers' Glm4ForCausalLM (a norm after attention and MLP)
    glm-edge   GLM-Edge          models/glm         transformers' GlmForCausalLM, its own chat template
    glm4-moe   GLM-4.5/4.6/4.7   models/glm         transformers' Glm4MoeForCausalLM (routed experts), its chat template
    glm4-moe-lite  GLM-4.7-Flash models/glm         transformers' Glm4MoeLiteForCausalLM (latent attention, experts)
    glm5       GLM-5 to 5.3      models/glm         transformers' GlmMoeDsaForCausalLM (sparse attention, experts)
    glm53-flash  GLM-5.3-Flash   models/glm         transformers' glm5_next text model (KDA linear + sparse attention)

A config.json is read by each family's `detect` in turn (all of them say `model_type: chatglm`; the
fields tell them apart); a tokenizer directory first by its tokenizer_config.json class
(`TOKENIZER_CLASSES`), then by its files. A loaded tokenizer names its version through its prompt
format (`tokenizer.prompt_format`), a model through its config (`config.chatglm_version`; ChatGLM-6B's
config class has none). A family lists its versions, model types and tokenizer classes itself: adding a version
to a family touches only its folder under `models/` (and the table above); a new family is one line here.
"""

from __future__ import annotations

import json
from pathlib import Path

from chatglm_tune.models.chatglm6b import version as chatglm6b
from chatglm_tune.models.glm import versions as glm
from chatglm_tune.models.version import Version
from chatglm_tune.runtime.checkpoint import CheckpointError, read_config_file

VERSIONS: dict[str, Version] = {v.name: v for v in (chatglm6b.CHATGLM6B, *glm.VERSIONS)}
# each has detect(config dict, directory), detect_tokenizer(directory) and MODEL_TYPES; glm has TOKENIZER_CLASSES
FAMILIES = (chatglm6b, glm)

# tokenizer_config.json's `tokenizer_class`: "ChatGLMTokenizer" is the official name of ChatGLM-6B's, ChatGLM2's and
# ChatGLM3's alike (None: the files decide); each family names its own classes and the official ones of its
# versions (`TOKENIZER_CLASSES`). Every name here is registered with transformers' AutoTokenizer.
TOKENIZER_CLASSES: dict[str, str | None] = {"ChatGLMTokenizer": None, **glm.TOKENIZER_CLASSES}
# config.json's model_type: absent, or one a family reads
MODEL_TYPES = (None, *dict.fromkeys(t for family in FAMILIES for t in family.MODEL_TYPES))
TOKENIZER_FILES = ("tokenizer_config.json", "ice_text.model", "tokenizer.model", "tokenizer.json")


def detect(raw: dict, directory=None) -> str:
    """The version name of a config.json dict (and its directory, for ChatGLM2 / ChatGLM3, whose files
    differ only in names)."""
    if raw.get("model_type") not in MODEL_TYPES:
        raise CheckpointError(f"model_type {raw.get('model_type')!r} is not a ChatGLM / GLM-4 config")
    for family in FAMILIES:
        name = family.detect(raw, directory)
        if name is not None:
            return name
    raise CheckpointError("config.json has neither ChatGLM-6B fields (position_encoding_2d, inner_hidden_size) nor "
                          "ChatGLM2/3/GLM-4 fields (multi_query_group_num, kv_channels)")


def of_directory(directory) -> Version:
    """The version of a model directory (or of a weights file beside its config.json)."""
    return VERSIONS[detect(read_config_file(directory), directory)]


def of_config(config) -> Version:
    """The version of a loaded model's config (ChatGLM-6B's config class, or a GlmConfig that names it)."""
    return VERSIONS[getattr(config, "chatglm_version", None) or chatglm6b.CHATGLM6B.name]


def of_tokenizer(tokenizer) -> Version:
    return VERSIONS[tokenizer.prompt_format.name]


def detect_tokenizer(directory) -> str:
    """The version name of a tokenizer directory: tokenizer_config.json's class where it names one, else
    the files (ChatGLM-6B's `ice_text.model`; GLM-4's rank file or tokenizer.json; ChatGLM2's / ChatGLM3's
    SentencePiece model and a name that tells them apart)."""
    directory = Path(directory)
    config_file = directory / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
    named = TOKENIZER_CLASSES.get(config.get("tokenizer_class"))
    if named is not None:
        return named
    for family in FAMILIES:
        name = family.detect_tokenizer(directory)
        if name is not None:
            return name
    raise ValueError(f"{directory} is not a ChatGLM tokenizer directory: expected ice_text.model (ChatGLM-6B), "
                     "or tokenizer.model (SentencePiece or tiktoken) or tokenizer.json, with tokenizer_config.json")


def load_tokenizer(directory, **kwargs):
    """The tokenizer of any version from its directory (tokenizer_config.json and files tell which);
    `kwargs` override tokenizer_config.json."""
    return VERSIONS[detect_tokenizer(directory)].load_tokenizer(directory, **kwargs)


def has_tokenizer(directory: Path) -> bool:
    return any((Path(directory) / name).exists() for name in TOKENIZER_FILES)


def prefix_version(source) -> str | None:
    """The version a P-tuning checkpoint (a directory, or a weights file beside its config.json) was trained
    on, read from its config.json as a model's is; None when it has no config.json or one too bare to tell
    (only `pre_seq_len`)."""
    try:
        return detect(read_config_file(source), source)
    except CheckpointError:
        return None
