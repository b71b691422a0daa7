"""A quantized model keeps working after `generate` / `chat`.

`generate` runs under `torch.inference_mode()`. The quantized layers' CPU matmuls reuse per-thread
workspace buffers (`cpu_matmul.workspace`); one first allocated inside inference mode was an inference
tensor, and the next plain forward that wrote into it (a long prompt, which takes the dequantizing
path) failed with "Inplace update to inference tensor outside InferenceMode". The workspace is emptied
first so the first allocation happens inside `generate`, as in a fresh process.
"""

import json
from pathlib import Path

import pytest
import torch

from chatglm_tune.decoding.generation import generate
from chatglm_tune.models.registry import VERSIONS
from chatglm_tune.options import LoraOptions
from chatglm_tune.quant import cpu_matmul
from chatglm_tune.quant.apply import quantize_model
from chatglm_tune.quant.modules import QuantizedLinear
from chatglm_tune.runs.lora import apply_lora

DATA = Path(__file__).resolve().parents[1] / "data" / "spo_dev.jsonl"
TEXTS = [json.loads(line)["text"] for line in DATA.read_text(encoding="utf-8").splitlines()[:40]]


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("name", ["chatglm", "chatglm3", "glm4"])
def test_a_quantized_model_runs_and_trains_after_generate(name, bits, tmp_path):
    version = VERSIONS[name]
    model, tokenizer = version.tiny(TEXTS, tmp_path)
    quantize_model(model, bits, targets=version.quantizable_linears)
    model.eval()
    long_prompt = version.format.prompt_ids(tokenizer, _record(TEXTS[0] + TEXTS[1]), _encoding())[0]
    ids = torch.tensor([long_prompt])
    assert ids.shape[1] > QuantizedLinear.max_kernel_rows
    for layer in model.modules():  # the dequantizing path, which uses the workspace (where "auto" takes the
        if isinstance(layer, QuantizedLinear):  # integer-dot kernel for prefill, it still does for bf16 INT8)
            layer.kernel = "dequant"
    cpu_matmul._buffers.__dict__.clear()
    generate(model, ids, max_new_tokens=2)  # allocates the workspace under inference_mode
    with torch.no_grad():
        plain = model(ids).logits
    assert torch.isfinite(plain).all()
    tuned = apply_lora(model, LoraOptions(r=2, target=version.lora_targets))  # QLoRA: a training step after generate
    tuned.train()
    loss = tuned(ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None for p in tuned.parameters() if p.requires_grad)


def _record(text):
    from chatglm_tune.data.records import SPORecord

    return SPORecord(text=text, triples=None)


def _encoding():
    from chatglm_tune.options import EncodingOptions

    return EncodingOptions(max_src_len=200, max_len=240)
