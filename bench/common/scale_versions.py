"""The full-size versions the benches write and measure, one row each: full-size config, checkpoint layout,
tokenizer, prompt frame, result files and the targets (bench/scale/scale.py's; bench/peer/peer.py and
bench/gpu/gpu_models.py take the configs, layouts and frames too). Everything that differs between the versions'
scale benches is here; scale.py, checkpoint_writer.py, scale_children.py and scale_report.py ask a row.

    chatglm   ChatGLM-6B   `ChatGLMConfig.from_name("chatglm-6b")`; 8 `.bin` shards; no tokenizer
    chatglm3  ChatGLM3-6B  THUDM/chatglm3-6b's config.json; 7 safetensors shards; its tokenizer
    glm4      GLM-4-9B     THUDM/glm-4-9b-chat's config.json; 10 safetensors shards; its tokenizer
    glm4-0414       GLM-4-9B-0414   transformers' form (Glm4ForCausalLM config.json and keys); 4 fp16 shards;
                                    a tokenizer.json
    glm4-0414-32b   GLM-4-32B-0414  the same form at 32B, written directly as quantize.py's INT4 output (9 shards,
                                    about its 2 GiB ones; no fp16 checkpoint: 65 GB); its rows go to the 9B's results
    glm47-flash     GLM-4.7-Flash   transformers' Glm4MoeLiteForCausalLM form (30B, 64 routed experts, 4 a token),
                                    written directly as quantize.py's INT4 output (16 shards)
    glm45-air       GLM-4.5-Air     transformers' Glm4MoeForCausalLM form (106B, 128 routed experts, 8 a token), its
                                    first 4 layers written as quantize.py's INT4 output; the full size's memory from
                                    the loader's accounting

GLM-5 and GLM-5.3-Flash, which the toolkit does not load yet, are accounted at full size on transformers' own
classes instead: bench/common/accounted_versions.py's rows, bench/scale/scale_cards.py's bench.

The GLM configs are the official config.json files field for field (the names the toolkit reads:
chatglm_tune/models/glm/config.py), but `torch_dtype`: "float16" for both, since the bench writes fp16 shards
(glm-4-9b-chat's own says bfloat16). The tokenizers are the real ones, copied from the shared assets'
chatglm3/ and glm4/ folders when a checkout of them sits beside this one (the bench's prompts are ids
anyway: the real special ids, random ordinary ids between them).

`--quantize-embedding` (`+e8`, every version) loads with `quantize_embedding=True`: ChatGLM-6B's tied embedding /
head as one INT8 copy; ChatGLM3-6B's and GLM-4-9B's untied ones (GLM-4-9B: 2 x 0.62 B) as one INT8 copy each,
quantized as they are read. The target holds GLM-4-9B's INT4 inference to <= 6.0 GB with them (`e8_targets`).

GLM-4-0414 (GLM-4-9B-0414 / GLM-Z1-9B-0414 / GLM-4-32B-0414) is released in transformers' own form:
`Glm4ForCausalLM` (`model_type: glm4`: GLM-4-9B's architecture plus a norm after attention and one after the
MLP in every layer), its config.json's fields, transformers' key names and a `tokenizer.json` with the chat
template. Its configs below: the shapes as transformers' `Glm4Config` defaults (= GLM-4-9B-0414's) and the
released config.json files hold them; `rms_norm_eps` 1e-5 and `max_position_embeddings` 32768 are the
released files' (the `Glm4Config` defaults are 1.5625e-07 and 131072). The bench's tokenizer.json is GLM-4's
BPE (the shared assets' glm4 rank file, converted) with a chat template that begins `[gMASK]<sop>` as the
released one does (`glm4_tokenizer.RELEASED_CHAT_TEMPLATES`, without its tool prompts).
GLM-4-32B-0414 has no fp16 checkpoint here (about 65 GB): its `write` step writes what `quantize.py --bits 4`
would produce from one (`checkpoint_writer.py`, layout "glm4-0414-int4"), so `quantize-*` and `infer-*-load`
do not apply to it; its rows live in scale-glm4-0414.json under the prefix `32b:`.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
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
    "padded_vocab_size": 65024, "seq_length": 8192, "transformers_version": "4.30.2", "eos_token_id": 2,
    "pad_token_id": 0,
}
GLM4_9B_CHAT = {  # THUDM/glm-4-9b-chat config.json (torch_dtype: see the module docstring)
    "_name_or_path": "THUDM/glm-4-9b-chat", **_GLM_COMMON, "attn_implementation": "sdpa",
    "layernorm_epsilon": 1.5625e-07, "num_hidden_layers": 40, "num_layers": 40, "rope_ratio": 500,
    "padded_vocab_size": 151552, "seq_length": 131072, "transformers_version": "4.44.0",
    "eos_token_id": [151329, 151336, 151338], "pad_token_id": 151329,
}

_GLM4_0414 = {  # transformers' Glm4ForCausalLM config.json (THUDM/GLM-4-9B-0414's fields; torch_dtype: see above)
    "architectures": ["Glm4ForCausalLM"], "model_type": "glm4", "attention_bias": True, "attention_dropout": 0.0,
    "eos_token_id": [151329, 151336, 151338], "head_dim": 128, "hidden_act": "silu", "initializer_range": 0.02,
    "max_position_embeddings": 32768, "num_key_value_heads": 2, "pad_token_id": 151329, "partial_rotary_factor": 0.5,
    "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "float16",
    "transformers_version": "4.51.3", "use_cache": True, "vocab_size": 151552,
}
GLM4_9B_0414 = {"_name_or_path": "THUDM/GLM-4-9B-0414", **_GLM4_0414, "hidden_size": 4096, "intermediate_size": 13696,
                "num_attention_heads": 32, "num_hidden_layers": 40}
GLM4_32B_0414 = {"_name_or_path": "THUDM/GLM-4-32B-0414", **_GLM4_0414, "hidden_size": 6144, "intermediate_size": 23040,
                 "num_attention_heads": 48, "num_hidden_layers": 61}

GLM4_0414_NOTES = (
    "Configs (`bench/common/scale_versions.py`): transformers' `Glm4Config` defaults, which are GLM-4-9B-0414's "
    "shapes, give hidden 4096, 40 layers, 32 heads, head_dim 128, 2 KV heads, intermediate 13696, vocab 151552, "
    "attention_bias true, partial_rotary_factor 0.5, rope_theta 10000, eos [151329, 151336, 151338], pad 151329, "
    "untied embeddings (checked against the installed transformers); rms_norm_eps 1e-5 and "
    "max_position_embeddings 32768 (the defaults say 1.5625e-07 and 131072) and GLM-4-32B-0414's hidden 6144, "
    "61 layers, 48 heads, 2 KV heads, head_dim 128, intermediate 23040 are the released config.json files' values "
    "as recalled, not checked against the files here (no network). The shard counts (4 for 9B) are as recalled too; "
    "nothing measured depends on them.",
    "Weights: random, std 0.02, fp16, under transformers' key names (the toolkit's meta-device `Glm4ForCausalLM` "
    "state dict; RMSNorms ones); the tokenizer.json is GLM-4's BPE converted from the shared assets' rank file, with a "
    "chat template that begins `[gMASK]<sop>` as the released one does (without its tool prompts). GLM-4-32B-0414 "
    "is written directly in the INT4 layout `quantize.py --bits 4` writes (per-row fp16 scales of std-0.02 rows, "
    "packed nibbles spread as such rows quantize; embedding, head, norms and biases fp16): the 65 GB fp16 checkpoint "
    "is never written, so its `quantize-*` and quantized-at-load rows do not exist; a test checks that this layout's "
    "keys, dtypes and shapes are quantize.py's.",
)

GLM47_FLASH = {  # transformers' Glm4MoeLiteForCausalLM config.json: its Glm4MoeLiteConfig defaults (GLM-4.7-Flash's)
    "_name_or_path": "zai-org/GLM-4.7-Flash", "architectures": ["Glm4MoeLiteForCausalLM"],
    "model_type": "glm4_moe_lite", "attention_bias": False, "attention_dropout": 0.0, "hidden_act": "silu",
    "hidden_size": 2048, "intermediate_size": 10240, "moe_intermediate_size": 1536, "num_hidden_layers": 47,
    "num_attention_heads": 20, "num_key_value_heads": 20, "n_shared_experts": 1, "n_routed_experts": 64,
    "num_experts_per_tok": 4, "routed_scaling_factor": 1.8, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
    "kv_lora_rank": 512, "q_lora_rank": 768, "qk_rope_head_dim": 64, "qk_nope_head_dim": 192, "v_head_dim": 256,
    "rope_interleave": True, "mlp_layer_types": ["dense"] + ["sparse"] * 46, "max_position_embeddings": 202752,
    "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "vocab_size": 154880, "eos_token_id": [151329, 151336, 151338],
    "pad_token_id": 151329, "tie_word_embeddings": False, "torch_dtype": "float16", "use_cache": True,
}
# GLM-4.5-Air's config.json (transformers' Glm4MoeForCausalLM; its Glm4MoeConfig defaults are these shapes)
GLM45_AIR = {
    "_name_or_path": "zai-org/GLM-4.5-Air", "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe",
    "attention_bias": True, "attention_dropout": 0.0, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
    "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 46, "num_attention_heads": 96,
    "num_key_value_heads": 8, "n_shared_experts": 1, "n_routed_experts": 128, "num_experts_per_tok": 8,
    "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "first_k_dense_replace": 1,
    "partial_rotary_factor": 0.5, "use_qk_norm": False, "num_nextn_predict_layers": 1,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 1000000, "vocab_size": 151552,
    "eos_token_id": [151329, 151336, 151338], "pad_token_id": 151329, "tie_word_embeddings": False,
    "torch_dtype": "float16", "use_cache": True,
}
GLM45_AIR_NOTES = (
    "Config (`bench/common/scale_versions.py`): GLM-4.5-Air's config.json: hidden 4096, 46 layers (the first dense, "
    "45 with 128 routed experts of 1408 and one shared, 8 chosen a token), 96 query heads and 8 key/value heads of 128 "
    "(rotary on half), vocabulary 151552: about 106 B parameters, 12 B active a token. In INT4 its weights alone are "
    "about 60 GB: the bench writes and measures its first 4 layers (`slice_layers`), and gives the full size's memory "
    "from the loader's accounting (`bench/scale/scale_memory.py`, the `memory` step); the multi-token-prediction "
    "layer is not written (the toolkit does not load it).",
    "Weights: written directly in the INT4 layout `quantize.py --bits 4` writes (as GLM-4.7-Flash's); the "
    "tokenizer.json is GLM-4's BPE converted from the shared assets' rank file, with GLM-4.5's chat template.",
)
GLM47_FLASH_NOTES = (
    "Config (`bench/common/scale_versions.py`): transformers' `Glm4MoeLiteConfig` defaults, which are GLM-4.7-Flash's "
    "shapes: hidden 2048, 47 layers (the first dense, 46 with 64 routed experts of 1536 and one shared, 4 chosen a "
    "token, routed scale 1.8), 20 heads of latent attention (query latent 768, key/value latent 512, rotary 64, "
    "no-rotary key 192, value 256), vocabulary 154880; the eos and pad ids are GLM-4's (the release's are not "
    "known here); the multi-token-prediction layer the release ships is not written (the toolkit does not load it).",
    "Weights: written directly in the INT4 layout `quantize.py --bits 4` writes (every Linear of the blocks and each "
    "routed expert's gate, up and down as packed INT4 with per-row fp16 scales; embedding, head, norms and routers "
    "fp16), about 16 GB instead of the release's 60 GB of bf16; the tokenizer.json is GLM-4's BPE converted from the "
    "shared assets' rank file, with GLM-4.7's chat template.",
)


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
    written_bits: int = 0  # 4: `write` writes quantize.py's INT4 output directly (no fp16 checkpoint)
    results_prefix: str = ""  # its records' keys in the results JSON (rows of another version's file)
    tokenizer_json: bool = False  # the tokenizer as a tokenizer.json (converted from `tokenizer_assets`' rank file)
    reported_by: str | None = None  # the version whose report shows these rows (sharing its results file)
    companions: tuple[str, ...] = ()  # versions whose rows (under their `results_prefix`) this report shows too
    compare_with: str | None = None  # a version whose results file's rows this report quotes (not rerun)
    notes: tuple[str, ...] = ()  # report paragraphs after the header (where the config comes from, ...)
    # the checkpoint written and measured: its first N layers (the full size does not fit)
    slice_layers: int | None = None

    def config_json(self, num_layers: int | None = None) -> dict:
        """config.json of the bench checkpoint: full size, or the first `num_layers` layers."""
        if self.official_config is None:
            from chatglm_tune import ChatGLMConfig

            cfg = ChatGLMConfig.from_name("chatglm-6b",
                                          **({} if num_layers is None else {"num_layers": num_layers})).to_dict()
            cfg.update(architectures=["ChatGLMModel"], torch_dtype="float16")
            cfg.pop("dtype", None)
            return cfg
        cfg = dict(self.official_config)
        if num_layers is not None:
            cfg.update({k: num_layers for k in ("num_layers", "num_hidden_layers") if k in cfg})
            if "mlp_layer_types" in cfg:
                cfg["mlp_layer_types"] = cfg["mlp_layer_types"][:num_layers]
        if self.written_bits:  # what quantize.py writes into config.json (`transformers_form`)
            from chatglm_tune.models.registry import detect

            cfg.update(chatglm_version=detect(cfg), quantization_bit=self.written_bits)
        return cfg

    def shape(self, num_layers: int | None = None) -> dict:
        """{"num_layers", "hidden_size", "vocab_size"}: what the results' `_config` records."""
        cfg = self.config_json(num_layers)
        return {"num_layers": cfg.get("num_layers", cfg.get("num_hidden_layers")), "hidden_size": cfg["hidden_size"],
                "vocab_size": cfg.get("padded_vocab_size", cfg.get("vocab_size"))}

    def tokenizer_dir(self) -> Path | None:
        """The tokenizer files to copy beside the weights; FileNotFoundError, saying what is missing, if absent."""
        if self.tokenizer_assets is None:
            return None
        directory = ASSETS / self.tokenizer_assets
        if self.tokenizer_json:  # converted by the writer; the rank file is what it needs
            if not (directory / "tokenizer.model").is_file():
                raise FileNotFoundError(f"{directory}: GLM-4's tokenizer.model (rank file) is not there; "
                                        f"bench/scale/scale.py --version {self.name} converts it into the checkpoint's "
                                        "tokenizer.json")
            return directory
        if not (directory / "tokenizer_config.json").is_file() or not (directory / "tokenizer.model").is_file():
            raise FileNotFoundError(f"{directory}: {self.title}'s tokenizer (tokenizer.model, tokenizer_config.json) "
                                    f"is not there; bench/scale/scale.py --version {self.name} copies it into the "
                                    "checkpoint")
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
    "glm4-0414": BenchVersion(
        "glm4-0414", "GLM-4-9B-0414", 0, "scale-glm4-0414", "glm4-0414", 4, "glm4-0414",
        PromptFrame(("[gMASK]", "<sop>", "<|user|>"), ("<|assistant|>",), "<|user|>", (5, 151329)),
        targets={}, official_config=GLM4_9B_0414, tokenizer_assets="glm4", tokenizer_json=True,
        fit_steps=("infer-int4-load", "infer-int4-file", "train-ptuning-int4"), companions=("glm4-0414-32b",),
        compare_with="glm4", notes=GLM4_0414_NOTES),
    "glm4-0414-32b": BenchVersion(
        "glm4-0414-32b", "GLM-4-32B-0414", 0, "scale-glm4-0414", "glm4-0414-32b", 9, "glm4-0414-int4",
        PromptFrame(("[gMASK]", "<sop>", "<|user|>"), ("<|assistant|>",), "<|user|>", (5, 151329)),
        targets={}, official_config=GLM4_32B_0414, tokenizer_assets="glm4", tokenizer_json=True,
        fit_steps=("infer-int4-file", "train-ptuning-int4"), written_bits=4, results_prefix="32b:",
        reported_by="glm4-0414"),
    "glm47-flash": BenchVersion(
        "glm47-flash", "GLM-4.7-Flash", 45, "scale-glm47-flash", "glm47-flash", 16, "moe-int4",
        PromptFrame(("[gMASK]", "<sop>", "<|user|>"), ("<|assistant|>",), "<|user|>", (5, 151329)),
        targets={"inference": {"int4": 20.0}, "ptuning": {"int4": 24.0}}, official_config=GLM47_FLASH,
        tokenizer_assets="glm4", tokenizer_json=True,
        fit_steps=("infer-int4-file", "train-ptuning-int4", "train-lora-int4"), written_bits=4,
        notes=GLM47_FLASH_NOTES),
    "glm45-air": BenchVersion(
        "glm45-air", "GLM-4.5-Air", 0, "scale-glm45-air", "glm45-air", 4, "moe-int4",
        PromptFrame(("[gMASK]", "<sop>", "<|user|>"), ("<|assistant|>",), "<|user|>", (5, 151329)),
        targets={}, official_config=GLM45_AIR, tokenizer_assets="glm4", tokenizer_json=True,
        fit_steps=("infer-int4-file",), written_bits=4, notes=GLM45_AIR_NOTES,
        slice_layers=4),
}


@functools.cache
def frame_json(version: str, model_dir: Path) -> str:
    """The prompt frame's ids of `version`'s checkpoint as JSON, for the measuring processes (`--frame`): read once."""
    return json.dumps(VERSIONS[version].frame.resolve(model_dir))


def framed_ids(frame: dict, length: int, prompt_len: int, seed: int, batch: int = 1):
    """[batch, length] random ordinary ids (a torch tensor) with the resolved frame's head at 0 and its tail ending
    at `prompt_len`: the prompts of bench/scale/ and bench/peer/'s measuring processes."""
    import torch

    ids = torch.randint(*frame["plain"], (batch, length), generator=torch.Generator().manual_seed(seed))
    head, tail = frame["head"], frame["tail"]
    ids[:, : len(head)] = torch.tensor(head, dtype=ids.dtype)
    ids[:, prompt_len - len(tail) : prompt_len] = torch.tensor(tail, dtype=ids.dtype)
    return ids
