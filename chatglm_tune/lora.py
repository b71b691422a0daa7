"""LoRA through peft: options, applying an adapter, loading one, merging it back.

Adapters are plain peft directories (`adapter_config.json` + `adapter_model.safetensors`) that
`peft.PeftModel.from_pretrained(base, dir)` loads. On an INT8/INT4 base (`QuantizedLinear` layers) the
adapter runs beside the frozen integer weights; peft is told how to wrap those layers here.
Reference: peft `tuners/lora`; litgpt `lora.py`.
"""

from __future__ import annotations

import contextlib
import warnings

from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora.layer import Linear as LoraLinear
from torch import nn

from .options import LoraOptions
from .quantization import QuantizedLinear


def peft_config(options: LoraOptions) -> LoraConfig:
    """peft's LoraConfig for `options`, told to wrap our integer `QuantizedLinear` layers too."""
    config = LoraConfig(
        task_type="CAUSAL_LM", r=options.r, lora_alpha=options.alpha, lora_dropout=options.dropout,
        target_modules=list(options.target),
    )
    # peft wraps nn.Linear by itself; our integer layers expose in/out_features and take the same wrapper.
    config._register_custom_module({QuantizedLinear: LoraLinear})
    return config


@contextlib.contextmanager
def _quiet_peft():
    """Silence what peft says that is not the user's business: its warning on our registered
    `QuantizedLinear` (it warns on every custom layer, registered or not) and transformers' deprecation
    of the `is_gradient_checkpointing` attribute that peft still reads."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Unsupported layer type .*QuantizedLinear", category=UserWarning)
        warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


def apply_lora(model: nn.Module, options: LoraOptions = LoraOptions()) -> PeftModel:
    """Freeze `model` and add trainable LoRA adapters on `options.target` Linears (which must be given)."""
    with _quiet_peft():
        return get_peft_model(model, peft_config(options))


def load_lora(model: nn.Module, adapter_dir, *, trainable: bool = False) -> PeftModel:
    """Attach a saved adapter to `model` (frozen unless `trainable`)."""
    config = LoraConfig.from_pretrained(adapter_dir)
    config._register_custom_module({QuantizedLinear: LoraLinear})
    with _quiet_peft():
        return PeftModel.from_pretrained(model, adapter_dir, config=config, is_trainable=trainable)


def merge_lora(model: PeftModel) -> nn.Module:
    """Fold the adapter into the base weights and return the plain base model.

    A quantized base cannot absorb a float update: merge on the half/float model, then quantize.
    """
    if any(isinstance(m, QuantizedLinear) for m in model.modules()):
        raise ValueError("cannot merge LoRA into INT8/INT4 weights: merge on the float model, then run quantize.py")
    return model.merge_and_unload()
