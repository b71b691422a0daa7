"""GLM-5.3-Flash (transformers' `glm5_next`) as a text-only causal LM, with the P-tuning v2 prefix.

transformers ships GLM-5.3-Flash as `Glm5NextForConditionalGeneration` only: a vision encoder (`model.visual.*`)
and the text model (`Glm5NextTextModel`, `model.language_model.*`) with an untied head (`lm_head.weight`). Its text
model: every fourth layer sparse attention (latent attention without rotary dims, keys picked per query by an
indexer over pools of tokens), the others KDA linear attention (a short convolution and a gated delta-rule
recurrence, no key/value cache); `hc_mult` residual streams mixed at every block (hyper-connections), averaged
before the final norm; dense MLPs in the first layers, routed and shared experts after. Positions play no part
(no rotary dims anywhere). `Glm5NextTextForCausalLM` is that text model and head alone, its modules named as in
`Glm5NextForConditionalGeneration` (`model.language_model.*`, `lm_head.weight`): its logits for text are
transformers' own. `NextPrefix` is what the toolkit's model of it (`modeling.Glm5NextForCausalLMWithPrefix`: this
mixin, `modeling.PrefixModel`, the text LM) adds: the P-tuning prefix of next_prefix.py, in the sparse layers as
next_layers.py puts it and in the KDA layers as their initial state, the cache of next_cache.py, and left pads that
change no row.

Its forward keeps `PrefixModel`'s contract: attention_mask [b, past + s] over the real tokens (1 = token, 0 = left
pad; the model reads its last s columns: earlier tokens' validity is in the cache); positions derived from it
(cumsum - 1) and passed on, though the model reads none; the prefix put into an empty cache on the first call;
labels -> `loss.causal_lm_loss` without logits. Packed rows (`segment_ids`) are refused: a recurrence would carry
one example's state into the next.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from transformers.cache_utils import Cache
from transformers.generation import GenerationMixin
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.modeling_utils import slice_logits_to_keep
from transformers.models.glm5_next.modeling_glm5_next import (Glm5NextPreTrainedModel, Glm5NextTextLinearAttention,
                                                              Glm5NextTextModel)

from chatglm_tune.models.glm.next_cache import HybridCache, PrefixStates, adopt, cached_entries, seed_prefix
from chatglm_tune.models.glm.next_layers import PadKeepingForgetGate, PrefixedLinearAttention, PrefixedSparseAttention
from chatglm_tune.models.glm.next_prefix import prefix_parts, prefix_state
from chatglm_tune.models.glm.prefix import positions_from_mask
from chatglm_tune.models.prefix import cache_empty

# The text model's keys in the released model (the vision encoder's are under "model.visual.")
TEXT_MODEL = "model.language_model."
VISION_MODEL = "model.visual."


class NextTextTrunk(nn.Module):
    """`Glm5NextTextModel` as `language_model`, where `Glm5NextForConditionalGeneration` holds it, with its embedding,
    layers and final norm at hand (`embed_tokens`, `layers`, `norm`) as other models' trunks have them."""

    def __init__(self, config):
        super().__init__()
        self.language_model = Glm5NextTextModel(config)

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.language_model.embed_tokens

    @property
    def layers(self) -> nn.ModuleList:
        return self.language_model.layers

    @property
    def norm(self) -> nn.Module:
        return self.language_model.norm

    def forward(self, **inputs):
        return self.language_model(**inputs)


class Glm5NextTextForCausalLM(Glm5NextPreTrainedModel, GenerationMixin):
    """GLM-5.3-Flash's text model and head (the module docstring): transformers' modules, its logits."""

    def __init__(self, config):
        super().__init__(config)
        self.model = NextTextTrunk(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Module) -> None:
        """The text model's embedding replaced (the trunk's `embed_tokens` only reads it)."""
        self.model.language_model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Module) -> None:
        self.lm_head = value

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, cache: Cache | None = None,
                inputs_embeds: torch.Tensor | None = None, labels: torch.LongTensor | None = None,
                use_cache: bool | None = None, logits_to_keep: int | torch.Tensor = 0,
                **kwargs) -> CausalLMOutputWithPast:
        """Logits [b, s, V] (the last `logits_to_keep`; 0 = all) of `Glm5NextTextModel`'s output, and transformers'
        loss for `labels`."""
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                         inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
        logits = self.lm_head(slice_logits_to_keep(out.last_hidden_state, logits_to_keep))
        loss = None if labels is None else self.loss_function(logits=logits, labels=labels,
                                                              vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=out.cache, hidden_states=out.hidden_states,
                                      attentions=out.attentions)


class NextPrefix:
    """GLM-5.3-Flash's P-tuning v2 prefix, cache and forward (the module docstring), mixed in before `PrefixModel`
    (`modeling.Glm5NextForCausalLMWithPrefix`). Decodes on its own cache (`next_cache.HybridCache`; an empty cache
    made without a config is given its layers), never a static one."""

    static_cache = False  # recurrent states and an indexer cache: no `StaticCache` form (decoding.static_decoding)
    # Its cache holds per-row recurrent states, which tokens written into it cannot be taken back from (no speculative
    # decoding: `decoding.speculative`)
    recurrent_cache = True

    def __init__(self, config):
        super().__init__(config)  # the prefix encoder at this model's width (glm/prefix.py hands it to next_prefix)
        for layer in self.model.layers:
            attention = layer.self_attn
            if isinstance(attention, Glm5NextTextLinearAttention):
                attention.__class__ = PrefixedLinearAttention
                attention.forget_gate.__class__ = PadKeepingForgetGate
            else:
                attention.__class__ = PrefixedSparseAttention

    def prefix_key_values(self, batch_size: int, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (keys, values) of the prefix (`next_prefix.prefix_parts`: a KDA layer's virtual keys and values
        [b, P, heads, D], a sparse layer's heads' [b, heads, P, D]; dropout applies in training mode)."""
        return prefix_parts(self.prefix_encoder, self.prefix_dropout, self.config, batch_size, dtype)

    def prefix_states(self, batch_size: int, dtype: torch.dtype) -> list[torch.Tensor | None]:
        """The prefix made for a forward: each sparse layer's attention is handed its heads' keys and values
        (`head_prefix`); per layer, the KDA layers' initial states [b, heads, Dk, Dv] (None for a sparse layer)."""
        states = []
        for layer, (keys, values) in zip(self.model.layers, self.prefix_key_values(batch_size, dtype)):
            if isinstance(layer.self_attn, PrefixedLinearAttention):
                states.append(prefix_state(keys, values))
            else:
                layer.self_attn.head_prefix = (keys, values)
                states.append(None)
        return states

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
    ) -> CausalLMOutputWithPast:
        """Logits [b, s, V] (and loss, cache) for input_ids [b, s], as `PrefixModel.forward`'s (the module docstring).

        attention_mask: [b, past + s] 2D, 1 = token, over the real tokens. cache: a `HybridCache` (or an empty cache,
            given its layers); with a prefix, put in on the first call. Without a cache the prefix rides in a
            read-only `PrefixStates`, not returned.
        labels: [b, s], -100 ignored: `loss.causal_lm_loss` (no logits then). logits_to_keep: 0 = all, N = the last N.
        """
        if segment_ids is not None:
            raise ValueError("GLM-5.3-Flash takes no packed rows (segment_ids): its linear attention layers would "
                             "carry one example's recurrent state into the next")
        if attention_mask is not None and attention_mask.dim() != 2:
            raise ValueError(f"GLM-5.3-Flash takes a 2D attention_mask [batch, tokens] (the indexer picks the keys), "
                             f"got {attention_mask.dim()}D")
        ref = input_ids if input_ids is not None else inputs_embeds
        b, s = ref.shape[:2]
        use_cache = self._use_cache(cache, use_cache)
        cache, keep = self._cache_with_prefix(cache, use_cache, b)
        past = cached_entries(cache, self.config) - self.pre_seq_len if cache is not None else 0
        if position_ids is None:  # the model reads none (no rotary dims); they are passed on as the others' are
            position_ids = (positions_from_mask(attention_mask, past, s) if attention_mask is not None
                            else torch.arange(past, past + s, device=ref.device).expand(b, s))
        inputs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                      inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
        out = self._outputs(inputs, labels, logits_to_keep, functools.partial(Glm5NextTextForCausalLM.forward, self))
        if not keep:
            out.cache = None
        return out

    def _cache_with_prefix(self, cache: Cache | None, use_cache: bool, rows: int) -> tuple[Cache | None, bool]:
        """(the cache the layers get, whether the forward returns it): the given one (its layers made where it has
        none) or a new `HybridCache` when one is kept, the prefix put into it when it is empty; without one, with a
        prefix, a read-only `PrefixStates` (not returned)."""
        if cache is not None:
            cache = adopt(cache, self.config)
        elif use_cache:
            cache = HybridCache(self.config)
        p = self.pre_seq_len
        if p and (cache is None or cache_empty(cache)):
            like = self.model.norm.weight  # the compute dtype (RMSNorm weights are never quantized) and device
            states = self.prefix_states(rows, like.dtype)
            if cache is None:
                return PrefixStates(self.config, states, rows, p, like), False
            seed_prefix(cache, self.config, states, rows, p, like)
        return cache, cache is not None and use_cache
