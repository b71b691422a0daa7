"""P-tuning v2 for ChatGLM2/3 and GLM-4: the prefix encoder and the caches that carry its keys/values.

Official semantics (ChatGLM2/3 `modeling_chatglm.py` `PrefixEncoder` / `get_prompt`; GLM-4's own code has
no P-tuning and takes ChatGLM3's): `pre_seq_len` (P) learned key/value pairs per layer, of width
W = num_layers * 2 * kv_channels * multi_query_group_num; with `prefix_projection`,
Embedding(P, W) -> Linear(W, hidden) -> Tanh -> Linear(hidden, W) (ChatGLM-6B's projects from hidden
instead). The output [P, W] is viewed [P, 2 * num_layers, G, D]: layer l's key is slice
2l, its value 2l+1, used as they are (never rotated), after a dropout of 0.1 while training. They are
the first P entries of the KV cache; the first real token has position 0 (peft's PrefixTuning shifts
positions by P and gives other logits).

Official key names under `transformer.prefix_encoder.` (`embedding.weight`, `trans.0.*`, `trans.2.*`):
the model holds the encoder as `prefix_encoder`, so the key map renames the root only.
Initialisation is PyTorch's default, as in the official code.
"""

from __future__ import annotations

from chatglm_tune.prefix import PrefixEncoder


def prefix_width(config) -> int:
    """W = num_layers * 2 * kv_channels * multi_query_group_num, for a `GlmConfig`."""
    return config.num_hidden_layers * 2 * config.head_dim * config.num_key_value_heads


def prefix_encoder(config) -> PrefixEncoder:
    """The encoder of this family: its projection starts from an embedding of width W (ChatGLM-6B's from hidden)."""
    width = prefix_width(config)
    return PrefixEncoder(config.pre_seq_len, width, config.hidden_size, bool(config.prefix_projection), embedding_dim=width)
