"""The measuring processes of bench/scale/scale.py: each runs fresh, prints one JSON line, and is measured from
outside (its peak RSS and wall time) by `measure.run`.

    python bench/scale/scale_children.py bandwidth [--threads N]
    python bench/scale/scale_children.py infer --model-dir DIR --frame JSON --bits {0,8,4} [--quantize-embedding]
        [--max-kernel-rows N]
    python bench/scale/scale_children.py train {ptuning,lora}-{bf16,int8,int4} --model-dir DIR --frame JSON
        [--budget-s S] ...

Any version: the model loads through `chatglm_tune.from_pretrained` (the version read from config.json),
and the prompts are built from `--frame` (`scale_versions.PromptFrame.resolve`: the version's special
ids around random ordinary ids; ChatGLM-6B: `... [gMASK] <sop>`, ChatGLM3 / GLM-4: `[gMASK] <sop>
<|user|> ... <|assistant|>`), resolved by the parent so that no tokenizer sits in the measured process.
`infer`: load with `dtype=bfloat16` (quantized at load if `--bits` and the checkpoint is not already),
then batch-1 greedy decoding of 32 new tokens after a 64-token prompt (`generation.generate`, no stop on
<eop>, after a 2-token warm-up that also builds the INT4 kernel layout). Decode tokens/s = 31 / (end -
start of the first incremental step).
`train`: one training step (forward with labels, backward, AdamW step) on batch 1 x 256 tokens (128
prompt tokens ending with the frame's tail, 128 labelled answer tokens ending with its `end`), gradient
checkpointing on, bf16 compute (`--train-dtype float32`: train.py's default, for CPUs without native bf16 matmuls),
the library's defaults for the tuning (`training.DEFAULT_LR`,
`TrainOptions().pre_seq_len` and `prefix_projection` for P-tuning v2, `LoraOptions()` with the version's
targets for LoRA). A step that would not finish inside `--budget-s` is stopped at the budget: what was
measured is printed, the rest of the backward extrapolated per layer, and the result says `partial`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: chatglm_tune, bench.<room>.<module>

from bench.common.measure import copy_bandwidth, memory_status, peak_rss, weight_bytes_per_token  # noqa: E402
from bench.common.scale_versions import framed_ids  # noqa: E402

GB = 1e9
PROMPT_LEN, NEW_TOKENS, WARMUP_PROMPT, WARMUP_TOKENS = 64, 32, 8, 2
TRAIN_LEN, TRAIN_PROMPT = 256, 128
BITS = {"bf16": 0, "int8": 8, "int4": 4}
# name -> (bits, where the weights come from: "source" = the fp16 checkpoint, quantized at load if bits)
INFER = {"bf16": (0, "source"), "int8-load": (8, "source"), "int8-file": (8, "int8"),
         "int4-load": (4, "source"), "int4-file": (4, "int4")}
TRAIN = [f"{tuning}-{base}" for tuning in ("ptuning", "lora") for base in BITS]
TRAIN_DTYPES = ("bfloat16", "float32")  # train: float32 is train.py's default, for CPUs without bf16 matmuls


def _prompt(frame: dict, length: int, seed: int) -> torch.Tensor:
    return framed_ids(frame, length, length, seed)


def child_infer(args) -> dict:
    from chatglm_tune import from_pretrained
    from chatglm_tune.decoding.generation import generate

    rss_start = peak_rss()
    start = time.perf_counter()
    model = from_pretrained(args.model_dir, dtype=torch.bfloat16, quantization_bit=args.bits or None,
                            quantize_embedding=args.quantize_embedding)
    load_s, rss_load, status_load = time.perf_counter() - start, peak_rss(), memory_status()
    start = time.perf_counter()
    generate(model, _prompt(args.frame, WARMUP_PROMPT, 1), max_new_tokens=WARMUP_TOKENS, eos_token_id=None)
    warmup_s, rss_warmup = time.perf_counter() - start, peak_rss()
    calls: list[float] = []
    hook = model.register_forward_pre_hook(lambda *_: calls.append(time.perf_counter()))
    start = time.perf_counter()
    out = generate(model, _prompt(args.frame, PROMPT_LEN, 0), max_new_tokens=NEW_TOKENS, eos_token_id=None)[0]
    end = time.perf_counter()
    hook.remove()
    assert len(out) == NEW_TOKENS and len(calls) == NEW_TOKENS, (len(out), len(calls))
    return {
        "load_s": round(load_s, 1), "warmup_s": round(warmup_s, 1), "prefill_s": round(calls[1] - start, 2),
        "decode_tok_s": (NEW_TOKENS - 1) / (end - calls[1]), "weight_bytes_per_token": weight_bytes_per_token(model),
        "rss_start_gb": rss_start / GB, "rss_load_gb": rss_load / GB, "rss_warmup_gb": rss_warmup / GB,
        "rss_end_gb": peak_rss() / GB, "status_load_mb": status_load, "status_end_mb": memory_status(),
        "distinct_tokens": len(set(out)), "quantize_embedding": args.quantize_embedding,
    }


def _train_model(model_dir, tuning: str, bits: int, quantize_embedding: bool, dtype: torch.dtype):
    """(model to step, its core model, the trainable parameters, the optimizer): as train.py prepares them, its
    float weights and its compute in `dtype`."""
    from chatglm_tune import from_pretrained
    from chatglm_tune.options import DEFAULT_LR, TrainOptions
    from chatglm_tune.runtime import heap
    from chatglm_tune.tuning.training import set_trainable

    defaults = TrainOptions(tuning=tuning)
    extra = {"pre_seq_len": defaults.pre_seq_len,
             "prefix_projection": defaults.prefix_projection} if tuning == "ptuning" else {}
    core = from_pretrained(model_dir, dtype=dtype, quantization_bit=bits or None,
                           quantize_embedding=quantize_embedding, **extra)
    core.activation_checkpointing_enable()
    core.enable_input_require_grads()
    heap.mmap_large_blocks(core)  # as train.py does
    model = set_trainable(core, defaults)  # the prefix encoder, or LoRA adapters (the library's defaults)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    return model, core, params, torch.optim.AdamW(params, lr=DEFAULT_LR[tuning])


def _train_batch(frame: dict) -> tuple[torch.Tensor, torch.Tensor]:
    ids = framed_ids(frame, TRAIN_LEN, TRAIN_PROMPT, 2)
    ids[0, -1] = frame["end"]
    labels = ids.clone()
    labels[0, :TRAIN_PROMPT] = -100
    return ids, labels


def _blocks(core) -> torch.nn.ModuleList:
    """The transformer blocks (`transformer.layers` of ChatGLM-6B, `model.layers` of the GLM family)."""
    return next(m for name, m in core.named_modules() if name.rpartition(".")[2] == "layers"
                and isinstance(m, torch.nn.ModuleList))


def child_train(args) -> dict:
    deadline = time.perf_counter() + args.budget_s
    tuning, base = args.name.split("-")
    result = {"tuning": tuning, "base": base, "quantize_embedding": args.quantize_embedding, "dtype": args.train_dtype,
              "rss_start_gb": peak_rss() / GB}
    marks: dict[str, list[float]] = {"forward": [], "backward": []}
    phase = {"name": "load", "t0": None, "t_fwd": None, "layers": None}
    lock = threading.Lock()

    def watchdog():  # the step cannot finish inside the budget: report what was measured, then exit
        time.sleep(max(0.0, deadline - time.perf_counter()))
        with lock:
            now = time.perf_counter()
            result.update(partial=True, stopped_in=phase["name"], rss_at_stop_gb=peak_rss() / GB,
                          status_end_mb=memory_status(), rss_end_gb=peak_rss() / GB)
            if phase["t0"] is not None:
                result["stopped_after_s"] = round(now - phase["t0"], 1)
            fwd, bwd = marks["forward"], marks["backward"]
            if phase["name"] == "forward" and len(fwd) > 1:
                result.update(forward_layers_done=len(fwd) - 1,
                              forward_per_layer_s=round((fwd[-1] - fwd[0]) / (len(fwd) - 1), 2))
            if phase["name"] == "backward":
                done = max(0, len(bwd) - 1)  # layers whose recompute + backward finished
                result["backward_layers_done"] = done
                if done:
                    per_layer = (bwd[-1] - bwd[0]) / done
                    head_s = bwd[0] - phase["t_fwd"]
                    result.update(backward_per_layer_s=round(per_layer, 1), head_backward_s=round(head_s, 1),
                                  step_s=round(result["forward_s"] + head_s + per_layer * phase["layers"], 1))
            print(json.dumps(result), flush=True)
            os._exit(0)

    threading.Thread(target=watchdog, daemon=True).start()
    start = time.perf_counter()
    model, core, params, optimizer = _train_model(args.model_dir, tuning, BITS[base], args.quantize_embedding,
                                                  getattr(torch, args.train_dtype))
    ids, labels = _train_batch(args.frame)
    layers = _blocks(core)
    # Hooks on a child of each block: they fire in the forward and again in the checkpoint recompute.
    def mark(*_):
        marks[phase["name"]].append(time.perf_counter())

    handles = [layer.input_layernorm.register_forward_pre_hook(mark) for layer in layers]
    with lock:
        result.update(load_s=round(time.perf_counter() - start, 1), trainable_params=sum(p.numel() for p in params),
                      rss_load_gb=peak_rss() / GB, status_load_mb=memory_status())
        phase.update(name="forward", t0=time.perf_counter(), layers=len(layers))
    t0 = phase["t0"]
    loss = model(input_ids=ids, labels=labels).loss
    with lock:
        t_fwd = time.perf_counter()
        result.update(loss=round(loss.item(), 4), forward_s=round(t_fwd - t0, 1), rss_forward_gb=peak_rss() / GB)
        phase.update(name="backward", t_fwd=t_fwd)
    loss.backward()
    with lock:
        t_bwd = time.perf_counter()
        result.update(backward_s=round(t_bwd - t_fwd, 1), rss_backward_gb=peak_rss() / GB)
        phase["name"] = "optimizer"
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    with lock:
        t_opt = time.perf_counter()
        for h in handles:
            h.remove()
        fwd = marks["forward"]
        result.update(optimizer_s=round(t_opt - t_bwd, 2), step_s=round(t_opt - t0, 1), partial=False,
                      forward_per_layer_s=round((fwd[-1] - fwd[0]) / max(1, len(fwd) - 1), 2),
                      rss_end_gb=peak_rss() / GB, status_end_mb=memory_status())
        phase["name"] = "done"
        return dict(result)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("kind", choices=("bandwidth", "infer", "train"))
    p.add_argument("name", nargs="?", choices=TRAIN, help="train: which step")
    p.add_argument("--model-dir", type=Path)
    p.add_argument("--frame", type=json.loads, help="infer/train: the prompt frame's ids, JSON "
                   '{"head": [...], "tail": [...], "end": ID, "plain": [LOW, HIGH]} '
                   '(scale_versions.PromptFrame.resolve)')
    p.add_argument("--bits", type=int, default=0, help="infer: 0 (bf16), 8 or 4")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default %(default)s)")
    p.add_argument("--budget-s", type=float, default=540.0, help="train: stop the step this long after the start")
    p.add_argument("--quantize-embedding", action="store_true", help="load the embedding and head in INT8 "
                   "(quantize_embedding=True; ChatGLM-6B's tied pair as one copy)")
    p.add_argument("--max-kernel-rows", type=int, help="set QuantizedLinear.max_kernel_rows")
    p.add_argument("--train-dtype", choices=TRAIN_DTYPES, default="bfloat16",
                   help="train: the float weights' and the compute's dtype (default %(default)s)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.kind == "bandwidth":
        print(copy_bandwidth())
        return
    if args.max_kernel_rows is not None:
        from chatglm_tune.quant.modules import QuantizedLinear

        QuantizedLinear.max_kernel_rows = args.max_kernel_rows
    if args.frame is None or args.model_dir is None:
        p.error(f"{args.kind} needs --model-dir and --frame")
    result = child_infer(args) if args.kind == "infer" else child_train(args)
    result["max_kernel_rows"] = args.max_kernel_rows
    print(json.dumps(result))


if __name__ == "__main__":
    main()
