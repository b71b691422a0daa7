"""ChatGLM2-6B, ChatGLM3-6B, GLM-4-9B and GLM-Edge on transformers 5's own `GlmForCausalLM`, GLM-4-0414 on its
`Glm4ForCausalLM`, plus P-tuning v2.

The first three share one architecture (RMSNorm pre-norm blocks, grouped-query attention with a fused
biased `query_key_value`, rotary on half of each head with interleaved pairs, SwiGLU with a fused
`dense_h_to_4h`, untied head), which is transformers' `GlmForCausalLM` with the config of
config.py: its logits equal the official `modeling_chatglm.py`'s. GLM-Edge is released as a `GlmForCausalLM`
of other sizes; GLM-4-0414 as a `Glm4ForCausalLM`, the same blocks with a norm after attention and one after the
MLP, each before its residual add. Their official implementation is transformers' own. What this module adds:
- `PrefixModel` (mixed into `GlmForCausalLMWithPrefix` and `Glm4ForCausalLMWithPrefix`): the official P-tuning
  v2 prefix (prefix.py) as the first
  `pre_seq_len` cache entries, real positions from 0 after it, the mask `[ones(P), attention_mask]`;
  positions from `attention_mask` when none are given (cumsum - 1, 0 on pads: a left-padded batch
  gives the official numbers without the tokenizer's `position_ids`);
- `load_glm`: official checkpoints (sharded .bin / safetensors, official keys, weights.py) and
  transformers' form (glm-4-9b-chat-hf, GLM-4-0414, GLM-Edge: its class picked by config.json, weights that do
  not fit it refused; the later versions' released layouts: experts one by one, GLM-5.3-Flash's text model with its
  released names, next_weights.py, its vision encoder skipped with a note), built on the meta device and filled
  tensor by tensor (no second copy, no pickle, no trust_remote_code);
- INT8/INT4 weight-only quantization of the attention and MLP Linears (`config.QUANTIZABLE_LINEARS`:
  q/k/v, o_proj, gate_up_proj, down_proj as `quant.modules.QuantizedLinear`), in the official ChatGLM2
  layout of its fused Linears (`query_key_value` / `dense` / `dense_h_to_4h` / `dense_4h_to_h`: int8
  `weight` [out, in] or INT4 packed [out, in/2], fp16 per-row `weight_scale` [out], config.json's
  `quantization_bit`; the official ChatGLM-6B quantization format): `load_glm` reads such a directory (q/k/v split by
  rows, scales included) or quantizes a half/float one while reading it, `save_official` writes it;
- with `quantize_embedding`, the untied embedding and head in INT8 too (`QuantizedEmbedding`, a `QuantizedLinear`
  head), quantized as they are read: a runtime form, beyond the official format, that saving refuses;
- `save_official`: the official key layout and config.json, so an official directory round-trips (GLM-4-0414
  and GLM-Edge: transformers' form, as they are released);
Layout: batch-first, hidden [b, s, h], cache tensors [b, G, s, D] (transformers' `DynamicCache`).
References: the official ChatGLM2/3 and GLM-4 checkpoint layout, as the official modeling code names it;
the official code (ChatGLM2 `syjjhl/chatglm2-6b`, ChatGLM3 `czk1997/chatglm3-copy`);
transformers `models/glm/modeling_glm.py`.
"""

from __future__ import annotations

import copy
import json
import re
import sys
from pathlib import Path

import torch
from torch import nn
from transformers import (Glm4ForCausalLM, Glm4MoeForCausalLM, Glm4MoeLiteForCausalLM, GlmConfig, GlmForCausalLM,
                          GlmMoeDsaForCausalLM)
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from chatglm_tune.data.batches import segment_positions, segment_visibility
from chatglm_tune.decoding.chat import Chat
from chatglm_tune.models.glm.attention import ATTENTION
from chatglm_tune.models.loss import causal_lm_loss
from chatglm_tune.runtime import checkpoint, heap
from chatglm_tune.runtime.checkpoint import CheckpointError
from chatglm_tune.models.glm.config import (ARCHITECTURES, FORMATS, TRANSFORMERS_FORMS, check_prefix_config, glm_config,
                                            official_config, quantizable_linears, read_version, stored_format,
                                            transformers_form)
from chatglm_tune.models.glm.experts import ExpertAssembler, is_prediction_layer, released_experts
from chatglm_tune.models.glm.latent_attention import LatentAttention
from chatglm_tune.models.glm.latent_layer import use_held_steps
from chatglm_tune.models.glm.moe_layer import use_grouped_decode
from chatglm_tune.models.glm.next_model import Glm5NextTextForCausalLM, NextPrefix
from chatglm_tune.models.glm.next_weights import VISION_KEYS, ConvAssembler, released_layout, transformers_name
from chatglm_tune.models.glm.prefix import (cache_entry, positions_from_mask, prefix_encoder, prefix_formula,
                                            prefix_width, reentrant_checkpointing)
from chatglm_tune.models.glm.sparse_attention import SparseAttention
from chatglm_tune.models.glm.weights import (OFFICIAL_PREFIX_ENCODER, PREFIX_ENCODER, qkv_rows, to_official,
                                             to_transformers)
from chatglm_tune.models.prefix import (PREFIX_DROPOUT, PrefixCache, cache_empty, check_prefix_shapes, not_a_model,
                                        only_prefix_weights, prefix_key_values, seed_cache)
from chatglm_tune.quant import cpu_matmul
from chatglm_tune.quant.apply import quantize_embedding as int8_embedding_and_head
from chatglm_tune.quant.apply import quantize_model, refuse_int8_embedding
from chatglm_tune.quant.experts import quantize_experts
from chatglm_tune.quant.format import check_bits, quantize_rows
from chatglm_tune.quant.modules import QuantizedEmbedding, QuantizedLinear


def packed_mask(segment_ids: torch.Tensor, prefix: int) -> torch.Tensor:
    """[b, 1, s, prefix + s] bool, True = may attend, of packed rows: causal within each example, the P-tuning prefix
    seen by all; a pad sees itself only (a row of SDPA with no key would be NaN)."""
    s = segment_ids.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=segment_ids.device).tril()
    seen = (segment_visibility(segment_ids) & causal) | torch.eye(s, dtype=torch.bool, device=segment_ids.device)
    if prefix:
        seen = torch.cat([seen.new_ones(seen.shape[0], s, prefix), seen], dim=-1)
    return seen[:, None]


class PrefixModel(Chat):
    """What the toolkit adds to a transformers causal LM of this family: the P-tuning v2 prefix encoder when
    `config.pre_seq_len` is set, the forward that puts it first in the cache, and official loading and saving.
    Mixed in before the transformers class (`GlmForCausalLMWithPrefix`, `Glm4ForCausalLMWithPrefix`).

    Nothing is frozen here: which parameters train is the training code's decision.
    """

    def __init__(self, config: GlmConfig):
        super().__init__(config)
        # The official embedding has no padding_idx: the pad row gets gradients in full fine-tuning too.
        self.model.embed_tokens.padding_idx = None
        self.prefix_encoder = prefix_encoder(config) if getattr(config, "pre_seq_len", None) else None
        self.prefix_dropout = nn.Dropout(PREFIX_DROPOUT)
        if config._attn_implementation == "sdpa":  # transformers' default: the same, with a faster decode step
            self.set_attn_implementation(ATTENTION)
        for layer in self.model.layers:
            # Checkpointed layers keep the cache they are given; forward only gives them a read-only
            # PrefixCache while checkpointing (see prefix.PrefixCache), never a cache they write.
            layer._can_checkpoint_with_cache = True
        heap.trim_after_each(self.model.layers)
        cpu_matmul.adopt(self)  # the toolkit's CPU products (few rows; bf16 without native bf16 GEMMs)

    @property
    def pre_seq_len(self) -> int:
        return getattr(self.config, "pre_seq_len", None) or 0

    def prefix_key_values(self, batch_size: int, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (key, value) [b, G, P, D] of the prefix, in the cache's form (`prefix.cache_entry`; dropout
        applies in training mode)."""
        heads, key, value = cache_entry(self.config)
        return prefix_key_values(self.prefix_encoder, self.prefix_dropout, self.config.num_hidden_layers, heads, key,
                                 batch_size, dtype, value)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        *,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        segment_ids: torch.LongTensor | None = None,
        **kwargs,
    ):
        """Logits [b, s, V] (and loss, cache) for input_ids [b, s].

        attention_mask: [b, past + s], 1 = token, over real tokens (prefix columns are added here); a 4D
            mask is passed through as is and must then cover the prefix itself.
        position_ids: [b, s]; default from attention_mask (cumsum - 1, continuing after the cached real
            tokens), else past .. past + s - 1. The prefix has no position.
        cache: a `Cache`; with a prefix its first `pre_seq_len` entries are the prefix, written on
            the first call (empty cache). Without a cache (use_cache=False, training) the prefix rides in a
            read-only `PrefixCache` that is not returned.
        labels: [b, s], -100 ignored; loss = mean cross entropy of logits[:, :-1] against labels[:, 1:], the
            output layer run on the labelled positions only (`loss.causal_lm_loss`); no logits are returned then.
        logits_to_keep (without labels): 0 = all positions, N = the last N.
        segment_ids: [b, s] of packed training rows (`batches.collate_packed`): 1, 2, ... an example, 0 on pads;
            each example then sees only itself (and the prefix), its positions from 0.
        """
        ref = input_ids if input_ids is not None else inputs_embeds
        b, s = ref.shape[:2]
        use_cache = self._use_cache(cache, use_cache)
        keep_cache = True
        if cache is None and use_cache:
            cache = DynamicCache(config=self.config)
        p = self.pre_seq_len
        if p and (cache is None or cache_empty(cache)):
            dtype = self.model.norm.weight.dtype  # the compute dtype (RMSNorm weights are never quantized)
            pairs = self.prefix_key_values(b, dtype)
            if cache is None:
                cache, keep_cache = PrefixCache(pairs), False
            else:
                seed_cache(cache, pairs)
        past = cache.get_seq_length() - p if cache is not None else 0  # real tokens already cached
        mask = attention_mask
        if segment_ids is not None:  # packed rows: each example alone
            if mask is not None or past:
                raise ValueError("segment_ids (packed training rows) take no attention_mask and no cached tokens")
            mask, position_ids = packed_mask(segment_ids, p), segment_positions(segment_ids)
        elif mask is not None and mask.dim() == 2:
            if position_ids is None:
                position_ids = positions_from_mask(mask, past, s)
            if p:
                mask = torch.cat([mask.new_ones(b, p), mask], dim=-1)
        if position_ids is None:
            position_ids = torch.arange(past, past + s, device=ref.device).expand(b, s)
        inputs = dict(input_ids=input_ids, attention_mask=mask, position_ids=position_ids, cache=cache,
                      inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
        out = self._outputs(inputs, labels, logits_to_keep, super().forward)
        if not keep_cache or not use_cache:
            out.cache = None
        return out

    def _use_cache(self, cache: Cache | None, use_cache: bool | None) -> bool:
        """Whether the forward keeps a cache: as asked (default: the config's), never under gradient checkpointing in
        training, which takes none (the prefix is made in the forward) and only the non-reentrant kind with a prefix:
        reentrant checkpointing only differentiates its positional inputs, and the prefix, held in the cache, would be
        backpropagated once per layer through one shared graph."""
        layers = self.model.layers
        if not (self.training and any(layer.gradient_checkpointing for layer in layers)):
            return self.config.use_cache if use_cache is None else use_cache
        if cache is not None:
            raise ValueError("gradient checkpointing in training takes no cache (the prefix is built here)")
        if self.pre_seq_len and any(reentrant_checkpointing(layer) for layer in layers):
            raise ValueError("P-tuning needs non-reentrant gradient checkpointing (use_reentrant=False, the default)")
        return False

    def _outputs(self, inputs: dict, labels: torch.LongTensor | None, logits_to_keep, logits_forward):
        """The forward's output for the trunk's `inputs`: `logits_forward` (the transformers class's forward) without
        labels; with them the loss, the output layer run on the labelled positions only, in chunks
        (`loss.causal_lm_loss`), and no logits."""
        if labels is None:
            return logits_forward(**inputs, logits_to_keep=logits_to_keep)
        trunk = self.model(**inputs)
        return CausalLMOutputWithPast(loss=causal_lm_loss(self.lm_head, trunk.last_hidden_state, labels),
                                      cache=trunk.cache, hidden_states=trunk.hidden_states, attentions=trunk.attentions)

    def prompt_positions(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
        """None: the forward derives positions from the attention mask (what a decoding loop asks first)."""
        return None

    def load_prefix(self, path: str | Path) -> None:
        """Load an official P-tuning v2 checkpoint (`transformer.prefix_encoder.*`; a file, or a directory
        with config.json + weights) onto this model.

        A model built without `pre_seq_len` takes the checkpoint's settings (read from its tensors);
        one built with other settings refuses it, naming both. So is refused, naming both, a checkpoint of
        another version (its config.json: a ChatGLM3-6B prefix on GLM-4, ...) or of another width than
        this model's W = num_layers * 2 * kv_channels * multi_query_group_num.
        """
        source = Path(path)
        tensors: dict[str, torch.Tensor] = {}
        for file in checkpoint.weight_files(source):
            for key, tensor in checkpoint.iter_tensors(file):
                if not key.startswith(OFFICIAL_PREFIX_ENCODER):
                    raise CheckpointError(f"{file}: {key} is not a prefix-encoder weight (expected only "
                                          f"{OFFICIAL_PREFIX_ENCODER}*)")
                tensors[key.removeprefix(OFFICIAL_PREFIX_ENCODER)] = tensor
        if "embedding.weight" not in tensors:
            raise CheckpointError(f"{source}: no {OFFICIAL_PREFIX_ENCODER}embedding.weight")
        theirs = (tensors["embedding.weight"].shape[0], any(k.startswith("trans.") for k in tensors))
        if source.is_dir() and (source / "config.json").exists():
            saved = json.loads((source / "config.json").read_text())
            if "pre_seq_len" in saved and (saved["pre_seq_len"], bool(saved.get("prefix_projection"))) != theirs:
                raise CheckpointError(f"{source}: config.json says pre_seq_len={saved['pre_seq_len']}, "
                                      f"prefix_projection={bool(saved.get('prefix_projection'))}, its weights "
                                      f"pre_seq_len={theirs[0]}, prefix_projection={theirs[1]}")
        encoder = self.prefix_encoder
        if encoder is None:  # built aside, and kept only once the checkpoint fits it
            settings = copy.copy(self.config)
            settings.pre_seq_len, settings.prefix_projection = theirs
            encoder = prefix_encoder(settings)
        ours = (encoder.embedding.num_embeddings, encoder.prefix_projection)
        if ours != theirs:
            raise CheckpointError(f"{source} was trained with pre_seq_len={theirs[0]}, prefix_projection={theirs[1]}; "
                                  f"this model has pre_seq_len={ours[0]}, prefix_projection={ours[1]}")
        expected = encoder.state_dict()
        if set(tensors) != set(expected):
            raise CheckpointError(f"{source}: prefix keys {sorted(tensors)}, expected {sorted(expected)}")
        c = self.config
        check_prefix_shapes(source, {OFFICIAL_PREFIX_ENCODER + k: t.shape for k, t in tensors.items()},
                            {OFFICIAL_PREFIX_ENCODER + k: t.shape for k, t in expected.items()}, prefix_width(c),
                            prefix_formula(c))
        check_prefix_config(source, c.chatglm_version)  # ChatGLM3-6B and GLM-4 prefixes can be of equal shape
        encoder.load_state_dict({k: t.float() for k, t in tensors.items()})  # kept in float32
        if self.prefix_encoder is None:
            self.config.pre_seq_len, self.config.prefix_projection = theirs
            self.prefix_encoder = encoder.to(self.model.norm.weight.device)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs) -> "PrefixModel":
        """`load_glm` (transformers' own loader knows neither the official keys nor the prefix)."""
        return load_glm(pretrained_model_name_or_path, **kwargs)

    def save_pretrained(self, save_directory, state_dict: dict | None = None, dtype: torch.dtype | None = None,
                        max_shard_bytes: int = 2 << 30, **unused) -> None:
        """`save_official`: the version's released layout and config.json (transformers' saving options are
        not supported)."""
        if any(v is not None for v in unused.values()):
            raise TypeError(f"save_pretrained does not support: {', '.join(sorted(unused))}")
        save_official(self, save_directory, state_dict=state_dict, dtype=dtype, max_shard_bytes=max_shard_bytes)


class GlmForCausalLMWithPrefix(PrefixModel, GlmForCausalLM):
    """ChatGLM2/3, GLM-4 and GLM-Edge: transformers' `GlmForCausalLM` with the P-tuning v2 prefix."""

    static_cache = True  # decodes on transformers' StaticCache (decoding.static_decoding)


class Glm4ForCausalLMWithPrefix(PrefixModel, Glm4ForCausalLM):
    """GLM-4-0414 (and GLM-Z1): transformers' `Glm4ForCausalLM` (a norm after attention and after the MLP, before
    each residual add) with the P-tuning v2 prefix."""

    static_cache = True  # decodes on transformers' StaticCache (decoding.static_decoding)


class Glm4MoeForCausalLMWithPrefix(PrefixModel, Glm4MoeForCausalLM):
    """GLM-4.5 / 4.6 / 4.7: transformers' `Glm4MoeForCausalLM` (routed and shared experts after dense first layers)
    with the P-tuning v2 prefix; over INT experts a decode step runs each layer's experts in two grouped kernel calls
    (`moe_layer`)."""

    static_cache = True  # decodes on transformers' StaticCache (decoding.static_decoding)

    def __init__(self, config):
        super().__init__(config)
        use_grouped_decode(self)


class _LatentPrefix:
    """The P-tuning prefix of latent attention (GLM-4.7-Flash's, GLM-5's): each head's own keys and values, handed to
    every layer's attention (`latent_attention.HeadPrefix.head_prefix`), zeros in their place in the cache."""

    def prefix_key_values(self, batch_size: int, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The prefix's cache entries: per layer P zero latents [b, 1, P, kv_lora_rank] and zero shared keys [b, 1, P,
        the layer's `cached_key_width`], whose place each layer's attention gives its heads' own prefix keys and
        values, handed to it here (glm/prefix.py)."""
        pairs = super().prefix_key_values(batch_size, dtype)
        for layer, pair in zip(self.model.layers, pairs):
            layer.self_attn.head_prefix = pair
        shape = (batch_size, 1, self.pre_seq_len)
        zeros = pairs[0][0].new_zeros
        return [(zeros(*shape, self.config.kv_lora_rank), zeros(*shape, layer.self_attn.cached_key_width()))
                for layer in self.model.layers]


class Glm4MoeLiteForCausalLMWithPrefix(_LatentPrefix, PrefixModel, Glm4MoeLiteForCausalLM):
    """GLM-4.7-Flash: transformers' `Glm4MoeLiteForCausalLM` (latent attention, experts) with the P-tuning v2 prefix
    as each head's first keys and values (zero latents in its place in the cache); its decode steps attend to the
    cached latents themselves (`latent_attention.LatentAttention`, the same parameters and cache) and run the experts
    as GLM-4.5's do; each layer with experts holds its one-token decode step in C++ (`latent_layer.LatentLayer`, the
    class FSDP wraps)."""

    static_cache = True  # decodes on transformers' StaticCache (decoding.static_decoding)

    def __init__(self, config):
        super().__init__(config)
        for layer in self.model.layers:
            layer.self_attn.__class__ = LatentAttention
        use_grouped_decode(self)
        use_held_steps(self)


class GlmMoeDsaForCausalLMWithPrefix(_LatentPrefix, PrefixModel, GlmMoeDsaForCausalLM):
    """GLM-5 / 5.1 / 5.2 / 5.3: transformers' `GlmMoeDsaForCausalLM` (latent attention with DeepSeek Sparse Attention,
    experts) with the indexer's keys in the latents' cache entries and the P-tuning v2 prefix as each head's first
    keys and values, every query seeing all of them (`sparse_attention.SparseAttention`); the experts' decode steps
    as GLM-4.5's."""

    static_cache = True  # decodes on transformers' StaticCache (decoding.static_decoding)
    keeps_float32 = True  # `_kept_float32`: the indexer's head weights, the routers

    def __init__(self, config):
        super().__init__(config)
        for layer in self.model.layers:
            layer.self_attn.__class__ = SparseAttention
        use_grouped_decode(self)


class Glm5NextForCausalLMWithPrefix(NextPrefix, PrefixModel, Glm5NextTextForCausalLM):
    """GLM-5.3-Flash: transformers' `glm5_next` text model and head under the released keys, with the P-tuning v2
    prefix in both kinds of its layers, its hybrid cache and left pads that change no row (`next_model.NextPrefix`)."""

    keeps_float32 = True  # `_kept_float32`: the KDA convolution and decay, hyper-connections, routers


# by TRANSFORMERS_FORMS' model_type
MODEL_CLASSES = {"glm": GlmForCausalLMWithPrefix, "glm4": Glm4ForCausalLMWithPrefix,
                 "glm4_moe": Glm4MoeForCausalLMWithPrefix, "glm4_moe_lite": Glm4MoeLiteForCausalLMWithPrefix,
                 "glm_moe_dsa": GlmMoeDsaForCausalLMWithPrefix, "glm5_next": Glm5NextForCausalLMWithPrefix}


def model_class(version: str) -> type[PrefixModel]:
    """The model class of a version: transformers' class of its released form, else `GlmForCausalLM`."""
    return MODEL_CLASSES[TRANSFORMERS_FORMS.get(version, "glm")]


def load_glm(
    path: str | Path,
    *,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str = "cpu",
    pre_seq_len: int | None = None,
    prefix_projection: bool | None = None,
    quantization_bit: int | None = None,
    group_size: int = 0,
    quantization_group_size: int | None = None,
    quantize_embedding: bool = False,
) -> PrefixModel:
    """A ChatGLM2/3, GLM-4, GLM-4-0414 or GLM-Edge model from a local directory (or weights file beside its
    config.json).

    dtype: the compute dtype (default float32; "auto" = config.json's `torch_dtype`); the prefix encoder
        stays float32. pre_seq_len / prefix_projection: P-tuning v2 settings, overriding config.json's.
    quantization_bit 4 / 8: the attention and MLP Linears (`family.quantizable_linears`) become INT4 / INT8
        `QuantizedLinear`s, each weight quantized a few rows at a time as it is read (the official per-row
        rule, in `dtype`: per row, so q/k/v quantized apart hold exactly the integers and scales of the
        official fused `query_key_value`); `group_size` (alias `quantization_group_size`, as
        `ChatGLMForConditionalGeneration.from_pretrained` names it) > 0: group-wise INT4 scales (our
        extension). A directory whose config.json says `quantization_bit` (the official INT8/INT4 layout:
        `weight` int8 [out, in] or packed [out, in/2] + fp16 `weight_scale` under the official keys) loads
        as stored; asking it for other bits raises ValueError. `config.quantization_bit` /
        `config.quantization_group_size` record the format (0 = float weights).
    quantize_embedding: the untied input embedding and `lm_head` become INT8 (`QuantizedEmbedding`, and a
        `QuantizedLinear` head; per-row scales, the official rule), each quantized a few rows at a time as it
        is read, as the Linears are: no float copy of either ever exists. Any `quantization_bit` or stored
        format beside it. A runtime form, which `save_official` refuses (`quant.apply.quantize_embedding`).
    Prefix-encoder weights may be absent (a fresh P-tuning start, PyTorch's init); any other missing,
    unexpected, wrong-shaped or wrong-typed tensor raises `CheckpointError` naming the file and key, and a
    directory of prefix weights only (a P-tuning run or checkpoint) one saying what to load instead.
    `config.name_or_path` is the absolute directory loaded (what a LoRA adapter trained on it records).
    """
    raw = checkpoint.read_config_file(path)
    try:
        version = read_version(raw, path)
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}; a ChatGLM-6B (v1) directory loads with ChatGLMForConditionalGeneration, "
                              "and chatglm_tune.from_pretrained loads every version") from None
    bits, group_size, stored = _load_format(raw, path, quantization_bit, group_size, quantization_group_size)
    config = glm_config(raw, version=version, pre_seq_len=pre_seq_len, prefix_projection=prefix_projection)
    # Where it came from, as an absolute directory: peft records it as an adapter's base_model_name_or_path.
    config.name_or_path = str((Path(path) if Path(path).is_dir() else Path(path).parent).resolve())
    dtype = checkpoint.resolve_dtype(dtype, raw.get("torch_dtype") or raw.get("dtype"))
    model, quantized = _empty_model(config, path, bits, group_size, stored, dtype if quantize_embedding else None)
    expected = {**dict(model.named_parameters()), **_persistent_buffers(model)}
    # released experts and convolutions (GLM-5.3-Flash's) in parts, which may span files
    conv_dtype = torch.float32 if _kept_float32(model, "conv1d.weight", dtype) else dtype  # GLM-5.3-Flash's
    assemblers = (ExpertAssembler(model, expected, dtype), ConvAssembler(model, expected, conv_dtype))
    vision: list[str] = []  # the keys of a released vision encoder (GLM-5.3-Flash's), not loaded
    for file in checkpoint.weight_files(path):
        _read_file(model, file, raw, expected, quantized, dtype, assemblers, vision)
    if vision:
        print(f"note: {path}: its vision encoder ({VISION_KEYS}*, {len(vision)} tensors) is not loaded: the toolkit "
              f"runs {FORMATS[version].title}'s text model", file=sys.stderr)
    not_prefix = [k for k in expected if not k.startswith(PREFIX_ENCODER)]
    if not_prefix:
        if only_prefix_weights(path, OFFICIAL_PREFIX_ENCODER):
            raise CheckpointError(not_a_model(path))
        shown = ", ".join(not_prefix[:8]) + (f" and {len(not_prefix) - 8} more" if len(not_prefix) > 8 else "")
        raise CheckpointError(f"{path}: missing weights: {shown}{_sandwich_hint(not_prefix, raw)}")
    if expected:  # a fresh prefix encoder, initialised as the official one is
        model.prefix_encoder = prefix_encoder(config)
    if hasattr(model.model, "rotary_emb"):  # its buffer was built on the meta device (GLM-5.3-Flash has no rotary dims)
        model.model.rotary_emb = type(model.model.rotary_emb)(config=config)
    config.dtype = dtype
    return model.to(device).eval()


def _read_file(model: PrefixModel, file, raw: dict, expected: dict, quantized: dict, dtype: torch.dtype,
               assemblers: tuple, vision: list[str]) -> None:
    """Place every tensor of one weight file into `model` (`_place`; `expected` loses what is placed), official
    keys mapped to transformers' (q/k/v split by rows), released ones too (`_released_pairs`)."""
    config = model.config
    official_keys = raw.get("model_type") not in ARCHITECTURES  # else transformers' own key names
    rows = qkv_rows(config) if official_keys else None
    pages = checkpoint._FilePages(file)  # each tensor's file pages are released once it is copied out
    for key, tensor in checkpoint.iter_tensors(file):
        if official_keys or key.startswith(OFFICIAL_PREFIX_ENCODER):
            try:
                pairs = to_transformers(key, tensor, rows)
            except ValueError as e:  # a fused tensor whose rows do not add up to q | k | v
                raise CheckpointError(f"{file}: {key} has shape {list(tensor.shape)}: {e}; does config.json match "
                                      "these weights?") from e
        else:
            pairs = [] if key.endswith("rotary_emb.inv_freq") else [(key, tensor)]
        if pairs is None:
            raise CheckpointError(f"{file}: unexpected key {key} (not a weight of a ChatGLM2/3 / GLM-4 model)")
        if not official_keys:
            _check_architecture(key, file, raw)
            pairs = _released_pairs(key, tensor, pairs, config, expected, assemblers, vision, file)
        for name, part in pairs:
            _place(model, name, part, file, key, expected, quantized, dtype, pages, raw)
        pages.release(tensor)
        del tensor, pairs
    pages.close()


def _released_pairs(key: str, tensor: torch.Tensor, pairs: list, config, expected: dict, assemblers: tuple,
                    vision: list[str], file) -> list:
    """(model name, tensor) of a key in transformers' released form: none for a multi-token-prediction layer
    (`is_prediction_layer`), a vision encoder's tensor (listed in `vision`) or a part an assembler takes (a released
    expert into its fused weight, GLM-5.3-Flash's convolution parts into one); GLM-5.3-Flash's released names as
    transformers names the modules (`next_weights.transformers_name`); fused 3D experts split for a model holding them
    one by one (INT)."""
    if key.startswith(VISION_KEYS):
        vision.append(key)
        return []
    name = transformers_name(key)
    if is_prediction_layer(name, config) or any(assembler.take(name, tensor, file) for assembler in assemblers):
        return []
    pairs = [(transformers_name(k), t) for k, t in pairs]
    return list(released_experts(dict(pairs)).items()) if name not in expected else pairs


def _persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers a checkpoint holds (a router's `e_score_correction_bias`; not the rotary tables)."""
    saved = set(model.state_dict())
    return {name: buffer for name, buffer in model.named_buffers() if name in saved}


def _empty_model(config: GlmConfig, path, bits: int, group_size: int, stored: bool,
                 int8_embedding: torch.dtype | None) -> tuple[PrefixModel, dict]:
    """(the model on the meta device, with empty INT layers of the format to load, {module name: layer} of the
    layers that `_place` quantizes into as it reads their float weights: the block Linears of a float
    checkpoint quantized at load, and with `int8_embedding` (the compute dtype) the embedding and head)."""
    with torch.device("meta"):
        model = model_class(config.chatglm_version)(config)
    config.quantization_bit, config.quantization_group_size = 0, 0
    if bits:
        try:
            quantize_model(model, bits, group_size, targets=quantizable_linears(config.chatglm_version),
                           empty_init=True)
            quantize_experts(model, bits, group_size, empty_init=True)
        except ValueError as e:
            raise CheckpointError(f"{path}: cannot hold INT{bits} weights (group_size={group_size}): {e}") from e
    quantized = {} if stored else {name: m for name, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    if int8_embedding:
        int8_embedding_and_head(model, empty_init=True, dtype=int8_embedding)
        names = {id(module): name for name, module in model.named_modules()}  # GLM-5.3-Flash's: in its text model
        quantized.update({names[id(layer)]: layer
                          for layer in (model.get_input_embeddings(), model.get_output_embeddings())})
    return model, quantized


def _load_format(raw: dict, path, bits: int | None, group_size: int, alias: int | None) -> tuple[int, int, bool]:
    """(bits, group_size, stored) that `load_glm` builds: the stored format of an INT checkpoint (refusing
    other bits), else the requested one; 0 bits = float weights."""
    if alias is not None:
        if group_size and alias != group_size:
            raise ValueError(f"group_size={group_size} and quantization_group_size={alias} disagree")
        group_size = alias
    if bits not in (None, 0, 4, 8):
        raise ValueError(f"quantization_bit must be 4 or 8 (or None for the weights as stored), got {bits!r}")
    if not isinstance(group_size, int) or group_size < 0:
        raise ValueError(f"group_size must be a column count >= 0 (0 = per-row scales), got {group_size!r}")
    stored = stored_format(raw)
    stored_bits, stored_group = stored["quantization_bit"], stored["quantization_group_size"]
    check_bits(stored_bits, bits, path)
    if stored_bits:
        if bits and group_size != stored_group:
            raise ValueError(f"{path} holds INT{stored_bits} weights with group_size={stored_group}; "
                             f"cannot load them with group_size={group_size}")
        return stored_bits, stored_group, True
    if bits == 8 and group_size:
        raise ValueError("group-wise scales are an INT4 extension: use group_size=0 with quantization_bit=8")
    return bits or 0, group_size if bits else 0, False


def _place(model, name: str, part: torch.Tensor, file, key: str, expected: dict, quantized: dict,
           dtype: torch.dtype, pages, raw: dict) -> None:
    """Put the tensor `part` (file key `key`, model name `name`) into the model: quantized into its layer
    while loading (`quantized`: `_empty_model`'s), or checked (known, same kind, same shape) and copied out of
    the file map."""
    owner, _, attr = name.rpartition(".")
    layer = quantized.get(owner)
    if layer is not None and attr == "weight" and part.is_floating_point():
        _quantize_into(layer, name, part, file, key, expected, dtype, pages)
        return
    if name not in expected:
        raise CheckpointError(_unexpected(file, key, name, model.config))
    target = expected.pop(name)
    if part.is_floating_point() != target.is_floating_point():
        raise CheckpointError(_wrong_type(file, key, part, target, raw))
    if tuple(part.shape) != tuple(target.shape):
        layout = (f" (config.json's quantization_bit={raw.get('quantization_bit')}: INT8 weights are [out, in], INT4 "
                  "ones packed [out, in/2])" if attr == "weight" and not target.is_floating_point() else "")
        raise CheckpointError(f"{file}: {key} gives {name} of shape {list(part.shape)}, the model expects "
                              f"{list(target.shape)}{layout}; does config.json match these weights?")
    value = checkpoint.copy_out(name, part, torch.float32 if _kept_float32(model, name, dtype) else dtype, pages,
                                prefix_key=PREFIX_ENCODER)
    module = model.get_submodule(owner)
    if attr in module._buffers:  # a router's score correction
        module._buffers[attr] = value
    else:
        module._parameters[attr] = nn.Parameter(value, requires_grad=target.requires_grad)


def _kept_float32(model: nn.Module, name: str, dtype: torch.dtype) -> bool:
    """Whether the weight `name` loads in float32 rather than `dtype`: where the model's class says so
    (`keeps_float32`: GLM-5, GLM-5.3-Flash), the modules transformers' own loading keeps in float32: in float16 and
    bfloat16 its `_keep_in_fp32_modules_strict` (the routers; GLM-5.3-Flash's KDA convolution and decay, its
    hyper-connections' base and scale), in float16 its `_keep_in_fp32_modules` too (GLM-5's indexer head weights)."""
    if not getattr(model, "keeps_float32", False) or dtype == torch.float32:
        return False
    kept = [*(getattr(model, "_keep_in_fp32_modules_strict", None) or ()),
            *((model._keep_in_fp32_modules or ()) if dtype == torch.float16 else ())]
    return any(re.search(rf"(^|\.){re.escape(module)}(\.|$)", name) for module in kept)


def _quantize_into(layer: QuantizedLinear | QuantizedEmbedding, name: str, part: torch.Tensor, file, key: str,
                   expected: dict, dtype: torch.dtype, pages) -> None:
    """Quantize the float weight `part` [out, in] (rows of the file's tensor) into `layer`, a few rows at a
    time with their file pages released: no whole float copy of it is ever made."""
    owner = name.rpartition(".")[0]
    rows, columns = layer.weight.shape  # an INT4 weight packs two columns a byte
    shape = [rows, columns * 8 // layer.bits]
    if list(part.shape) != shape:
        raise CheckpointError(f"{file}: {key} gives {name} of shape {list(part.shape)}, the model expects "
                              f"{shape}; does config.json match these weights?")
    if name not in expected:
        raise CheckpointError(f"{file}: {key} gives {name} twice")
    expected.pop(name)
    expected.pop(f"{owner}.weight_scale")
    q, scale = quantize_rows(part, dtype, layer.bits, layer.group_size, pages.release)
    layer.weight = nn.Parameter(q, requires_grad=False)
    layer.weight_scale = nn.Parameter(scale, requires_grad=False)


SANDWICH_NORMS = ("post_self_attn_layernorm", "post_mlp_layernorm")  # GLM-4-0414's, in every layer


def _check_architecture(key: str, file, raw: dict) -> None:
    """Refuse a weight of GLM-4-0414's extra norms in a `model_type: glm` directory: `GlmForCausalLM` has no place
    for them, and a model without them would compute something else."""
    if raw.get("model_type") == "glm" and any(f".{norm}." in key for norm in SANDWICH_NORMS):
        raise CheckpointError(f"{file}: {key} is a norm of Glm4ForCausalLM (GLM-4-0414), but config.json says "
                              "model_type glm (GlmForCausalLM, which has none): config.json should say model_type glm4")


def _sandwich_hint(missing: list[str], raw: dict) -> str:
    if raw.get("model_type") == "glm4" and any(norm in name for name in missing for norm in SANDWICH_NORMS):
        return (" (config.json says model_type glm4, GLM-4-0414's Glm4ForCausalLM with a norm after attention and "
                "after the MLP; weights without them are a GlmForCausalLM: model_type glm)")
    return ""


def _wrong_type(file, key: str, part: torch.Tensor, target: torch.Tensor, raw: dict) -> str:
    if not part.is_floating_point():
        return (f"{file}: {key} holds {part.dtype} weights but config.json says no quantization_bit; an official "
                "INT8/INT4 checkpoint says quantization_bit 8 or 4 in its config.json")
    return (f"{file}: {key} holds {part.dtype} weights where an INT{raw.get('quantization_bit')} checkpoint "
            f"(config.json's quantization_bit) stores {target.dtype}")


def save_official(
    model: PrefixModel,
    directory: str | Path,
    *,
    state_dict: dict[str, torch.Tensor] | None = None,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 2 << 30,
) -> None:
    """Write `model` as an official checkpoint: config.json + safetensors under the official keys (GLM-4-0414 and
    GLM-Edge, released in transformers' own form: transformers' keys and config.json, `transformers_form`).

    state_dict: what to write, in transformers names (default: everything; pass e.g. only the
        `prefix_encoder.*` entries for an official P-tuning checkpoint). dtype: cast floating weights
        (not the prefix encoder, kept float32 as the official P-tuning saves it, nor the fp16
        `weight_scale`s); config.json's `torch_dtype` says the trunk's dtype.
    A quantized model (`load_glm(..., quantization_bit=...)`, `quant.apply.quantize_model`) is written in
    the official INT8/INT4 layout: q/k/v's int8 (INT4: packed) `weight`, fp16 `weight_scale` and `bias`
    re-fused by rows into `query_key_value.{weight,weight_scale,bias}`, the other Linears under their
    official names, and config.json's `quantization_bit` (plus our `quantization_group_size` when the
    INT4 scales are group-wise), so `load_glm` reads it back bit for bit. An INT8 embedding or head
    (`quantize_embedding`) has no official layout: ValueError.
    """
    state = dict(model.state_dict() if state_dict is None else state_dict)
    refuse_int8_embedding(state, ("model.embed_tokens.weight_scale", "lm_head.weight_scale"))
    if dtype is not None:
        state = {k: (v.to(dtype) if _castable(k, v) else v) for k, v in state.items()}
    trunk = next((v.dtype for k, v in state.items() if _castable(k, v)), None) or model.dtype
    if model.config.chatglm_version in TRANSFORMERS_FORMS:  # released in transformers' form: written back in it
        # the prefix under its official key, as every P-tuning checkpoint of the family holds it
        written = {(OFFICIAL_PREFIX_ENCODER + k.removeprefix(PREFIX_ENCODER) if k.startswith(PREFIX_ENCODER) else k): v
                   for k, v in released_layout(state).items()}
        config = transformers_form(model.config, trunk)
    else:
        written, config = to_official(state), official_config(model.config, trunk)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    checkpoint.save_state_dict(written, directory, max_shard_bytes=max_shard_bytes)
    text = json.dumps(config, indent=2) + "\n"
    checkpoint.atomic_write(directory / "config.json", lambda p: Path(p).write_text(text))


def _castable(key: str, tensor: torch.Tensor) -> bool:
    """Whether `save_official(dtype=...)` casts this tensor: floating trunk weights, never the prefix
    encoder (float32) nor the quantization scales (fp16 by the official format)."""
    return tensor.is_floating_point() and not key.startswith(PREFIX_ENCODER) and not key.endswith(".weight_scale")


def _unexpected(file, key: str, name: str, config) -> str:
    if name.startswith(PREFIX_ENCODER):
        return (f"{file}: holds P-tuning weights ({key}) but the model has "
                f"pre_seq_len={getattr(config, 'pre_seq_len', None)}, "
                f"prefix_projection={getattr(config, 'prefix_projection', False)}; load with the settings it was "
                "trained with, or load the base and call load_prefix")
    return f"{file}: unexpected key {key} (not a weight of this config)"
