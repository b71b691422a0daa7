"""GLM-5's sparse attention with the P-tuning prefix (`sparse_attention.SparseAttention`): the prefix changes no index
score, every query sees every prefix position, and the indexer chooses among the real tokens as without it; the
indexer's keys ride in the latents' cache entries, so a cached decode is the whole forward."""

import torch

from chatglm_tune.models import registry
from chatglm_tune.models.glm.sparse_attention import SparseAttention

CORPUS = ["故障现象：发动机水温高，风扇始终是低速转动。", "Hello world, the fan turns slowly: 42."] * 5


def tiny(tmp_path, **overrides):
    torch.manual_seed(0)
    model, _ = registry.VERSIONS["glm5"].tiny(CORPUS, tmp_path, num_hidden_layers=3, **overrides)
    return model.eval()


def chosen_by_layer(model, ids) -> list[torch.Tensor]:
    """The positions each layer's queries attend to ([b, s, k], in cache columns), from one forward."""
    seen = []
    hooks = [layer.self_attn.register_forward_hook(lambda m, args, out: seen.append(out[2]))
             for layer in model.model.layers]
    with torch.no_grad():
        model(ids)
    for hook in hooks:
        hook.remove()
    return seen


def test_the_prefix_changes_no_index_score_and_every_query_sees_it(tmp_path):
    model = tiny(tmp_path / "a", pre_seq_len=3)
    with torch.no_grad():
        model.prefix_encoder.embedding.weight.normal_(0, 1.0)
    ids = torch.randint(0, 300, (2, 30), generator=torch.Generator().manual_seed(1))
    with_prefix = chosen_by_layer(model, ids)
    encoder, model.prefix_encoder, model.config.pre_seq_len = model.prefix_encoder, None, None
    for layer in model.model.layers:
        layer.self_attn.head_prefix = None
    without = chosen_by_layer(model, ids)
    assert all(type(layer.self_attn) is SparseAttention for layer in model.model.layers)
    assert model.config.indexer_types == ["full", "shared", "full"] and model.config.index_topk < 30
    p = encoder.embedding.num_embeddings
    for layer, (mine, plain) in enumerate(zip(with_prefix, without)):
        assert (mine[..., :p] == torch.arange(p)).all(), layer  # every query sees every prefix position
        assert mine.shape[-1] == p + plain.shape[-1]  # and index_topk real tokens besides
    # the first layer's scores come from the same hidden states: the same real tokens, shifted past the prefix
    assert torch.equal(with_prefix[0][..., p:], without[0] + p)
    assert torch.equal(with_prefix[1], with_prefix[0])  # a shared layer takes the full layer's choice


def test_a_cached_decode_is_the_whole_forward_with_and_without_a_prefix(tmp_path):
    for prefix in (0, 3):
        model = tiny(tmp_path / str(prefix), **({"pre_seq_len": prefix} if prefix else {}))
        if prefix:
            with torch.no_grad():
                model.prefix_encoder.embedding.weight.normal_(0, 1.0)
        ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            whole = model(ids).logits
            out = model(ids[:, :16], use_cache=True)
            steps, cache = [out.logits], out.cache
            for t in range(16, 24):
                out = model(ids[:, t:t + 1], cache=cache, use_cache=True)
                steps.append(out.logits)
                cache = out.cache
        assert (torch.cat(steps, 1) - whole).abs().max() < 1e-5, prefix
        width = cache.layers[0].values.shape[-1]  # the rotated shared key and the indexer's key, per token
        assert width == model.config.qk_rope_head_dim + model.config.index_head_dim
        assert cache.layers[1].values.shape[-1] == model.config.qk_rope_head_dim  # a shared layer keeps none
