"""Registration with transformers' Auto classes: `AutoConfig`, `AutoModel`, `AutoModelForCausalLM` and
`AutoTokenizer` load every ChatGLM version's directory after `import chatglm_tune`, with no
`trust_remote_code`. All say `model_type: chatglm`: the config class registered for it reads a
config.json as its version's own (`models.registry.detect`): ChatGLM-6B's `ChatGLMConfig`, or a
`ChatGLMFamilyConfig` for ChatGLM2/3 and GLM-4, which maps to the GlmForCausalLM-based model.

The model and tokenizer modules are imported at first use, not at registration: the Auto mappings hold
stand-ins whose `from_pretrained` imports the real class and hands over. This module itself is imported at
first use too (the package's `__init__`), so `import chatglm_tune` and every command's `--help` import neither
torch nor transformers.

A train.py P-tuning or LoRA run directory loads as its base with the run's prefix or adapter (as
`chatglm_tune.from_pretrained` loads it), and so does a LoRA adapter directory whose adapter_config.json
names its base (transformers hands it over with that base); with peft's `AutoPeftModelForCausalLM`, a
LoRA run loads as any peft adapter does, on the base it records.
"""

from __future__ import annotations

import importlib

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

from chatglm_tune.models import registry
from chatglm_tune.models.chatglm6b.config import ChatGLMConfig
from chatglm_tune.models.glm.config import ChatGLMFamilyConfig
from chatglm_tune.runtime.checkpoint import AUTO_PLUMBING


class AnyChatGLMConfig(ChatGLMConfig):
    """`model_type: chatglm` in AutoConfig: a config.json of any version reads as its version's config class."""

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        return registry.VERSIONS[registry.detect(config_dict)].config_class.from_dict(config_dict, **kwargs)


class _Deferred:
    """A class of this package standing in an Auto mapping until it is used."""

    module: str
    name: str
    config_class = ChatGLMConfig

    @classmethod
    def resolve(cls):
        return getattr(importlib.import_module(cls.module, "chatglm_tune"), cls.name)

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        return cls.resolve().from_pretrained(*args, **kwargs)


class _Model(_Deferred):
    """A model class: a directory loads as the class does, a train.py run or LoRA adapter as `_adapted` says."""

    @classmethod
    def from_pretrained(cls, path, *args, **kwargs):
        if kwargs.get("trust_remote_code"):
            raise ValueError("chatglm_tune runs ChatGLM natively: trust_remote_code is never needed")
        model = _adapted(path, args, kwargs)
        return model if model is not None else cls.load(path, *args, **kwargs)

    @classmethod
    def load(cls, path, *args, **kwargs):
        return cls.resolve().from_pretrained(path, *args, **kwargs)


def _adapted(path, args: tuple, kwargs: dict):
    """The model of a train.py P-tuning or LoRA run directory (base + prefix, or base + adapter:
    `loading.load_adapted`), or of a LoRA adapter transformers hands over (its PEFT integration
    passes the adapter as `adapter_kwargs["_adapter_model_path"]`, and as `path` the base that the adapter
    records); None for a model directory."""
    from chatglm_tune.runs import loading

    adapter = (kwargs.get("adapter_kwargs") or {}).get("_adapter_model_path")
    source = loading.adapter_run(path if adapter is None else adapter)
    if source is None and adapter is not None:
        source = loading.resolve_run(path, lora=adapter)
    if source is None:
        return None
    if args:
        raise TypeError(f"{source.describe()}: a run directory takes keyword arguments only")
    return loading.load_adapted(source, **{k: v for k, v in kwargs.items() if k not in AUTO_PLUMBING and k != "config"})


class ChatGLMForConditionalGeneration(_Model):
    module, name = ".models.chatglm6b.modeling", "ChatGLMForConditionalGeneration"


class GlmForCausalLMWithPrefix(_Model):
    module, name = ".models.glm.modeling", "GlmForCausalLMWithPrefix"
    config_class = ChatGLMFamilyConfig

    @classmethod
    def load(cls, path, *args, **kwargs):
        kwargs.pop("config", None)  # read again, with the directory (ChatGLM2 and ChatGLM3 differ only by name)
        return cls.resolve().from_pretrained(path, *args, **{k: v for k, v in kwargs.items() if k not in AUTO_PLUMBING})


class _Tokenizer(_Deferred):
    """Every version's tokenizer, told apart by its directory (tokenizer_config.json and files)."""

    @classmethod
    def from_pretrained(cls, directory, *args, **kwargs):
        if args:
            raise TypeError(f"{directory}: a tokenizer directory takes keyword arguments only")
        return registry.load_tokenizer(directory, **{k: v for k, v in kwargs.items() if k not in AUTO_PLUMBING})


AutoConfig.register("chatglm", AnyChatGLMConfig, exist_ok=True)
for config_class, model_class in ((ChatGLMConfig, ChatGLMForConditionalGeneration),
                                  (ChatGLMFamilyConfig, GlmForCausalLMWithPrefix)):
    AutoModel.register(config_class, model_class, exist_ok=True)
    AutoModelForCausalLM.register(config_class, model_class, exist_ok=True)
for name in registry.TOKENIZER_CLASSES:  # tokenizer_config.json's class names, ours and the official ones
    stand_in = type(name, (_Tokenizer,), {"module": "", "name": name})
    for config_class in (ChatGLMFamilyConfig, ChatGLMConfig):  # the last registered name serves the mapping
        AutoTokenizer.register(config_class, tokenizer_class=stand_in, exist_ok=True)
