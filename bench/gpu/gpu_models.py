"""The models and the measurements of bench/gpu/gpu.py, on a CUDA GPU.

Models: random weights of a real shape, initialised directly on the GPU in bf16 (`build`), the toolkit's
`GlmForCausalLMWithPrefix` (transformers' `GlmForCausalLM` with the P-tuning prefix):
    mid          ChatGLM3-6B's config.json with 8 layers of hidden 2048 (16 heads of 128, 2 KV groups, MLP 6848)
    chatglm3-6b  THUDM/chatglm3-6b's config.json (bench/common/scale_versions.py), 6.2 B parameters
    glm4-9b      THUDM/glm-4-9b-chat's config.json (bench/common/scale_versions.py), 9.4 B parameters
INT8 / INT4: `quant.apply.quantize_model` of the bf16 model on the GPU (the official per-row format; the GPU
runs its `dequant` path); bitsandbytes LLM.int8() / NF4: `quant.apply.to_bitsandbytes`.

Prompts: the version's chat frame (`[gMASK] sop <|user|> ... <|assistant|>`, GLM-4: `<sop>`) around random
ordinary ids, every row of the batch the same length.
- `decode`: one call of `run(ids, new_tokens)` (the toolkit's `generation.generate_steps` with eos_token_id=None,
  eager or compiled, or transformers' `generate` with min_new_tokens = max_new_tokens: every row the full count),
  after a warm-up call of the same shapes (a process's first step at each key length builds a cuDNN attention plan:
  a 2-token warm-up left ChatGLM3-6B's first bf16 call 3x slow on an H200; a compiled step compiles and records its
  CUDA graphs there). tok/s = batch x new tokens / the whole call (prefill included); decode tok/s = batch x (new
  tokens - 1) / (end - the first token's arrival: the toolkit's first yield, transformers' second forward): the
  incremental steps alone. The compiled rows' ids are compared with the cached loop's (`agreement`), and INT8 /
  INT4 logits with the dequantizing path's (`kernel_error`).
- `train_step`: forward with labels, backward, AdamW step on a batch of rows (the prompt unlabelled, the
  answer labelled), after one warm-up step; the median of the timed steps. Gradient checkpointing where the
  caller switched it on (full-size models).
Peak memory: `torch.cuda.max_memory_allocated()` over the measured call, its counter reset before it
(the weights included); GB = 1e9 bytes.
"""

from __future__ import annotations

import gc
import statistics
import time

import torch

from bench.common.scale_versions import CHATGLM3_6B, GLM4_9B_CHAT

GB = 1e9
DEVICE = "cuda"  # where every model, prompt and batch is put
MID = {**CHATGLM3_6B, "num_layers": 8, "hidden_size": 2048, "ffn_hidden_size": 6848, "num_attention_heads": 16}
MODELS = {"mid": ("chatglm3", MID), "chatglm3-6b": ("chatglm3", CHATGLM3_6B), "glm4-9b": ("glm4", GLM4_9B_CHAT)}
# (head ids, tail ids, ordinary ids below): ChatGLM3 [gMASK] sop <|user|> | <|assistant|>;
# GLM-4 [gMASK] <sop> <|user|> | <|assistant|>
FRAMES = {"chatglm3": ((64790, 64792, 64795), (64796,), 64789), "glm4": ((151331, 151333, 151336), (151337,), 151329)}


def config_of(name: str):
    from chatglm_tune.models.glm.config import glm_config

    version, raw = MODELS[name]
    return glm_config(dict(raw), version=version)


def parameter_count(name: str) -> int:
    """Parameters of the model (counted on the meta device: nothing allocated)."""
    from chatglm_tune.models.glm.modeling import GlmForCausalLMWithPrefix

    with torch.device("meta"):
        return sum(p.numel() for p in GlmForCausalLMWithPrefix(config_of(name)).parameters())


def build(name: str, seed: int = 0):
    """The toolkit's model of `name`, random (transformers' init, std 0.02), built on the GPU in bf16."""
    from chatglm_tune.models.glm.modeling import GlmForCausalLMWithPrefix
    from transformers.models.glm.modeling_glm import GlmRotaryEmbedding

    config = config_of(name)
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(DEVICE):
            model = GlmForCausalLMWithPrefix(config)
    finally:
        torch.set_default_dtype(default)
    model.model.rotary_emb = GlmRotaryEmbedding(config=config).to(DEVICE)  # as the loader builds it: fp32 frequencies
    config.dtype = torch.bfloat16
    return model.eval()


def quantize(model, precision: str):
    """`model` with its block Linears as `precision` says: bf16 as built, int8 / int4 (`quantize_model`, on the
    GPU), bnb-int8 / bnb-nf4 (`to_bitsandbytes`)."""
    from chatglm_tune.models.registry import of_config
    from chatglm_tune.quant.apply import quantize_model, to_bitsandbytes

    targets = of_config(model.config).quantizable_linears
    if precision in ("int8", "int4"):
        quantize_model(model, int(precision[-1]), targets=targets)
    elif precision.startswith("bnb-"):
        to_bitsandbytes(model, precision[4:], targets=targets)
    free()
    return model


def transformers_twin(model):
    """transformers' own `GlmForCausalLM` holding the same weight tensors as the toolkit's `model` (no copy): a
    `GlmConfig` of its fields, the state dict less the prefix encoder assigned onto a meta-built model."""
    from transformers import GlmConfig, GlmForCausalLM
    from transformers.models.glm.modeling_glm import GlmRotaryEmbedding

    c = model.config
    fields = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps",
              "attention_bias", "attention_dropout", "rope_parameters", "pad_token_id", "eos_token_id",
              "tie_word_embeddings", "use_cache")
    config = GlmConfig(**{k: getattr(c, k) for k in fields})
    with torch.device("meta"):
        twin = GlmForCausalLM(config)
    state = {k: v for k, v in model.state_dict().items() if not k.startswith("prefix_encoder.")}
    twin.load_state_dict(state, strict=True, assign=True)
    twin.model.rotary_emb = GlmRotaryEmbedding(config=config).to(DEVICE)
    config.dtype = torch.bfloat16
    return twin.eval()


def prompt(version: str, batch: int, length: int, seed: int = 0, tail_at: int | None = None) -> torch.Tensor:
    """[batch, length] ids on the GPU: the frame's head, random ordinary ids, its tail ending at `tail_at`."""
    head, tail, plain = FRAMES[version]
    tail_at = length if tail_at is None else tail_at
    ids = torch.randint(5, plain, (batch, length), generator=torch.Generator().manual_seed(seed))
    ids[:, : len(head)] = torch.tensor(head)
    ids[:, tail_at - len(tail) : tail_at] = torch.tensor(tail)
    return ids.to(DEVICE)


def toolkit_decoder(model, compiled: bool = False):
    """`run(ids, n)` -> (each row's new ids, when the first new token was out): the toolkit's `generate_steps`,
    eagerly or `compiled` (a static cache, the steps one compiled function: CUDA graphs on the GPU)."""
    from chatglm_tune.decoding.generation import generate_steps

    def run(ids, n):
        rows, first = [[] for _ in range(ids.shape[0])], None
        for live, tokens in generate_steps(model, ids, max_new_tokens=n, eos_token_id=None, compiled=compiled):
            first = first or time.perf_counter()  # each yield follows a token's copy to the host
            for row, token in zip(live, tokens):
                rows[row].append(token)
        return rows, first

    return run


def transformers_decoder(twin):
    """`run(ids, n)` -> (each row's new ids, when the second forward started): transformers' `generate`."""
    def run(ids, n):
        calls: list[float] = []
        hook = twin.register_forward_pre_hook(lambda *_: calls.append(time.perf_counter()))
        try:
            out = twin.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                do_sample=False, pad_token_id=twin.config.pad_token_id)
        finally:
            hook.remove()
        return out[:, ids.shape[1]:].tolist(), calls[1]

    return run


def decode(run, ids: torch.Tensor, new_tokens: int) -> dict:
    """Time `run(ids, new_tokens)`; see the module docstring. The row keeps the new ids under "ids"."""
    run(ids, new_tokens)  # warm-up of the same shapes: kernels, attention plans, compilation, CUDA graphs
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    made, first = run(ids, new_tokens)
    torch.cuda.synchronize()
    end = time.perf_counter()
    b = ids.shape[0]
    assert sum(map(len, made)) == b * new_tokens, [len(row) for row in made]
    return {"what": "decode", "batch": b, "prompt": ids.shape[1], "new_tokens": new_tokens, "seconds": end - start,
            "tok_s": b * new_tokens / (end - start), "decode_tok_s": b * (new_tokens - 1) / (end - first),
            "prefill_s": first - start, "peak_gb": torch.cuda.max_memory_allocated() / GB, "ids": made}


@torch.inference_mode()
def agreement(model, prompt: torch.Tensor, ref: list[list[int]], got: list[list[int]],
              mask: torch.Tensor | None = None) -> dict:
    """Whether `got` (each row's ids) is `ref`; else the first step where a row leaves it, and `model`'s top-2 logit
    margin there on that row (ref's prefix, the prompt's pads left out by `mask`): in its logits' standard
    deviations, how near a tie the parting is."""
    step = next((t for t in range(len(ref[0])) if any(a[t] != b[t] for a, b in zip(ref, got))), None)
    if step is None:
        return {"same_ids": True}
    rows = [r for r, (a, b) in enumerate(zip(ref, got)) if a[step] != b[step]]
    row = prompt[rows[0]] if mask is None else prompt[rows[0]][mask[rows[0]].bool()]
    seq = torch.cat([row, torch.tensor(ref[rows[0]][:step], dtype=prompt.dtype, device=prompt.device)])
    logits = model(seq[None]).logits[0, -1].float()
    top = logits.topk(2).values
    margin = (top[0] - top[1]).item()
    return {"same_ids": False, "first_diff_step": step, "rows_parting": len(rows), "margin": margin,
            "margin_std": margin / logits.std().item()}


@torch.inference_mode()
def kernel_error(model, ids: torch.Tensor) -> float:
    """Relative error (Frobenius) of the logits of `ids` with the INT8 / INT4 layers' own kernels against the
    dequantizing path (the same integers, dequantized to the compute dtype)."""
    from chatglm_tune.quant.modules import QuantizedLinear

    layers = {m: m.kernel for m in model.modules() if isinstance(m, QuantizedLinear)}
    fast = model(ids).logits.float()
    for layer in layers:
        layer.kernel = "dequant"
    try:
        ref = model(ids).logits.float()
    finally:
        for layer, kernel in layers.items():
            layer.kernel = kernel
    return ((fast - ref).norm() / ref.norm()).item()


def copy_bandwidth(gigabytes: float = 2.0, repeats: int = 20) -> float:
    """The card's device-to-device copy rate, GB/s (bytes read + bytes written), median of `repeats` copies of
    `gigabytes` of random bytes, timed with CUDA events after a warm-up."""
    src = torch.randint(0, 256, (int(gigabytes * GB),), dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    free()
    return 2 * gigabytes * GB / statistics.median(times) / GB


def train_batch(version: str, batch: int, length: int) -> dict:
    """Rows of `length` ids, the first half a framed prompt (labels -100), the second half the labelled answer."""
    ids = prompt(version, batch, length, seed=2, tail_at=length // 2)
    labels = ids.clone()
    labels[:, : length // 2] = -100
    return {"input_ids": ids, "labels": labels}


def train_step(model, params: list, batch: dict, lr: float, steps: int) -> dict:
    """One warm-up step, then the median of `steps` timed steps (forward with labels, backward, AdamW)."""
    optimizer = torch.optim.AdamW(params, lr=lr)
    model.train()

    def step() -> float:
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times, loss = [], None
    for _ in range(steps):
        start = time.perf_counter()
        loss = step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    tokens = batch["input_ids"].numel()
    return {"batch": batch["input_ids"].shape[0], "seconds": seconds, "tok_s": tokens / seconds, "loss": loss,
            "peak_gb": torch.cuda.max_memory_allocated() / GB, "trainable": sum(p.numel() for p in params)}


def checkpointing(model, on: bool) -> None:
    """Gradient checkpointing as train.py's --gradient-checkpointing switches it on (and the inputs' gradients)."""
    if on:
        model.activation_checkpointing_enable()
        model.enable_input_require_grads()


def ptuning_step(model, batch: dict, steps: int, ckpt: bool) -> dict:
    """A P-tuning v2 step of the toolkit: the library's defaults (`TrainOptions()`: pre_seq_len 128, no projection,
    lr 2e-2), the prefix encoder in fp32 as the official code keeps it; the prefix is taken off afterwards."""
    from chatglm_tune.models.glm.prefix import prefix_encoder
    from chatglm_tune.options import DEFAULT_LR, TrainOptions
    from chatglm_tune.tuning.training import set_trainable

    options = TrainOptions(tuning="ptuning")
    model.config.pre_seq_len, model.config.prefix_projection = options.pre_seq_len, options.prefix_projection
    model.prefix_encoder = prefix_encoder(model.config).to(DEVICE)
    try:
        checkpointing(model, ckpt)
        set_trainable(model, options)
        params = [p for p in model.parameters() if p.requires_grad]
        return {"what": "ptuning step", **train_step(model, params, batch, DEFAULT_LR["ptuning"], steps)}
    finally:
        model.prefix_encoder, model.config.pre_seq_len = None, None
        model.eval()
        free()


def lora_step(model, batch: dict, steps: int, ckpt: bool, *, transformers: bool = False) -> dict:
    """A LoRA step: the toolkit's (`set_trainable` with `LoraOptions()`: r 8, alpha 32, dropout 0.1 on q/k/v), or
    peft's `get_peft_model` on transformers' model with the same LoraConfig (as LLaMA-Factory runs it); lr 5e-5.
    The model is left wrapped: measure it last."""
    from peft import LoraConfig, get_peft_model

    from chatglm_tune.models.registry import VERSIONS
    from chatglm_tune.options import DEFAULT_LR, LoraOptions, TrainOptions
    from chatglm_tune.tuning.training import set_trainable

    checkpointing(model, ckpt)
    if transformers:
        o = LoraOptions()
        tuned = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", r=o.r, lora_alpha=o.alpha,
                                                 lora_dropout=o.dropout,
                                                 target_modules=list(VERSIONS["glm4"].lora_targets)))  # every GLM
    else:
        tuned = set_trainable(model, TrainOptions(tuning="lora"))
    params = [p for p in tuned.parameters() if p.requires_grad]
    return {"what": "lora step", **train_step(tuned, params, batch, DEFAULT_LR["lora"], steps)}


def free() -> None:
    gc.collect()
    torch.cuda.empty_cache()
