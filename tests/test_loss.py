"""The training loss: the output layer on labelled positions only, in chunks, equal to the plain shifted cross
entropy over full logits (value and gradients), for the GLM versions' forward as for the function itself."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from chatglm_tune.models.loss import causal_lm_loss


def plain_loss(head, hidden, labels):
    """transformers' causal LM loss: fp32 logits at every position, shifted, -100 ignored."""
    logits = head(hidden).float()
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100)


class CountingHead(nn.Linear):
    """A head that records how many rows each call takes."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rows = []

    def forward(self, x):
        self.rows.append(x.reshape(-1, x.shape[-1]).shape[0])
        return super().forward(x)


def case(seed=0, b=3, s=11, h=8, vocab=50):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, s, h, generator=generator)
    labels = torch.randint(0, vocab, (b, s), generator=generator)
    labels[0, :6] = -100  # a prompt without loss
    labels[2, -3:] = -100  # right pads
    head = CountingHead(h, vocab, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, h, generator=generator))
    return head, hidden, labels


@pytest.mark.parametrize("chunk_tokens", [1, 4, 7, 10_000])
def test_equal_to_the_full_logits_loss_with_its_gradients(chunk_tokens):
    head, hidden, labels = case()
    picked = int((labels[:, 1:] != -100).sum())
    hidden_a = hidden.clone().requires_grad_(True)
    loss = causal_lm_loss(head, hidden_a, labels, chunk_tokens=chunk_tokens)
    loss.backward()
    grads = hidden_a.grad, head.weight.grad.clone()
    # the head saw the labelled positions only, at most chunk_tokens rows at a time (the backward recomputes them)
    assert sum(head.rows[: -(-picked // chunk_tokens)]) == picked
    assert max(head.rows) <= chunk_tokens

    head.weight.grad = None
    hidden_b = hidden.clone().requires_grad_(True)
    expect = plain_loss(head, hidden_b, labels)
    expect.backward()
    torch.testing.assert_close(loss, expect, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grads[0], hidden_b.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grads[1], head.weight.grad, rtol=1e-5, atol=1e-7)


def test_chunks_are_recomputed_not_kept_in_the_backward():
    head, hidden, labels = case()
    picked = int((labels[:, 1:] != -100).sum())
    loss = causal_lm_loss(head, hidden.requires_grad_(True), labels, chunk_tokens=5)
    forward_rows = sum(head.rows)
    loss.backward()
    assert forward_rows == picked and sum(head.rows) == 2 * picked  # each chunk's logits made again, then dropped


def test_no_grad_evaluation_equals_and_bad_chunk_is_refused():
    head, hidden, labels = case(seed=1)
    with torch.no_grad():
        torch.testing.assert_close(causal_lm_loss(head, hidden, labels, chunk_tokens=3),
                                   plain_loss(head, hidden, labels))
    with pytest.raises(ValueError, match="chunk_tokens"):
        causal_lm_loss(head, hidden, labels, chunk_tokens=0)


def test_a_glm_model_trains_on_labelled_positions_with_transformers_loss():
    """A tiny GLM-4-0414 (transformers' own class plus the prefix): the loss of the labelled positions equals
    transformers' forward on the same weights, gradients too; no logits come back with labels."""
    from transformers import Glm4Config, Glm4ForCausalLM

    from chatglm_tune.models.glm.modeling import Glm4ForCausalLMWithPrefix

    config = Glm4Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, pad_token_id=0)
    torch.manual_seed(0)
    ours = Glm4ForCausalLMWithPrefix(config)
    theirs = Glm4ForCausalLM(config)
    theirs.load_state_dict(ours.state_dict())
    ids = torch.randint(1, 96, (2, 12))
    labels = ids.clone()
    labels[:, :7] = -100
    out = ours(ids, labels=labels)
    expect = theirs(ids, labels=labels)
    assert out.logits is None
    torch.testing.assert_close(out.loss, expect.loss, rtol=1e-5, atol=1e-6)
    out.loss.backward()
    expect.loss.backward()
    torch.testing.assert_close(ours.lm_head.weight.grad, theirs.lm_head.weight.grad, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(ours.model.layers[0].self_attn.q_proj.weight.grad,
                               theirs.model.layers[0].self_attn.q_proj.weight.grad, rtol=1e-4, atol=1e-7)
