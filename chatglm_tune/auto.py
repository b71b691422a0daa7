"""Registration with transformers' Auto classes: `AutoConfig`, `AutoModel`, `AutoModelForCausalLM` and
`AutoTokenizer` load ChatGLM directories after `import chatglm_tune`, with no `trust_remote_code`.

The model and tokenizer modules are imported at first use, not at registration: the Auto mappings hold
stand-ins whose `from_pretrained` imports the real class and hands over. So `import chatglm_tune` costs
only torch and transformers' configuration code, and the command lines answer `--help` at once.
"""

from __future__ import annotations

import importlib

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

from .config import ChatGLMConfig


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


class ChatGLMForConditionalGeneration(_Deferred):
    module, name = ".model", "ChatGLMForConditionalGeneration"


class ChatGLMTokenizer(_Deferred):
    module, name = ".tokenizer", "ChatGLMTokenizer"


AutoConfig.register("chatglm", ChatGLMConfig, exist_ok=True)
AutoModel.register(ChatGLMConfig, ChatGLMForConditionalGeneration, exist_ok=True)
AutoModelForCausalLM.register(ChatGLMConfig, ChatGLMForConditionalGeneration, exist_ok=True)
AutoTokenizer.register(ChatGLMConfig, tokenizer_class=ChatGLMTokenizer, exist_ok=True)
