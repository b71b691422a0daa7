"""chatglm_tune: fine-tune ChatGLM (6B, ChatGLM2/3, GLM-4) with P-tuning v2 or LoRA, run it in half, INT8 and INT4.

`chatglm_tune.from_pretrained(dir)` / `chatglm_tune.load_tokenizer(dir)` load any version.

Importing the package registers `model_type: chatglm` with transformers' Auto classes (`auto`), so
`AutoModel.from_pretrained(dir)` works without `trust_remote_code`. The public names below are imported
when first used: `import chatglm_tune` (and every command's `--help`) stays light.
"""

import importlib

from chatglm_tune import auto  # noqa: F401  (registers with the Auto classes)

_PUBLIC = {
    "ChatGLMConfig": ".models.chatglm6b.config",
    "ChatGLMForConditionalGeneration": ".models.chatglm6b.modeling",
    "ChatGLMModel": ".models.chatglm6b.modeling",
    "ChatGLMTokenizer": ".models.chatglm6b.tokenizer",
    "generate": ".generation",
    "from_pretrained": ".loading",
    "load_tokenizer": ".models.registry",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_PUBLIC[name], __name__), name)
