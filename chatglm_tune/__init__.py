"""chatglm_tune: fine-tune ChatGLM-6B with P-tuning v2 or LoRA, run it in half precision, INT8 and INT4.

Importing the package registers `model_type: chatglm` with transformers' Auto classes, so
`AutoModel.from_pretrained(dir)` works without `trust_remote_code`.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

from .config import ChatGLMConfig
from .generation import generate
from .model import ChatGLMForConditionalGeneration, ChatGLMModel
from .tokenizer import ChatGLMTokenizer

AutoConfig.register("chatglm", ChatGLMConfig, exist_ok=True)
AutoModel.register(ChatGLMConfig, ChatGLMForConditionalGeneration, exist_ok=True)
AutoModelForCausalLM.register(ChatGLMConfig, ChatGLMForConditionalGeneration, exist_ok=True)
AutoTokenizer.register(ChatGLMConfig, tokenizer_class=ChatGLMTokenizer, exist_ok=True)

__all__ = ["ChatGLMConfig", "ChatGLMForConditionalGeneration", "ChatGLMModel", "ChatGLMTokenizer", "generate"]
