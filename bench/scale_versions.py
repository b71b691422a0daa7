"""The versions bench/scale.py measures, one row each: full-size config, checkpoint layout, tokenizer,
prompt frame, result files and the targets. Everything that differs between the versions'
scale benches is here; scale.py, checkpoint_writer.py, scale_children.py and scale_report.py ask a row.

    chatglm   ChatGLM-6B   `ChatGLMConfig.from_name("chatglm-6b")`; 8 `.bin` shards; no tokenizer
    chatglm3  ChatGLM3-6B  THUDM/chatglm3-6b's config.json; 7 safetensors shards; its tokenizer
    glm4      GLM-4-9B     THUDM/glm-4-9b-chat's config.json; 10 safetensors shards; its tokenizer

The GLM configs are the official config.json files field for field (the names the toolkit reads:
chatglm_tune/models/glm/config.py), but `torch_dtype`: "float16" for both, since the bench writes fp16 shards
(glm-4-9b-chat's own says bfloat16). The tokenizers are the real ones, copied from the shared assets'
chatglm3/ and glm4/ folders when a checkout of them sits beside this one (the bench's prompts are ids
anyway: the real special ids, random ordinary ids between them).

`--quantize-embedding` (`+e8`, every version) loads with `quantize_embedding=True`: ChatGLM-6B's tied embedding /
head as one INT8 copy; ChatGLM3-6B's and GLM-4-9B's untied ones (GLM-4-9B: 2 x 0.62 B) as one INT8 copy each,
quantized as they are read. The target holds GLM-4-9B's INT4 inference to <= 6.0 GB with them (`e8_targets`).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ASSETS = ROOT.parent / "shared" / "assets"
QUICK_LAYERS, QUICK_SHARDS = 2, 3
DEFAULT_VERSION = "chatglm"  # what scale.py and checkpoint_writer.py measure without --version

_AUTO_MAP = {
    "AutoConfig": "configuration_chatglm.ChatGLMConfig",
    "AutoModel": "modeling_chatglm.ChatGLMForConditionalGeneration",
    "AutoModelForCausalLM": "modeling_chatglm.ChatGLMForConditionalGeneration",
    "AutoModelForSeq2SeqLM": "modeling_chatglm.ChatGLMForConditionalGeneration",
    "AutoModelForSequenceClassification": "modeling_chatglm.ChatGLMForSequenceClassification",
}
_GLM_COMMON = {
    "model_type": "chatglm", "architectures": ["ChatGLMModel"], "auto_map": _AUTO_MAP, "add_bias_linear": False,
    "add_qkv_bias": True, "apply_query_key_layer_scaling": True, "apply_residual_connection_post_layernorm": False,
    "attention_dropout": 0.0, "attention_softmax_in_fp32": True, "bias_dropout_fusion": True, "ffn_hidden_size": 13696,
    "fp32_residual_connection": False, "hidden_dropout": 0.0, "hidden_size": 4096, "kv_channels": 128,
    "multi_query_attention": True, "multi_query_group_num": 2, "num_attention_heads": 32, "original_rope": True,
    "post_layer_norm": True, "rmsnorm": True, "use_cache": True, "torch_dtype": "float16", "tie_word_embeddings": False,
}
CHATGLM3_6B = {  # THUDM/chatglm3-6b config.json
    "_name_or_path": "THUDM/chatglm3-6b", **_GLM_COMMON, "layernorm_epsilon": 1e-05, "num_layers": 28,
    "padded_vocab_size": 65024, "seq_length": 8192, "transformers_version": "4.30.2", "eos_token_id": 2, "pad_token_id": 0,
}
GLM4_9B_CHAT = {  # THUDM/glm-4-9b-chat config.json (torch_dtype: see the module docstring)
    "_name_or_path": "THUDM/glm-4-9b-chat", **_GLM_COMMON, "attn_implementation": "sdpa", "layernorm_epsilon": 1.5625e-07,
    "num_hidden_layers": 40, "num_layers": 40, "rope_ratio": 500, "padded_vocab_size": 151552, "seq_length": 131072,
    "transformers_version": "4.44.0", "eos_token_id": [151329, 151336, 151338], "pad_token_id": 151329,
}


@dataclass(frozen=True)
class PromptFrame:
    """A bench prompt: `head` + random ordinary ids in [plain[0], plain[1]) + `tail`; a training row's
    answer (random ordinary ids) ends with `end`. Names are config.json fields (`ids_from="config"`:
    ChatGLM-6B, whose bench checkpoint has no tokenizer) or tokens of the tokenizer."""

    head: tuple[str, ...]
    tail: tuple[str, ...]
    end: str
    plain: tuple[int, int]
    ids_from: str = "tokenizer"

    def resolve(self, model_dir: Path) -> dict:
        """{"head", "tail", "end", "plain"} as ids (what scale_children.py takes as `--frame`)."""
        if self.ids_from == "config":
            raw = json.loads((Path(model_dir) / "config.json").read_text())
            lookup = raw.__getitem__
        else:
            from chatglm_tune import load_tokenizer

            lookup = load_tokenizer(model_dir).convert_tokens_to_ids
        return {"head": [lookup(t) for t in self.head], "tail": [lookup(t) for t in self.tail], "end": lookup(self.end),
                "plain": list(self.plain)}


@dataclass(frozen=True)
class BenchVersion:
    name: str  # the toolkit's version name (chatglm_tune.models.registry.VERSIONS)
    title: str
    issue: int
    stem: str  # results: bench/results/<stem>.json, .md (and .png with `chart`)
    slug: str  # /tmp/<slug>-random[-2l] (checkpoint), /tmp/<slug>-scale-quick (quick results)
    shards: int  # as the official checkpoint
    layout: str  # checkpoint_writer.LAYOUTS: "chatglm6b" (.bin shards) or "glm" (safetensors shards)
    frame: PromptFrame
    # targets, peak RSS GB: {"inference" | "ptuning": {"bf16" | "int8" | "int4": GB}}
    targets: dict
    official_config: dict | None = None  # None: ChatGLM-6B's ChatGLMConfig preset
    tokenizer_assets: str | None = None  # the shared assets' tokenizer folder of this name, copied into the checkpoint
    seed_gpu_gb: dict | None = None  # the seed's Table 18-1 (ChatGLM-6B's)
    decode_targets: bool = False  # the decode targets (of the bandwidth bound, INT4 x bf16)
    fit_steps: tuple[str, ...] = ()  # steps that must run to the end on this machine
    e8_targets: dict | None = None  # targets of the +e8 rows (`--quantize-embedding`), peak RSS GB, as `targets`
    chart: bool = False

    def config_json(self, num_layers: int | None = None) -> dict:
        """config.json of the bench checkpoint: full size, or the first `num_layers` layers."""
        if self.official_config is None:
            from chatglm_tune import ChatGLMConfig

            cfg = ChatGLMConfig.from_name("chatglm-6b", **({} if num_layers is None else {"num_layers": num_layers})).to_dict()
            cfg.update(architectures=["ChatGLMModel"], torch_dtype="float16")
            cfg.pop("dtype", None)
            return cfg
        cfg = dict(self.official_config)
        if num_layers is not None:
            cfg.update({k: num_layers for k in ("num_layers", "num_hidden_layers") if k in cfg})
        return cfg

    def shape(self, num_layers: int | None = None) -> dict:
        """{"num_layers", "hidden_size", "vocab_size"}: what the results' `_config` records."""
        cfg = self.config_json(num_layers)
        return {"num_layers": cfg["num_layers"], "hidden_size": cfg["hidden_size"],
                "vocab_size": cfg.get("padded_vocab_size", cfg.get("vocab_size"))}

    def tokenizer_dir(self) -> Path | None:
        """The tokenizer files to copy beside the weights; FileNotFoundError, saying what is missing, if absent."""
        if self.tokenizer_assets is None:
            return None
        directory = ASSETS / self.tokenizer_assets
        if not (directory / "tokenizer_config.json").is_file() or not (directory / "tokenizer.model").is_file():
            raise FileNotFoundError(f"{directory}: {self.title}'s tokenizer (tokenizer.model, tokenizer_config.json) is "
                                    f"not there; bench/scale.py --version {self.name} copies it into the checkpoint")
        return directory


VERSIONS = {
    "chatglm": BenchVersion(
        "chatglm", "ChatGLM-6B", 6, "scale", "chatglm6b", 8, "chatglm6b",
        PromptFrame((), ("gmask_token_id", "bos_token_id"), "eos_token_id", (5, 130000), ids_from="config"),
        targets={"inference": {"bf16": 12.8, "int8": 7.2, "int4": 4.5}, "ptuning": {"bf16": 14, "int8": 8, "int4": 6}},
        seed_gpu_gb={"inference": {"bf16": 13, "int8": 8, "int4": 6}, "ptuning": {"bf16": 16, "int8": 9, "int4": 7}},
        decode_targets=True, chart=True),
    "chatglm3": BenchVersion(
        "chatglm3", "ChatGLM3-6B", 12, "scale-chatglm3", "chatglm3", 7, "glm",
        PromptFrame(("[gMASK]", "sop", "<|user|>"), ("<|assistant|>",), "</s>", (5, 64789)),
        targets={"inference": {"bf16": 13.0, "int8": 7.5, "int4": 4.6}, "ptuning": {"bf16": 14, "int8": 8, "int4": 6}},
        official_config=CHATGLM3_6B, tokenizer_assets="chatglm3"),
    "glm4": BenchVersion(
        "glm4", "GLM-4-9B", 13, "scale-glm4", "glm4", 10, "glm",
        PromptFrame(("[gMASK]", "<sop>", "<|user|>"), ("<|assistant|>",), "<|user|>", (5, 151329)),
        targets={"inference": {"int8": 11.5, "int4": 7.2}, "ptuning": {"int4": 9}},
        official_config=GLM4_9B_CHAT, tokenizer_assets="glm4",
        fit_steps=("infer-int4-load", "infer-int4-file", "train-ptuning-int4", "train-lora-int4"),
        e8_targets={"inference": {"int4": 6.0}}),
}


@functools.cache
def frame_json(version: str, model_dir: Path) -> str:
    """The prompt frame's ids of `version`'s checkpoint as JSON, for the measuring processes (`--frame`): read once."""
    return json.dumps(VERSIONS[version].frame.resolve(model_dir))
