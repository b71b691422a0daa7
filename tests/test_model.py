"""The model against the official implementation's golden outputs, and its invariants.

Golden tolerance (the one the golden outputs were made for): fp32 logits within 1e-3 (values are around 30); greedy ids
equal except after a step whose top-1/top-2 margin is below 1e-3.
"""

import pytest
import torch

from chatglm_tune import ChatGLMConfig, ChatGLMForConditionalGeneration
from chatglm_tune.runtime.checkpoint import CheckpointError
from conftest import left_pad_mask

TOL = 1e-3


def _max_diff(a, b):
    return (a.float() - b.float()).abs().max().item()


def _greedy_ids_match(got, expected, margins=None):
    """Equal ids, except after a step whose margin says another summation order may pick another token."""
    for step, (g, e) in enumerate(zip(got, expected)):
        if g != e:
            return margins is not None and min(margins[: step + 1]) < 1e-3
    return len(got) == len(expected)


@torch.no_grad()
def test_single_prompts_match_golden_logits(golden):
    model = golden.model()
    for case in golden.of_kind("single"):
        logits = model(torch.tensor([case["input_ids"]])).logits[0]
        assert _max_diff(logits[-1], golden.logits[case["expect_tensor"] + "_last"]) < TOL, case["name"]
        assert logits.topk(5).indices.tolist() == case["top5_ids"], case["name"]
        assert _max_diff(logits.topk(5).values, torch.tensor(case["top5_logits"])) < TOL, case["name"]
        if case["expect_tensor"] + "_all" in golden.logits:
            assert _max_diff(logits, golden.logits[case["expect_tensor"] + "_all"]) < TOL


@torch.no_grad()
def test_left_padded_batch_with_official_4d_mask_and_with_2d_mask(golden):
    model = golden.model()
    (case,) = golden.of_kind("batch_left_padded")
    ids = torch.tensor(case["input_ids"])
    blocked = torch.tensor(case["attention_mask_true_means_blocked"]).bool()
    official = model(ids, position_ids=torch.tensor(case["position_ids"]), attention_mask=blocked).logits
    assert _max_diff(official[:, -1], golden.logits["batch_last"]) < TOL
    ours = model(ids, attention_mask=left_pad_mask(ids, model.config.pad_token_id)).logits
    assert _max_diff(ours[:, -1], golden.logits["batch_last"]) < TOL


@torch.no_grad()
def test_loss_matches_golden(golden):
    model = golden.model()
    for case in golden.of_kind("loss"):
        out = model(torch.tensor([case["input_ids"]]), labels=torch.tensor([case["labels"]]))
        assert abs(out.loss.item() - case["expect_loss"]) < 1e-4 * abs(case["expect_loss"])
        assert out.logits is None  # the loss-only path runs the head on labelled positions only


@torch.no_grad()
def test_prefix_cases_match_golden(golden):
    for case in golden.of_kind("prefix"):
        model = golden.model(pre_seq_len=case["pre_seq_len"], prefix_projection=case["prefix_projection"])
        model.load_prefix(golden.dir / case["prefix_file"])
        ids = torch.tensor([case["input_ids"]])
        logits = model(ids).logits[0]
        assert _max_diff(logits[-1], golden.logits[case["expect_tensor"] + "_last"]) < TOL, case["name"]
        assert logits.topk(5).indices.tolist() == case["top5_ids"], case["name"]
        new = model.generate(ids, max_new_tokens=len(case["expect_new_ids"]), do_sample=False, eos_token_id=None)
        assert _greedy_ids_match(new[0, ids.shape[1]:].tolist(), case["expect_new_ids"]), case["name"]


@torch.no_grad()
def test_transformers_generate_reproduces_golden_greedy(golden):
    model = golden.model()
    for case in golden.of_kind("greedy"):
        ids = torch.tensor([case["input_ids"]])
        out = model.generate(ids, max_new_tokens=case["max_new_tokens"], do_sample=False, eos_token_id=None)
        assert _greedy_ids_match(out[0, ids.shape[1]:].tolist(), case["expect_new_ids"],
                                 case["step_margins"]), case["name"]
    (case,) = golden.of_kind("batch_greedy")
    ids = torch.tensor(case["input_ids"])
    out = model.generate(ids, attention_mask=left_pad_mask(ids, model.config.pad_token_id),
                         max_new_tokens=case["max_new_tokens"], do_sample=False, eos_token_id=None)
    for row, expected in zip(out[:, ids.shape[1]:].tolist(), case["expect_new_ids"]):
        assert _greedy_ids_match(row, expected)


@torch.no_grad()
@pytest.mark.parametrize("pre_seq_len", [None, 3])
def test_cached_decoding_equals_full_forward(golden, pre_seq_len):
    model = golden.model(pre_seq_len=pre_seq_len)
    ids = torch.tensor([golden.of_kind("greedy")[1]["input_ids"]])
    out = model(ids, use_cache=True)
    seq, cache = ids, out.cache
    for _ in range(4):
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], dim=1)
        full = model(seq).logits[:, -1]
        pos = model.prepare_inputs_for_generation(seq, cache=cache)["position_ids"]
        out = model(nxt, position_ids=pos, cache=cache, use_cache=True)
        cache = out.cache
        assert _max_diff(out.logits[:, -1], full) < TOL


def test_prefix_checkpoint_round_trip_and_mismatch_messages(golden, tmp_path):
    model = golden.model(pre_seq_len=3, prefix_projection=True)
    trainable = {k: v for k, v in model.state_dict().items() if k.startswith("transformer.prefix_encoder.")}
    model.save_pretrained(tmp_path / "prefix", state_dict=trainable)
    ids = torch.tensor([golden.of_kind("single")[0]["input_ids"]])
    again = golden.model(pre_seq_len=3, prefix_projection=True)
    again.load_prefix(tmp_path / "prefix")
    with torch.no_grad():
        assert torch.equal(model(ids).logits, again(ids).logits)
    for other in (dict(pre_seq_len=5, prefix_projection=True), dict(pre_seq_len=3, prefix_projection=False)):
        wrong = golden.model(**other)
        with pytest.raises(CheckpointError) as err:
            wrong.load_prefix(tmp_path / "prefix")
        message = str(err.value)
        assert "pre_seq_len=3, prefix_projection=True" in message
        assert f"pre_seq_len={other['pre_seq_len']}, prefix_projection={other['prefix_projection']}" in message
        with pytest.raises(CheckpointError, match="prefix_projection=True.*the model has"):  # the bare file too
            wrong.load_prefix(tmp_path / "prefix" / "model.safetensors")


def test_ptuning_backward_updates_only_the_prefix_encoder(golden):
    from chatglm_tune.options import TrainOptions
    from chatglm_tune.tuning.training import set_trainable

    model = golden.model(pre_seq_len=3).train()
    assert all(p.requires_grad for p in model.parameters())  # building a model decides nothing about training
    model = set_trainable(model, TrainOptions(tuning="ptuning"))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(n.startswith("transformer.prefix_encoder.") for n in trainable)
    case = golden.of_kind("loss")[0]
    model(torch.tensor([case["input_ids"]]), labels=torch.tensor([case["labels"]])).loss.backward()
    for name, p in model.named_parameters():
        assert (p.grad is not None and p.grad.abs().sum() > 0) == (name in trainable), name


def test_gradient_checkpointing_gives_the_same_gradients(golden):
    case = golden.of_kind("loss")[0]
    ids, labels = torch.tensor([case["input_ids"]]), torch.tensor([case["labels"]])
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(0)  # the same fresh prefix for both runs
        model = golden.model(pre_seq_len=2)
        model.transformer.prefix_dropout.p = 0.0
        model.train()
        if checkpointing:
            model.activation_checkpointing_enable()
            model.enable_input_require_grads()
        model(ids, labels=labels).loss.backward()
        grads.append(model.transformer.prefix_encoder.embedding.weight.grad.clone())
    assert torch.allclose(grads[0], grads[1], atol=1e-6)


def test_peft_lora_on_query_key_value(golden):
    from peft import LoraConfig, get_peft_model

    model = golden.model()
    case = golden.of_kind("loss")[0]
    ids, labels = torch.tensor([case["input_ids"]]), torch.tensor([case["labels"]])
    with torch.no_grad():
        before = model(ids).logits
    lora = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["query_key_value"], lora_dropout=0.0))
    with torch.no_grad():
        assert torch.equal(lora(input_ids=ids).logits, before)  # LoRA is the identity at init
    lora.train()
    lora(input_ids=ids, labels=labels).loss.backward()
    with_grad = {n for n, p in lora.named_parameters() if p.grad is not None}
    assert with_grad and all("lora_" in n for n in with_grad)


def test_accelerate_prepare_and_step(golden):
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = golden.model(pre_seq_len=2)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    case = golden.of_kind("loss")[0]
    ids, labels = torch.tensor([case["input_ids"]]), torch.tensor([case["labels"]])
    model.train()
    before = model.transformer.prefix_encoder.embedding.weight.detach().clone()
    accelerator.backward(model(ids, labels=labels).loss)
    optimizer.step()
    assert not torch.equal(before, model.transformer.prefix_encoder.embedding.weight)


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_first_block_within_rounding_of_fp32(golden, dtype):
    """Random golden models amplify any perturbation ~4-8x per block (fp32 too), so half precision is
    checked where its error is local: the first block's output, within 8 units of roundoff of fp32."""
    ids = torch.tensor([golden.of_kind("single")[1]["input_ids"]])
    outputs = {}
    for dt in (torch.float32, dtype):
        model = golden.model(dtype=dt)
        model.transformer.layers[0].register_forward_hook(lambda m, i, out, dt=dt: outputs.update({dt: out.float()}))
        logits = model(ids).logits
        assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    ref = outputs[torch.float32]
    assert _max_diff(outputs[dtype], ref) / ref.abs().max() < 8 * torch.finfo(dtype).eps


def test_auto_classes_load_without_remote_code(golden):
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    assert isinstance(AutoConfig.from_pretrained(golden.dir), ChatGLMConfig)
    assert isinstance(AutoModel.from_pretrained(golden.dir), ChatGLMForConditionalGeneration)
    model = AutoModelForCausalLM.from_pretrained(golden.dir, pre_seq_len=4, prefix_projection=True, dtype="bfloat16")
    assert model.config.pre_seq_len == 4 and model.transformer.word_embeddings.weight.dtype == torch.bfloat16
    assert model.transformer.prefix_encoder.embedding.weight.dtype == torch.float32


def test_missing_sop_is_a_clear_error(golden):
    model = golden.model()
    with pytest.raises(ValueError, match=r"rows \[0\] of input_ids have no <sop>"):
        model(torch.tensor([[5, 6, 7]]))
