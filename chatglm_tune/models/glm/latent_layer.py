"""GLM-4.7-Flash's decoder layer with its one-token decode step held in C++.

Over INT8 / INT4 weights a decode step of a layer is the input norm, latent attention against the cached latents
(`latent_attention.LatentAttention`), the residual, the post-attention norm, the mixture-of-experts step (`moe_layer`,
already one C++ call) and the residual: about 60 small operations besides the kernels' products, each paying Python's
and nn.Module's cost. `LatentLayer` runs all of it as two calls of one C++ object (`int8dot_cpu.latent_layer`) around
the cache's own update, computing what the Python step computes, bit for bit, in less time (figures:
bench/results/kernel-notes.md). It is made once from the layer's modules as they stand and made again when a layout, a
submodule or a parameter changes (`modules.layouts_epoch`, as the experts' step); a step with more than one token,
gradients, training, a hook on any of the layer's modules, a P-tuning prefix, or a module the C++ step does not know
(an adapter, a float layer) runs transformers' forward. The dense first layer's MLP runs as the experts' step with no
routed experts (`experts.dense_decoder`).

`LatentModel`, the model's trunk, decodes a token over the toolkit's own cache (`GrowingCache`) without the layers'
module calls: each held layer's step is one C++ call (`run`) that writes its entries into views the cache made one
longer, the other layers are called as transformers calls them.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn
from torch.nn.modules import module as hooks
from transformers.modeling_outputs import MoeModelOutputWithPast
from transformers.models.glm4_moe_lite import modeling_glm4_moe_lite as released
from transformers.models.glm4_moe_lite.modeling_glm4_moe_lite import (Glm4MoeLiteDecoderLayer, Glm4MoeLiteModel,
                                                                      Glm4MoeLiteRMSNorm)

from chatglm_tune.decoding.growing_cache import GrowingCache
from chatglm_tune.models.glm.latent_attention import IntAbsorbed, LatentAttention
from chatglm_tune.models.glm.moe_layer import MoeLiteLayer
from chatglm_tune.quant import int8dot_cpu
from chatglm_tune.quant.experts import dense_decoder
from chatglm_tune.quant.modules import QuantizedLinear, layouts_epoch, watch_modules
from chatglm_tune.runtime import heap


class LatentLayer(Glm4MoeLiteDecoderLayer):
    """`Glm4MoeLiteDecoderLayer` with its one-token decode steps held in C++ (the module docstring)."""

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, position_ids=None, cache=None, use_cache=False,
                position_embeddings=None, **kwargs) -> torch.Tensor:
        step = self._held_step(hidden_states, cache)
        if step is None:
            return super().forward(hidden_states, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                                   use_cache=use_cache, position_embeddings=position_embeddings, **kwargs)
        query, q_rot, latent, k_rot = step.begin(hidden_states, *position_embeddings)
        latent, k_rot = cache.update(latent, k_rot, self.self_attn.layer_idx, kwargs=kwargs)
        return step.finish(hidden_states, query, q_rot, latent, k_rot, attention_mask)

    def _held_step(self, x: torch.Tensor, cache):
        """The C++ step where it runs this forward, made once and kept while no layout, submodule or parameter
        changed."""
        if (self.training or torch.is_grad_enabled() or cache is None or x.shape[0] * x.shape[1] != 1
                or self.self_attn.head_prefix is not None):  # the C++ step knows no prefix
            return None
        held = self.__dict__.get("_held")
        if held is None or held[0] != layouts_epoch():
            watch_modules()
            self.__dict__["_held"] = None  # the old step's tensors go before the new ones are made
            step = _made_step(self, x)
            held = self.__dict__["_held"] = (layouts_epoch(), step, _hook_tables(self))
        if held[1] is None or _hooked(held[2]):
            return None
        return held[1]

    def _apply(self, fn, recurse=True):
        self.__dict__["_held"] = None  # it holds the tensors as they were
        return super()._apply(fn, recurse)


def _made_step(layer: LatentLayer, x: torch.Tensor):
    """`int8dot_cpu.latent_layer` for this layer as it stands, or None where its modules are not all ones the C++
    step runs: INT8 / INT4 projections on the integer-dot kernel, transformers' RMSNorms, kv_b_proj absorbed in INT,
    a mixture-of-experts layer with its C++ step or a dense MLP held as one."""
    attention, mlp = layer.self_attn, layer.mlp
    if type(attention) is not LatentAttention or attention.q_lora_rank is None:
        return None
    moe = mlp._decoder(x.view(-1, x.shape[-1])) if type(mlp) is MoeLiteLayer else dense_decoder(mlp)
    projections = [attention.q_a_proj, attention.q_b_proj, attention.kv_a_proj_with_mqa, attention.o_proj]
    norms = [layer.input_layernorm, attention.q_a_layernorm, attention.kv_a_layernorm, layer.post_attention_layernorm]
    if not (moe is not None and type(attention.kv_b_proj) is QuantizedLinear and all(map(_runs, projections))
            and all(type(norm) is Glm4MoeLiteRMSNorm for norm in norms)):
        return None
    absorbed = attention._absorbed()
    if not isinstance(absorbed, IntAbsorbed):
        return None
    for projection in projections:
        projection.record_kernel("int8dot")
    dims = (attention.num_heads, attention.qk_nope_head_dim, attention.qk_rope_head_dim, attention.v_head_dim,
            attention.kv_lora_rank)
    return int8dot_cpu.latent_layer(
        [(p.weight_for("int8dot"), p.float_scale(), p.bits) for p in projections],
        [(norm.weight, norm.variance_epsilon) for norm in norms],
        (absorbed.key_weights, absorbed.key_scales, absorbed.value_weights, absorbed.value_scales, absorbed.value_bits),
        dims, attention.scaling, bool(attention.config.rope_interleave), moe)


def _hook_tables(layer: LatentLayer) -> list[dict]:
    """The forward hook tables of the modules whose forward the held step runs in their place: all of the layer's but
    the routed experts' own (the experts' grouped step never calls them, held or not). A hook registered later goes
    into these same tables."""
    modules = [module for name, module in layer.named_modules() if name and not name.startswith("mlp.experts.")]
    return [table for module in modules for table in (module._forward_hooks, module._forward_pre_hooks)]


def _hooked(tables: list[dict]) -> bool:
    """Whether a forward hook would run on any of the modules of these hook tables (one of their own, or a global
    one)."""
    return bool(hooks._global_forward_hooks or hooks._global_forward_pre_hooks or any(tables))


def _runs(projection: nn.Module) -> bool:
    """Whether the C++ step runs this projection as its forward would: INT on the integer-dot kernel, no bias."""
    return (type(projection) is QuantizedLinear and projection.grouped_kernel_runs()
            and int8dot_cpu.routes(projection.bits, 1, torch.float32, needs_grad=False))


class LatentModel(Glm4MoeLiteModel):
    """`Glm4MoeLiteModel` whose one-token steps over a `GrowingCache` run the held layers' steps without the layers'
    module calls (the module docstring); any other forward is transformers' own."""

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                use_cache=None, **kwargs):
        if not self._steps_here(input_ids, cache, use_cache, kwargs):
            return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                   cache=cache, inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
        x = self.embed_tokens(input_ids)
        if position_ids is None:
            position_ids = torch.arange(1, device=x.device).unsqueeze(0) + cache.get_seq_length()
        mask = released.create_causal_mask(config=self.config, inputs_embeds=x, attention_mask=attention_mask,
                                           cache=cache, position_ids=position_ids)
        cos_sin = self.rotary_emb(x, position_ids)
        for layer in itertools.islice(self.layers, self.config.num_hidden_layers):  # a slice makes a ModuleList
            step = layer._held_step(x, cache) if type(layer) is LatentLayer and not _hooked_itself(layer) else None
            if step is None:
                x = layer(x, position_embeddings=cos_sin, attention_mask=mask, position_ids=position_ids, cache=cache,
                          use_cache=use_cache)
            else:
                x = step.run(x, *cos_sin, *cache.layers[layer.self_attn.layer_idx].grow(1), mask)
        return MoeModelOutputWithPast(last_hidden_state=self.norm(x), cache=cache)

    def _steps_here(self, input_ids, cache, use_cache, kwargs) -> bool:
        """Whether this forward is a one-token step without grad over a `GrowingCache` holding entries, asking
        nothing transformers' forward gives besides the last hidden state."""
        config = self.config
        return (not self.training and not torch.is_grad_enabled() and input_ids is not None and input_ids.numel() == 1
                and isinstance(cache, GrowingCache) and cache.get_seq_length() > 0 and use_cache is not False
                and not kwargs and not (config.output_hidden_states or config.output_attentions))


def _hooked_itself(layer: nn.Module) -> bool:
    """Whether a hook of `layer` itself would do something on a one-token step (`heap`'s trim does nothing then)."""
    return bool(layer._forward_pre_hooks) or any(hook is not heap.trim_after_rows
                                                 for hook in layer._forward_hooks.values())


def use_held_steps(model: nn.Module) -> None:
    """Give every GLM-4.7-Flash decoder layer of `model` the held decode step and its trunk the loop over them, in
    place (the same parameters), and name the layers' class where the model names its unsplittable layers (the unit
    FSDP wraps, found by class name)."""
    for module in model.modules():
        if type(module) is Glm4MoeLiteDecoderLayer:
            module.__class__ = LatentLayer
        elif type(module) is Glm4MoeLiteModel:
            module.__class__ = LatentModel
    names = getattr(model, "_no_split_modules", None)
    if names:
        old = Glm4MoeLiteDecoderLayer.__name__
        model._no_split_modules = {LatentLayer.__name__ if name == old else name for name in names}
