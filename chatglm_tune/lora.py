"""LoRA through peft: options, applying an adapter, loading one, merging it back.

Adapters are plain peft directories (`adapter_config.json` + `adapter_model.safetensors`) that
`peft.PeftModel.from_pretrained(base, dir)` loads. On an INT8/INT4 base (`QuantizedLinear` layers) the
adapter runs beside the frozen integer weights; peft is told how to wrap those layers here.
Reference: peft `tuners/lora`; litgpt `lora.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora.layer import Linear as LoraLinear
from torch import nn


@dataclass(frozen=True)
class LoraOptions:
    """LoRA hyper-parameters (the one place for their defaults; train.py reads them from here)."""

    r: int = 8
    alpha: int = 32
    dropout: float = 0.1
    target: tuple[str, ...] = ("query_key_value",)

    def peft_config(self) -> LoraConfig:
        config = LoraConfig(
            task_type="CAUSAL_LM", r=self.r, lora_alpha=self.alpha, lora_dropout=self.dropout,
            target_modules=list(self.target),
        )
        from .quantization import QuantizedLinear

        # peft wraps nn.Linear by itself; our integer layers expose in/out_features and take the same wrapper.
        config._register_custom_module({QuantizedLinear: LoraLinear})
        return config


def apply_lora(model: nn.Module, options: LoraOptions = LoraOptions()) -> PeftModel:
    """Freeze `model` and add trainable LoRA adapters on `options.target` Linears."""
    return get_peft_model(model, options.peft_config())


def load_lora(model: nn.Module, adapter_dir, *, trainable: bool = False) -> PeftModel:
    """Attach a saved adapter to `model` (frozen unless `trainable`)."""
    from .quantization import QuantizedLinear

    config = LoraConfig.from_pretrained(adapter_dir)
    config._register_custom_module({QuantizedLinear: LoraLinear})
    return PeftModel.from_pretrained(model, adapter_dir, config=config, is_trainable=trainable)


def merge_lora(model: PeftModel) -> nn.Module:
    """Fold the adapter into the base weights and return the plain base model.

    A quantized base cannot absorb a float update: merge on the half/float model, then quantize.
    """
    from .quantization import QuantizedLinear

    if any(isinstance(m, QuantizedLinear) for m in model.modules()):
        raise ValueError("cannot merge LoRA into INT8/INT4 weights: merge on the float model, then run quantize.py")
    return model.merge_and_unload()
