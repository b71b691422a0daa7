"""ChatGLM-6B (v1) in plain PyTorch, exact to the official `modeling_chatglm.py`.

Module names equal the official checkpoint keys (`transformer.word_embeddings`,
`transformer.layers.N.attention.query_key_value`, `.mlp.dense_h_to_4h`, `transformer.final_layernorm`,
`transformer.prefix_encoder`), so loading is a key-for-key copy.

Layout: the official code is sequence-first ([s, b, h]); this one is batch-first throughout:
hidden states [b, s, h], attention tensors [b, heads, s, head_dim] (the layout of
`scaled_dot_product_attention` and of transformers' `DynamicCache`). The numbers are the same.

What keeps the numbers official:
- residual on the *normalised* input, scaled by alpha = sqrt(2 * 28) whatever the depth;
- per-head interleaved QKV rows: head h owns rows [3*hd*h, 3*hd*(h+1)) as q | k | v;
- 2D rotary: first half of each head rotated by the position, second half by the block position, with
  `inv_freq` rounded to fp16 and the angle tables computed in fp16 when the model runs in fp16;
- the GLM mask: the context (before `<sop>`) is bidirectional, generation is causal;
- the official tanh GELU (fused); the head tied to the word embeddings.
Masked scores use -inf through SDPA's boolean mask instead of -10000 * (layer + 1): the same
probabilities, since exp(-10000) is 0 in every float type.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache, StaticCache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import CausalLMOutputWithPast

from chatglm_tune.decoding.chat import Chat
from chatglm_tune.models.loss import causal_lm_loss
from chatglm_tune.runtime import checkpoint, heap
from chatglm_tune.runtime.checkpoint import AUTO_PLUMBING
from chatglm_tune.models.chatglm6b.config import (CONFIG_FIELDS, OFFICIAL_ALPHA_LAYERS, QUANTIZABLE_LINEARS,
                                                  ChatGLMConfig)
from chatglm_tune.models.chatglm6b.positions import build_position_ids, context_lengths, glm_mask, packed_inputs
from chatglm_tune.models.prefix import (PREFIX_DROPOUT, PrefixCache, PrefixEncoder, cache_empty, check_prefix_shapes,
                                        check_prefix_version, not_a_model, only_prefix_weights, prefix_key_values,
                                        seed_cache)
from chatglm_tune.quant import cpu_matmul
from chatglm_tune.quant.apply import QuantizeOnLoad, quantize_model, refuse_int8_embedding
from chatglm_tune.quant.cpu_matmul import Linear
from chatglm_tune.quant.format import check_bits

ALPHA = math.sqrt(2 * OFFICIAL_ALPHA_LAYERS)


def gelu(x: torch.Tensor) -> torch.Tensor:
    """The official tanh GELU, 0.5*x*(1+tanh(0.79788456*x*(1+0.044715*x*x))), as one fused kernel.

    The official one is `@torch.jit.script`ed, so on GPU it is fused too (intermediates in fp32);
    written out op by op it costs a third of a small model's training step here.
    """
    return F.gelu(x, approximate="tanh")


def rotary_tables(position_ids: torch.Tensor, head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [b, s, 1, head_dim] for 2D positions [b, 2, s]: first half by position, second by block.

    `inv_freq` is rounded to fp16 as the official buffer is. The angles are computed in fp16 when the
    model runs in fp16 (official GPU numbers) and in fp32 otherwise (official CPU fp32 numbers; for
    bf16 this avoids bf16 position counters, which cannot count past 256 exactly).
    """
    rot = head_dim // 2  # dims rotated by one position channel
    inv_freq = _inv_freq(rot, position_ids.device)
    table_dtype = torch.float16 if dtype == torch.float16 else torch.float32
    angles = position_ids.to(table_dtype)[..., None] * inv_freq.to(table_dtype)  # [b, 2, s, rot/2]
    angles = torch.cat([angles, angles], dim=-1)  # [b, 2, s, rot]
    angles = torch.cat([angles[:, 0], angles[:, 1]], dim=-1)  # [b, s, head_dim]
    return angles.cos().to(dtype)[:, :, None], angles.sin().to(dtype)[:, :, None]


_INV_FREQ: dict[tuple[int, str], torch.Tensor] = {}


def _inv_freq(rot: int, device: torch.device) -> torch.Tensor:
    """The official fp16 `inv_freq` of `rot` rotated dims, made once per size and device (eagerly: a prompt's forward
    precedes every compiled decode step). Made inside a compiled graph, its rounding to fp16 would be fused away
    (inductor keeps a cast's intermediate in fp32), moving every angle: 0.07 in a tiny model's logits."""
    key = (rot, str(device))
    if key not in _INV_FREQ:
        with torch.inference_mode(False):  # a normal tensor, whatever mode the first forward ran in
            _INV_FREQ[key] = (1.0 / (10000 ** (torch.arange(0, rot, 2, device=device).float() / rot))).half()
    return _INV_FREQ[key]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, s, heads, hd]: each half rotated with GPT-NeoX `rotate_half` within that half."""
    x4 = x.unflatten(-1, (2, 2, x.shape[-1] // 4))  # [..., half, part, hd/4]
    rotated = torch.stack((-x4[..., 1, :], x4[..., 0, :]), dim=-2).flatten(-3)
    return x * cos + rotated * sin


class SelfAttention(nn.Module):
    def __init__(self, config: ChatGLMConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.query_key_value = Linear(config.hidden_size, 3 * config.hidden_size)
        self.dense = Linear(config.hidden_size, config.hidden_size)

    def forward(self, x, cos, sin, allowed, cache):
        b, s, _ = x.shape
        qkv = self.query_key_value(x).view(b, s, self.num_heads, 3 * self.head_dim)
        q, k, v = qkv.split(self.head_dim, dim=-1)  # [b, s, nh, hd], per-head interleaved rows
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, nh, s, hd]
        if cache is not None:  # the cached keys (the P-tuning prefix first) before the new ones
            k, v = cache.update(k, v, self.layer_idx)
        ctx = cpu_matmul.scaled_dot_product_attention(q, k, v, attn_mask=allowed)  # [b, nh, s, hd]
        return self.dense(ctx.transpose(1, 2).reshape(b, s, -1))


class GLU(nn.Module):
    """The official `GLU`: despite the name, an ungated MLP."""

    def __init__(self, config: ChatGLMConfig):
        super().__init__()
        self.dense_h_to_4h = Linear(config.hidden_size, config.inner_hidden_size)
        self.dense_4h_to_h = Linear(config.inner_hidden_size, config.hidden_size)

    def forward(self, x):
        return self.dense_4h_to_h(gelu(self.dense_h_to_4h(x)))


class GLMBlock(GradientCheckpointingLayer):
    """Post-LN with a normalised residual: h = LN(x)*alpha + Attn(LN(x)); out = LN(h)*alpha + MLP(LN(h))."""

    def __init__(self, config: ChatGLMConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)
        self.attention = SelfAttention(config, layer_idx)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)
        self.mlp = GLU(config)
        self.dropout = nn.Dropout(config.hidden_dropout)  # identity unless training with hidden_dropout > 0

    def forward(self, x, cos, sin, allowed, cache=None):
        a = self.input_layernorm(x)
        h = a * ALPHA + self.dropout(self.attention(a, cos, sin, allowed, cache))
        m = self.post_attention_layernorm(h)
        return m * ALPHA + self.dropout(self.mlp(m))


class ChatGLMPreTrainedModel(PreTrainedModel):
    config_class = ChatGLMConfig
    config: ChatGLMConfig
    base_model_prefix = "transformer"
    supports_gradient_checkpointing = True
    _no_split_modules = ["GLMBlock"]
    _skip_keys_device_placement = ["cache"]
    _supports_sdpa = True
    _keys_to_ignore_on_load_unexpected = [r"rotary_emb\.inv_freq"]

    @torch.no_grad()
    def _init_weights(self, module):
        if getattr(module, "_default_init", False):  # the prefix encoder keeps PyTorch's init, as official
            module.reset_parameters()
        elif isinstance(module, nn.Linear):
            module.weight.normal_(0.0, 0.02)
            if module.bias is not None:
                module.bias.zero_()
        elif isinstance(module, nn.Embedding):
            module.weight.normal_(0.0, 0.02)
        elif isinstance(module, nn.LayerNorm):
            module.weight.fill_(1.0)
            module.bias.zero_()


class ChatGLMModel(ChatGLMPreTrainedModel):
    """Embeddings -> GLM blocks -> final LayerNorm (the official `transformer`)."""

    def __init__(self, config: ChatGLMConfig):
        super().__init__(config)
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(GLMBlock(config, i) for i in range(config.num_layers))
        heap.trim_after_each(self.layers)
        self.final_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)
        if config.pre_seq_len is not None:  # P-tuning v2 (what trains is `training.set_trainable`'s decision)
            width = 2 * config.num_layers * config.hidden_size
            self.prefix_encoder = PrefixEncoder(config.pre_seq_len, width, config.hidden_size, config.prefix_projection,
                                                embedding_dim=config.hidden_size)
            for m in self.prefix_encoder.modules():
                if hasattr(m, "reset_parameters"):
                    m._default_init = True
            self.prefix_dropout = nn.Dropout(PREFIX_DROPOUT)
        self.post_init()

    def get_input_embeddings(self):
        return self.word_embeddings

    def set_input_embeddings(self, value):
        self.word_embeddings = value

    def forward(self, input_ids, position_ids=None, attention_mask=None, cache=None, use_cache=False):
        """input_ids [b, s] -> (hidden [b, s, h], cache or None). See ChatGLMForConditionalGeneration."""
        cfg = self.config
        b, s = input_ids.shape
        x = self.word_embeddings(input_ids)
        if cache is not None and not isinstance(cache, Cache):
            raise TypeError(f"cache must be a transformers Cache (e.g. DynamicCache), got {type(cache).__name__}")
        n_prefix = cfg.pre_seq_len or 0
        if n_prefix and (cache is None or cache_empty(cache)):
            prefix = prefix_key_values(self.prefix_encoder, self.prefix_dropout, cfg.num_layers,
                                       cfg.num_attention_heads, cfg.head_dim, b, x.dtype)
            if cache is None and not use_cache:  # a training forward: the prefix, and nothing kept
                cache = PrefixCache(prefix)
            else:
                cache = seed_cache(DynamicCache() if cache is None else cache, prefix)
        elif cache is None and use_cache:
            cache = DynamicCache()
        past = cached_tokens(cache, cfg)

        pad_mask = attention_mask if attention_mask is not None and attention_mask.dim() == 2 else None
        if position_ids is None:
            if past:
                raise ValueError(
                    "position_ids are required for an incremental step (the GLM positions depend on the whole "
                    "prompt); use model.generate or chatglm_tune.generate, which track them"
                )
            position_ids = _glm_positions(cfg, input_ids, pad_mask)
        if isinstance(cache, StaticCache):
            allowed = self._static_mask(input_ids, pad_mask, n_prefix)
        else:
            allowed = self._sdpa_mask(input_ids, attention_mask, pad_mask, past, n_prefix)
        cos, sin = rotary_tables(position_ids, cfg.head_dim, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, allowed, cache)
        return self.final_layernorm(x), (cache if use_cache else None)

    def _static_mask(self, input_ids, pad_mask, n_prefix: int):
        """Boolean SDPA mask [b, 1, s, n_prefix + L] over a static cache of L columns past the prefix
        (`decoding.static_decoding`): `pad_mask` [b, L] marks the real tokens cached and those this forward writes.
        A prompt (the first forward) attends as `glm_mask` has it; a step attends to every marked column."""
        if pad_mask is None:
            raise ValueError("a static cache needs the pad mask [b, L] over all its columns (1 = a real token)")
        b, s = input_ids.shape
        width = pad_mask.shape[1]
        if s == 1:
            allowed = pad_mask.bool()[:, None, None, :]
        else:
            c = context_lengths(input_ids, self.config.bos_token_id)
            own_key = torch.arange(s, device=pad_mask.device)[:, None] == torch.arange(width, device=pad_mask.device)
            allowed = ~glm_mask(c, s, width, past_length=0, pad_mask=pad_mask) | own_key  # pad rows see themselves
        if n_prefix:
            allowed = torch.cat([allowed.new_ones(b, 1, s, n_prefix), allowed.expand(b, 1, s, width)], dim=-1)
        return allowed

    def _sdpa_mask(self, input_ids, attention_mask, pad_mask, past: int, n_prefix: int):
        """Boolean SDPA mask [b, 1, s, n_prefix + past + s], True = may attend; None when all may."""
        b, s = input_ids.shape
        k_len = past + s
        if attention_mask is not None and attention_mask.dim() == 4:  # official: True = blocked
            if attention_mask.shape[-2:] != (s, k_len):
                raise ValueError(
                    f"a 4D attention_mask must be [b, 1, {s}, {k_len}] (queries, cached + new keys), "
                    f"got {list(attention_mask.shape)}"
                )
            blocked = attention_mask.bool()
        elif past == 0:
            c = context_lengths(input_ids, self.config.bos_token_id)
            blocked = glm_mask(c, s, k_len, past_length=0, pad_mask=pad_mask)
        elif s == 1 and (pad_mask is None or bool(pad_mask.all())):
            return None
        else:  # incremental steps: everything cached is visible, causal within the new chunk
            blocked = glm_mask(input_ids.new_zeros(b), s, k_len, past_length=past, pad_mask=pad_mask)
        allowed = ~blocked
        # A query always sees its own key, so rows of pads are never fully masked (SDPA would give NaN).
        own_key = torch.arange(s, device=allowed.device)[:, None] + past == torch.arange(k_len, device=allowed.device)
        allowed = allowed | own_key
        if n_prefix:
            allowed = torch.cat([allowed.new_ones(b, 1, s, n_prefix), allowed.expand(b, 1, s, k_len)], dim=-1)
        return None if bool(allowed.all()) else allowed


class ChatGLMForConditionalGeneration(ChatGLMPreTrainedModel, GenerationMixin, Chat):
    """ChatGLM-6B with its tied LM head, loss, KV cache and generation hooks."""

    _tied_weights_keys = {"lm_head.weight": "transformer.word_embeddings.weight"}
    static_cache = True  # decodes on transformers' StaticCache too (decoding.static_decoding; `_static_mask`)

    def __init__(self, config: ChatGLMConfig):
        super().__init__(config)
        self.transformer = ChatGLMModel(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()
        self.tie_lm_head()

    def tie_lm_head(self):
        """logits = hidden @ word_embeddings.T, as the official `from_pretrained` ties them."""
        self.lm_head.weight = self.transformer.word_embeddings.weight

    def get_output_embeddings(self):
        return self.lm_head

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path,
        *,
        config: ChatGLMConfig | None = None,
        dtype: torch.dtype | str | None = None,
        torch_dtype: torch.dtype | str | None = None,
        device: torch.device | str = "cpu",
        quantization_bit: int | None = None,
        quantization_group_size: int = 0,
        quantize_embedding: bool = False,
        **overrides,
    ) -> "ChatGLMForConditionalGeneration":
        """Load a local checkpoint (file or directory; see `checkpoint.weight_files`) without a second copy.

        `overrides` set config fields (`pre_seq_len=128, prefix_projection=True`, ...), as transformers
        does. `dtype` (or `torch_dtype`): the compute dtype; "auto" = config.json's; default float32.
        `quantization_bit` 4/8 quantizes the block Linears of a half/float checkpoint while loading (the
        official `model.quantize(bits)`); a checkpoint whose config says `quantization_bit` loads as is.
        `quantize_embedding` keeps the tied embedding / head as one INT8 copy (`quant.apply.quantize_embedding`).
        Only `transformer.prefix_encoder.*` may be absent from the checkpoint (a fresh P-tuning start). A
        directory of prefix weights only (a P-tuning run or checkpoint) is refused with what to load instead
        (`chatglm_tune.from_pretrained` loads a train.py run's base with its prefix).
        """
        for name in [n for n in overrides if n in AUTO_PLUMBING]:
            value = overrides.pop(name)
            if name == "trust_remote_code" and value:
                raise ValueError("chatglm_tune runs ChatGLM natively: trust_remote_code is never needed")
        path = Path(pretrained_model_name_or_path)
        if config is None:
            config_dir = path if path.is_dir() else path.parent
            if not (config_dir / "config.json").exists():
                raise checkpoint.CheckpointError(f"{config_dir}: no config.json beside the weights")
            config = ChatGLMConfig.from_pretrained(config_dir)
        unknown = [k for k in overrides if not hasattr(config, k)]
        if unknown:
            raise TypeError(f"from_pretrained got unknown arguments: {', '.join(sorted(unknown))}")
        for key, value in overrides.items():
            setattr(config, key, value)
        dtype = checkpoint.resolve_dtype(dtype if dtype is not None else torch_dtype, config.dtype)
        stored_bits = config.quantization_bit
        check_bits(stored_bits, quantization_bit, path)
        config.name_or_path = str(path.resolve())  # where it came from: peft records it as an adapter's base
        with torch.device("meta"):
            model = cls(config)
        if stored_bits:
            quantize_model(model, stored_bits, config.quantization_group_size, targets=QUANTIZABLE_LINEARS,
                           empty_init=True)
        load_bits = 0 if stored_bits else (quantization_bit or 0)
        place = QuantizeOnLoad(model, dtype, load_bits, quantization_group_size, embedding=quantize_embedding,
                                     targets=QUANTIZABLE_LINEARS)
        missing = checkpoint.load_weights(model, path, dtype=dtype, place=place)
        not_prefix = [k for k in missing if not k.startswith(checkpoint.PREFIX_KEY)]
        if not_prefix:
            if only_prefix_weights(path, checkpoint.PREFIX_KEY):
                raise checkpoint.CheckpointError(not_a_model(path))
            shown = ", ".join(not_prefix[:8]) + (f" and {len(not_prefix) - 8} more" if len(not_prefix) > 8 else "")
            raise checkpoint.CheckpointError(f"{path}: missing weights: {shown}")
        if missing:  # a fresh prefix encoder, initialised as the official one is, kept in float32
            encoder = model.transformer.prefix_encoder.to_empty(device="cpu")
            for m in encoder.modules():
                if hasattr(m, "reset_parameters"):
                    m.reset_parameters()
        config.dtype = dtype
        model.tie_lm_head()
        return model.to(device).eval()

    def save_pretrained(self, save_directory, state_dict: dict | None = None, max_shard_bytes: int = 2 << 30, **unused):
        """config.json + safetensors (sharded above `max_shard_bytes`); the tied head is stored once.

        `state_dict` restricts what is written (e.g. only the trainable prefix encoder).
        """
        if any(v is not None for v in unused.values()):
            raise TypeError(f"save_pretrained does not support: {', '.join(sorted(unused))}")
        directory = Path(save_directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = dict(self.state_dict() if state_dict is None else state_dict)
        refuse_int8_embedding(state, ("transformer.word_embeddings.weight_scale",))
        state.pop("lm_head.weight", None)
        checkpoint.save_state_dict(state, directory, max_shard_bytes=max_shard_bytes)
        checkpoint.atomic_write(directory / "config.json", self.config.to_json_file)

    def load_prefix(self, path) -> None:
        """Load a P-tuning v2 checkpoint (`transformer.prefix_encoder.*`, official or ours) onto this model.

        Refuses, naming both, a checkpoint trained with another `pre_seq_len`/`prefix_projection`, one of
        another width than this model's W = 2 * num_layers * hidden_size, and one of another version (its
        config.json says ChatGLM2/3 or GLM-4).
        """
        cfg = self.config
        if cfg.pre_seq_len is None:
            raise ValueError("this model has no prefix encoder: load the base with pre_seq_len (and prefix_projection) "
                             "set")
        source = Path(path)
        saved = source / "config.json"
        if source.is_dir() and saved.exists():
            theirs = json.loads(saved.read_text())
            if (theirs.get("pre_seq_len"),
                bool(theirs.get("prefix_projection"))) != (cfg.pre_seq_len, cfg.prefix_projection):
                raise checkpoint.CheckpointError(
                    f"{source} was trained with pre_seq_len={theirs.get('pre_seq_len')}, "
                    f"prefix_projection={bool(theirs.get('prefix_projection'))}; this model has "
                    f"pre_seq_len={cfg.pre_seq_len}, prefix_projection={cfg.prefix_projection}"
                )
        # A width that no pre_seq_len / prefix_projection of this model makes is another model's prefix (the
        # embedding is W wide, or hidden_size with the projection, whose output is W); other differences are
        # named by load_weights, with the settings the checkpoint was trained with.
        width, hidden = 2 * cfg.num_layers * cfg.hidden_size, cfg.hidden_size
        expected = {checkpoint.PREFIX_KEY + k: t.shape for k, t in self.transformer.prefix_encoder.state_dict().items()}
        shapes = {key: t.shape for file in checkpoint.weight_files(path) for key, t in checkpoint.iter_tensors(file)}
        foreign = {k: s for k, s in shapes.items() if (k.endswith("embedding.weight") and s[-1] not in (hidden, width))
                   or (k.endswith("trans.2.weight") and s[0] != width)}
        check_prefix_shapes(source, foreign, expected, width,
                            f"2 * num_layers * hidden_size = 2 * {cfg.num_layers} * {hidden}")
        _check_prefix_config(source)
        missing = checkpoint.load_weights(self, path, dtype=torch.float32, only_prefix=True)
        missing = [k for k in missing if k.startswith(checkpoint.PREFIX_KEY)]
        if missing:
            raise checkpoint.CheckpointError(f"{source}: missing prefix weights: {', '.join(missing)}")
        # load_weights builds the tensors on the CPU: the prefix goes where the model is (a GPU, say)
        self.transformer.prefix_encoder.to(self.transformer.word_embeddings.weight.device)

    def set_output_embeddings(self, new_embeddings):
        self.lm_head = new_embeddings

    def forward(self, input_ids: torch.LongTensor, *, position_ids: torch.LongTensor | None = None,
                attention_mask: torch.Tensor | None = None, cache: Cache | None = None,
                labels: torch.LongTensor | None = None, use_cache: bool | None = None,
                logits_to_keep: int | None = None, return_dict: bool | None = None,
                segment_ids: torch.LongTensor | None = None, **unsupported):
        """Logits, loss and cache for `input_ids` [b, s].

        position_ids: [b, 2, s] GLM positions; computed from `input_ids` when omitted (prompt steps only).
        attention_mask: either [b, past + s] with 1 = token, 0 = pad (the usual transformers mask), or
            the official boolean [b, 1, s, past + s] with True = blocked. Prefix columns are added here.
        cache: a transformers `Cache`; with P-tuning its first `pre_seq_len` entries are the prefix.
        labels: [b, s], -100 = ignored; loss = mean cross entropy of logits[:, :-1] against labels[:, 1:].
        logits_to_keep: None = all positions without labels and none with labels (the head then runs only
            on labelled positions, the bulk of a training step's savings); an int N keeps the last N (0 = all).
        segment_ids: [b, s] of packed training rows (`batches.collate_packed`): each example gets the positions
            and mask it has alone (`positions.packed_inputs`), in place of position_ids and attention_mask.
        """
        if any(v is not None and v is not False for v in unsupported.values()):
            raise TypeError(f"ChatGLM forward does not support: {', '.join(sorted(unsupported))}")
        if segment_ids is not None:
            if attention_mask is not None or position_ids is not None or cache is not None:
                raise ValueError("segment_ids (packed training rows) take no attention_mask, position_ids or cache")
            c = self.config
            position_ids, attention_mask = packed_inputs(input_ids, segment_ids, bos_token_id=c.bos_token_id,
                                                         gmask_token_id=c.gmask_token_id, mask_token_id=c.mask_token_id)
        use_cache = self.config.use_cache and not self.training if use_cache is None else use_cache
        hidden, cache = self.transformer(input_ids, position_ids, attention_mask, cache, use_cache)
        loss = None
        if labels is not None:
            loss = causal_lm_loss(self.lm_head, hidden, labels)  # the head on labelled positions, in chunks
        keep = (None if labels is not None else 0) if logits_to_keep is None else logits_to_keep
        logits = None
        if keep is not None:
            logits = self.lm_head(hidden if keep == 0 else hidden[:, -keep:]).float()
        out = CausalLMOutputWithPast(loss=loss, logits=logits, cache=cache)
        return out if return_dict is not False else out.to_tuple()

    # --- positions for a decoding loop (generation.py): the prompt's, then one step at a time
    def prompt_positions(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """The 2D GLM position ids [b, 2, s] of (left-padded) prompts, as the forward builds them."""
        return _glm_positions(self.config, input_ids, attention_mask)

    @staticmethod
    def next_positions(positions: torch.Tensor) -> torch.Tensor:
        """The position ids [b, 2, 1] of the token after the one at `positions` [b, 2, 1]: the block
        position counts on, the other stays at the mask."""
        return torch.stack((positions[:, 0], positions[:, 1] + 1), dim=1)

    # --- transformers generate() support: positions come from the whole sequence, never incremented.
    def prepare_inputs_for_generation(self, input_ids, cache=None, attention_mask=None, use_cache=True, **kwargs):
        pad_mask = _pad_mask_2d(attention_mask)
        position_ids = _glm_positions(self.config, input_ids, pad_mask)
        done = cached_tokens(cache, self.config) if cache is not None and cache.get_seq_length() else 0
        return dict(
            input_ids=input_ids[:, done:], position_ids=position_ids[..., done:], attention_mask=pad_mask,
            cache=cache, use_cache=use_cache,
        )

    def _update_model_kwargs_for_generation(self, outputs, model_kwargs, is_encoder_decoder=False, num_new_tokens=1):
        model_kwargs.pop("position_ids", None)  # recomputed from the sequence in prepare_inputs_for_generation
        if model_kwargs.get("attention_mask") is not None:
            model_kwargs["attention_mask"] = _pad_mask_2d(model_kwargs["attention_mask"])
        return super()._update_model_kwargs_for_generation(outputs, model_kwargs, is_encoder_decoder, num_new_tokens)


def _glm_positions(config: ChatGLMConfig, input_ids: torch.Tensor, pad_mask: torch.Tensor | None) -> torch.Tensor:
    """The 2D GLM position ids [b, 2, s] of whole sequences, from the config's special ids."""
    return build_position_ids(input_ids, bos_token_id=config.bos_token_id, gmask_token_id=config.gmask_token_id,
                              mask_token_id=config.mask_token_id, pad_mask=pad_mask)


def _check_prefix_config(source) -> None:
    """Refuse a P-tuning checkpoint whose config.json describes a model (its `hidden_size`) that is not a
    ChatGLM-6B (none of its own fields); one without config.json, or too bare to tell, is left to the shapes."""
    try:
        raw = checkpoint.read_config_file(source)
    except checkpoint.CheckpointError:
        return
    if "hidden_size" in raw and not any(k in raw for k in CONFIG_FIELDS):
        check_prefix_version(source, f"{raw.get('model_type', 'other')!r} (not ChatGLM-6B)", "ChatGLM-6B", "this model")


def cached_tokens(cache: Cache | None, config: ChatGLMConfig) -> int:
    """Tokens of the sequence already in `cache`: its length less the P-tuning prefix it starts with."""
    return 0 if cache is None else cache.get_seq_length() - (config.pre_seq_len or 0)


def _pad_mask_2d(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """The 2D pad mask (1 = token) of either mask form; the official 4D mask's pad rows see nothing."""
    if attention_mask is None or attention_mask.dim() == 2:
        return attention_mask
    blocked = attention_mask[:, 0].bool()
    return (~blocked).any(dim=-1).long()  # a real token's row sees at least itself
