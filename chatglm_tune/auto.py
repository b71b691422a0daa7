"""Registration with transformers' Auto classes: `AutoConfig`, `AutoModel`, `AutoModelForCausalLM` and
`AutoTokenizer` load every ChatGLM version's directory after `import chatglm_tune`, with no
`trust_remote_code`. All say `model_type: chatglm`; `ChatGLMConfig.from_dict` reads a ChatGLM2/3 or
GLM-4 config.json as a `ChatGLMFamilyConfig`, which maps to the GlmForCausalLM-based model.

The model and tokenizer modules are imported at first use, not at registration: the Auto mappings hold
stand-ins whose `from_pretrained` imports the real class and hands over. So `import chatglm_tune` costs
only torch and transformers' configuration code, and the command lines answer `--help` at once.

A train.py P-tuning or LoRA run directory loads as its base with the run's prefix or adapter (as
`chatglm_tune.from_pretrained` loads it), and so does a LoRA adapter directory whose adapter_config.json
names its base (transformers hands it over with that base); with peft's `AutoPeftModelForCausalLM`, a
LoRA run loads as any peft adapter does, on the base it records.
"""

from __future__ import annotations

import importlib

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

from .config import ChatGLMConfig
from .glm_config import ChatGLMFamilyConfig

# Arguments the Auto classes pass along to from_pretrained; meaningless for a local directory.
AUTO_PLUMBING = {"_from_auto", "trust_remote_code", "adapter_kwargs", "revision", "cache_dir", "force_download",
                 "local_files_only", "proxies", "token", "subfolder", "_commit_hash", "code_revision", "name_or_path"}


class _Deferred:
    """A class of this package standing in an Auto mapping until it is used."""

    module: str
    name: str
    config_class = ChatGLMConfig

    @classmethod
    def resolve(cls):
        return getattr(importlib.import_module(cls.module, __package__), cls.name)

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
    `rundir.load_adapted`), or of a LoRA adapter transformers hands over (its PEFT integration
    passes the adapter as `adapter_kwargs["_adapter_model_path"]`, and as `path` the base that the adapter
    records); None for a model directory."""
    from . import rundir

    adapter = (kwargs.get("adapter_kwargs") or {}).get("_adapter_model_path")
    source = rundir.adapter_run(path if adapter is None else adapter)
    if source is None and adapter is not None:
        source = rundir.resolve_run(path, lora=adapter)
    if source is None:
        return None
    if args:
        raise TypeError(f"{source.describe()}: a run directory takes keyword arguments only")
    return rundir.load_adapted(source, **{k: v for k, v in kwargs.items() if k not in AUTO_PLUMBING and k != "config"})


class ChatGLMForConditionalGeneration(_Model):
    module, name = ".model", "ChatGLMForConditionalGeneration"


class GlmForCausalLMWithPrefix(_Model):
    module, name = ".glm", "GlmForCausalLMWithPrefix"
    config_class = ChatGLMFamilyConfig

    @classmethod
    def load(cls, path, *args, **kwargs):
        kwargs.pop("config", None)  # read again, with the directory (ChatGLM2 and ChatGLM3 differ only by name)
        return cls.resolve().from_pretrained(path, *args, **{k: v for k, v in kwargs.items() if k not in AUTO_PLUMBING})


class _Tokenizer(_Deferred):
    """Every version's tokenizer, told apart by its directory (tokenizer_config.json and files)."""

    @classmethod
    def from_pretrained(cls, directory, *args, **kwargs):
        from .glm_tokenizer import detect_tokenizer_version, load_glm_tokenizer

        kwargs = {k: v for k, v in kwargs.items() if k not in AUTO_PLUMBING}
        if detect_tokenizer_version(directory) == "chatglm":
            from .tokenizer import ChatGLMTokenizer

            return ChatGLMTokenizer.from_pretrained(directory, *args, **kwargs)
        return load_glm_tokenizer(directory, **kwargs)


# tokenizer_config.json names: the official one ("ChatGLMTokenizer", all versions) and ours
TOKENIZER_NAMES = ("ChatGLM2Tokenizer", "ChatGLM3Tokenizer", "GLM4Tokenizer", "ChatGLMTokenizer")

AutoConfig.register("chatglm", ChatGLMConfig, exist_ok=True)
for config_class, model_class in ((ChatGLMConfig, ChatGLMForConditionalGeneration), (ChatGLMFamilyConfig, GlmForCausalLMWithPrefix)):
    AutoModel.register(config_class, model_class, exist_ok=True)
    AutoModelForCausalLM.register(config_class, model_class, exist_ok=True)
for name in TOKENIZER_NAMES:
    stand_in = type(name, (_Tokenizer,), {"module": "", "name": name})
    for config_class in (ChatGLMFamilyConfig, ChatGLMConfig):  # the last registered name serves the mapping
        AutoTokenizer.register(config_class, tokenizer_class=stand_in, exist_ok=True)
