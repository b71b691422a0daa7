"""The full-size versions the scale bench accounts for without the toolkit's loader (it has no classes for them
yet): their full-size configs, the transformers classes that build them, which of their Linears INT8 / INT4 would
replace, their LoRA targets, and the few full-size layers bench/scale/scale_cards.py writes and measures. One row
each, as bench/common/scale_versions.py's rows are for the versions the toolkit loads.

    glm5         GLM-5           transformers' `GlmMoeDsaForCausalLM` (`model_type: glm_moe_dsa`): 78 layers of sparse
                                 latent attention (DSA: a lightning indexer picks 2048 tokens a query), the first 3
                                 with a dense MLP, 75 with 256 routed experts (8 a token) and one shared; ~744 B
    glm53-flash  GLM-5.3-Flash   transformers' `Glm5NextForConditionalGeneration`'s text part (`model_type:
                                 glm5_next`): 45 layers, 3 of 4 KDA linear attention (a recurrent state, no cache),
                                 the 4th sparse latent attention without rotary dims and a pooled indexer; 4
                                 hyper-connection streams; 3 dense MLPs then 288 routed experts (8 a token); ~313 B

The configs are transformers 5.25's config classes' defaults, which are these releases' shapes (`GlmMoeDsaConfig()`,
`Glm5NextTextConfig()`; a test checks every field below against them). The released config.json files are not here
(no network): the key names the released weight files use are what transformers' classes say
(its checkpoint conversion maps `mlp.experts.N.{gate,up,down}_proj.weight` to the fused 3D experts, and for
GLM-5.3-Flash `self_attn.{q,k,v}_conv1d.weight` to one `conv1d`, `self_attn.{f_a_proj,f_b_proj,dt_bias,A_log}` to
its `forget_gate`, `hc_{attn,ffn}_{fn,base,scale}` to `{attn,ffn}_hc.*`); `save_pretrained` writes that layout back,
and a test holds the bench's writer to it. Neither row counts the multi-token-prediction layer the releases ship
(GLM-5's `model.layers.78.*`, GLM-5.3-Flash's `layers.45.*` and `shared_head`: transformers' classes ignore them on
load, as the toolkit does GLM-4.5's); GLM-5.3-Flash's vision tower (`model.visual.*`) is not counted either.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# transformers' GlmMoeDsaConfig defaults (GLM-5's shapes)
GLM5 = {
    "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", "vocab_size": 154880, "hidden_size": 6144,
    "intermediate_size": 12288, "moe_intermediate_size": 2048, "num_hidden_layers": 78, "num_attention_heads": 64,
    "num_key_value_heads": 64, "n_shared_experts": 1, "n_routed_experts": 256, "num_experts_per_tok": 8,
    "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 2048, "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 192, "v_head_dim": 256, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
    "first_k_dense_replace": 3, "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 32,
    "max_position_embeddings": 202752, "rms_norm_eps": 1e-05, "attention_bias": False, "hidden_act": "silu",
    "tie_word_embeddings": False,
}
# transformers' Glm5NextTextConfig defaults (GLM-5.3-Flash's text shapes); layer_types, mlp_layer_types and
# indexer_types are the class's own defaults: layer i is KDA unless i % 4 == 3, the first 3 MLPs dense, every
# sparse layer runs its indexer
GLM53_FLASH = {
    "model_type": "glm5_next_text", "vocab_size": 154880, "hidden_size": 4096, "intermediate_size": 12288,
    "moe_intermediate_size": 2048, "num_hidden_layers": 45, "num_attention_heads": 64, "num_key_value_heads": 64,
    "n_shared_experts": 1, "n_routed_experts": 288, "num_experts_per_tok": 8, "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 0, "qk_nope_head_dim": 256, "v_head_dim": 256,
    "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "index_topk": 2048, "index_head_dim": 128,
    "index_n_heads": 32, "index_kpool": 16, "linear_head_dim": 128, "linear_num_heads": 64,
    "linear_conv_kernel_dim": 4, "hc_mult": 4, "swiglu_limit": 10.0, "max_position_embeddings": 1048576,
    "rms_norm_eps": 1e-05, "attention_bias": False, "hidden_act": "silu", "pad_token_id": 154820,
    "tie_word_embeddings": False,
}
# What stands in for GLM-5.3-Flash's vision tower in the measured copy's config.json: transformers initialises its
# few thousand weights (the bench writes text weights only) and nothing measured runs through it.
VISION_STAND_IN = {"depth": 1, "hidden_size": 32, "num_heads": 2, "intermediate_size": 32, "out_hidden_size": 64,
                   "projection_intermediate_size": 32}

# The Linears INT8 / INT4 would replace, by leaf name, in the attention, linear-attention, dense-MLP and
# shared-expert parts (the routed experts' 3D weights too): GLM-4.7-Flash's latent-attention set plus KDA's q / k / v
# projections. Their lightweight neighbours stay float (bench/scale/scale_accounting.py says which and why).
QUANTIZED = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "q_proj", "k_proj", "v_proj",
             "gate_proj", "up_proj", "down_proj")
LATENT_LORA = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")  # GLM-4.7-Flash's LoRA targets
KDA_LORA = ("q_proj", "k_proj", "v_proj")  # a KDA layer's own query / key / value projections
EXPERT_LORA = ("experts.gate_up_proj", "experts.down_proj")  # peft `target_parameters`: an adapter per expert


@dataclass(frozen=True)
class AccountedVersion:
    name: str
    title: str
    stem: str  # results: bench/results/<stem>.json, .md
    slug: str  # the measured copy: /tmp/<slug>-random-<N>l
    config: dict  # the text model's config.json fields (full size)
    config_class: str  # transformers' config class of the checkpoint's config.json
    model_class: str  # transformers' class the release loads as
    key_prefix: str  # where the text model's keys sit under model_class ("model." or "model.language_model.")
    lora_targets: tuple[str, ...]  # the attention projections (`--lora-target`)
    nest: str | None = None  # config_class holds `config` under this field (a multimodal release)
    outer: dict = field(default_factory=dict)  # the measured copy's config.json fields beside `nest`
    skipped: tuple[str, ...] = ()  # key prefixes not counted (a vision tower)
    # the release's key names where they differ from transformers' (fragment in transformers' key, the release's)
    released_names: tuple[tuple[str, str], ...] = ()
    # transformers' fused tensor, the release's parts (split evenly along dim 0)
    released_splits: tuple[tuple[str, tuple[str, ...]], ...] = ()
    slice_layers: int = 3  # the measured copy: its first N layers ...
    slice_overrides: dict = field(default_factory=dict)  # ... with these fields changed (said in `notes`)
    measured_tokens: tuple[int, int] = (4096, 4096)  # the measured copy's prefill and LoRA-step lengths
    notes: tuple[str, ...] = ()


GLM5_NOTES = (
    "Config (`bench/common/accounted_versions.py`): transformers' `GlmMoeDsaConfig()` defaults, GLM-5's shapes: hidden "
    "6144, 78 layers (the first 3 dense, MLP 12288; 75 with 256 routed experts of 2048 and one shared, 8 chosen a "
    "token, routed scale 2.5), 64 heads of latent attention (query latent 2048, key/value latent 512, rotary 64, "
    "no-rotary key 192, value 256), a lightning indexer in every layer (32 heads of 128, top 2048 tokens), vocabulary "
    "154880. The multi-token-prediction layer the release ships (`model.layers.78.*`) is not counted.",
    "Measured copy: the first 3 layers (all dense, every attention part at full size) in the release's layout, random "
    "bf16 weights, loaded by the toolkit (`GlmMoeDsaForCausalLM` on transformers' modules); a routed-expert layer "
    "(19.3 GB of bf16 experts) does not fit beside them on this 24 GiB machine, and its weights are exact in the "
    "accounting anyway. Through transformers' own class beside other jobs: prefill peak 9.17 GB, LoRA step 14.59 GB.",
)
GLM53_NOTES = (
    "Config (`bench/common/accounted_versions.py`): transformers' `Glm5NextTextConfig()` defaults, GLM-5.3-Flash's "
    "text shapes: hidden 4096, 45 layers (layer i KDA linear attention unless i % 4 == 3: 34 KDA, 11 sparse), the "
    "first 3 MLPs dense (12288), 42 with 288 routed experts of 2048 and one shared, 8 chosen a token; KDA: 64 heads "
    "of 128 (key and value), a causal conv of 4 over q, k, v; sparse layers: 64 heads of latent attention without "
    "rotary dims (query latent 1536, key/value latent 512, key 256, value 256), an indexer of 32 heads of 128 over "
    "pools of 16 tokens (top 2048 tokens); 4 hyper-connection streams; vocabulary 154880. The multi-token-prediction "
    "layer (`layers.45.*`, `shared_head`) and the vision tower (`model.visual.*`) are not counted.",
    "Measured copy: the first 4 layers (3 KDA, 1 sparse) in the release's layout, random bf16 weights, loaded by the "
    "toolkit (its text model on transformers' modules; the config's 1-block, 32-wide stand-in vision tower not "
    "loaded); layer 3's MLP is the dense one of the first layers, not its 288 routed experts (14.5 GB of "
    "bf16 experts, which do not fit beside the rest on this 24 GiB machine and are exact in the accounting anyway). "
    "Its prefill is 1024 tokens and its LoRA step 512 (GLM-5's: 4096 and 4096): transformers' reference KDA on a CPU "
    "holds 2 MiB of float32 a token in each of its chunk intermediates ([chunks x 64 x 64 x 128] a head). Through "
    "transformers' own class beside other jobs: prefill peak 9.7 GB, LoRA step 13.1 GB (the toolkit's prefill holds "
    "2.4 GB more: not yet traced).",
)

VERSIONS = {
    "glm5": AccountedVersion(
        "glm5", "GLM-5", "scale-glm5", "glm5", GLM5, "GlmMoeDsaConfig", "GlmMoeDsaForCausalLM", "model.",
        LATENT_LORA, slice_layers=3, notes=GLM5_NOTES),
    "glm53-flash": AccountedVersion(
        "glm53-flash", "GLM-5.3-Flash", "scale-glm53-flash", "glm53-flash", GLM53_FLASH, "Glm5NextConfig",
        "Glm5NextForConditionalGeneration", "model.language_model.", LATENT_LORA + KDA_LORA, nest="text_config",
        outer={"vision_config": VISION_STAND_IN}, skipped=("model.visual.",),
        released_names=(("self_attn.forget_gate.", "self_attn."), ("attn_hc.fn", "hc_attn_fn"),
                        ("attn_hc.base", "hc_attn_base"), ("attn_hc.scale", "hc_attn_scale"),
                        ("ffn_hc.fn", "hc_ffn_fn"), ("ffn_hc.base", "hc_ffn_base"), ("ffn_hc.scale", "hc_ffn_scale")),
        released_splits=(("self_attn.conv1d.weight", ("self_attn.q_conv1d.weight", "self_attn.k_conv1d.weight",
                                                      "self_attn.v_conv1d.weight")),),
        slice_layers=4, slice_overrides={"mlp_layer_types": ["dense"] * 4}, measured_tokens=(1024, 512),
        notes=GLM53_NOTES),
}


def sliced_config(version: AccountedVersion, num_layers: int | None = None, overrides: dict | None = None) -> dict:
    """The text config of `version`'s first `num_layers` layers (full size if None), its per-layer lists cut to them;
    `overrides` (default: the row's `slice_overrides` when cut) replace fields."""
    cfg = dict(version.config)
    if num_layers is not None:
        cfg["num_hidden_layers"] = num_layers
        for key in ("layer_types", "mlp_layer_types", "indexer_types"):
            if key in cfg:
                cfg[key] = cfg[key][:num_layers]
        cfg.update(version.slice_overrides if overrides is None else overrides)
    elif overrides:
        cfg.update(overrides)
    return cfg


def transformers_config(version: AccountedVersion, cfg: dict):
    """transformers' config object of the checkpoint (`config_class`), `cfg` nested where the release nests it."""
    import transformers

    cls = getattr(transformers, version.config_class)
    fields = {k: v for k, v in cfg.items() if k not in ("model_type", "architectures")}  # the class's own
    return cls(**{version.nest: fields, **version.outer}) if version.nest else cls(**fields)


def text_config(version: AccountedVersion, cfg: dict):
    """transformers' config object of the text model alone (what the layers read)."""
    config = transformers_config(version, cfg)
    return getattr(config, version.nest) if version.nest else config
