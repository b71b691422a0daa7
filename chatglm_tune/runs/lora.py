"""LoRA through peft: options, applying an adapter, loading one, merging it back.

Adapters are plain peft directories (`adapter_config.json` + `adapter_model.safetensors`) that
`peft.PeftModel.from_pretrained(base, dir)` loads. On an INT8/INT4 base (`QuantizedLinear` layers) the
adapter runs beside the frozen integer weights; peft is told how to wrap those layers here.
`load_lora` also takes an adapter trained with peft on the official ChatGLM2/3 or GLM-4 code (fused
`query_key_value`, `dense`, `dense_h_to_4h`, `dense_4h_to_h`): it is converted on the way to the
equivalent adapter on q/k/v, o_proj, gate_up_proj, down_proj (the mapping: models/glm/weights.py).
Reference: peft `tuners/lora`; litgpt `lora.py`.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from pathlib import Path

from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from peft.tuners.lora.layer import Linear as LoraLinear
from torch import nn
from transformers import GlmConfig

from chatglm_tune.models.glm.weights import adapter_targets, adapter_to_transformers, is_official_adapter, qkv_rows
from chatglm_tune.options import LoraOptions
from chatglm_tune.quant.modules import QuantizedLinear
from chatglm_tune.runtime.checkpoint import CheckpointError, iter_tensors, open_safetensors

ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")  # peft's names, in its order of preference


EXPERT_WEIGHTS = "experts."  # a target naming routed experts' 3D weights (`experts.gate_up_proj`, `experts.down_proj`)


def peft_config(options: LoraOptions) -> LoraConfig:
    """peft's LoraConfig for `options`, told to wrap our integer `QuantizedLinear` layers too. Targets under
    `experts.` are the routed experts' fused 3D weights (`mlp.experts.gate_up_proj` [E, 2I, H], `down_proj`): peft's
    `target_parameters`, an adapter per expert; every other target names Linears."""
    modules = [t for t in options.target if not t.startswith(EXPERT_WEIGHTS)]
    weights = [t for t in options.target if t.startswith(EXPERT_WEIGHTS)]
    if weights and not modules:
        raise ValueError(f"--lora-target {' '.join(weights)}: name the Linears too (e.g. q_proj k_proj v_proj); "
                         "expert weights alone give peft no module to wrap")
    if weights and options.dropout:
        raise ValueError(f"--lora-target {' '.join(weights)}: peft's adapters on 3D weights take no dropout; pass "
                         f"--lora-dropout 0 (it is {options.dropout})")
    config = LoraConfig(
        task_type="CAUSAL_LM", r=options.r, lora_alpha=options.alpha, lora_dropout=options.dropout,
        target_modules=modules, target_parameters=weights or None,
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


def apply_lora(model: nn.Module, options: LoraOptions = LoraOptions(), *, title: str = "the") -> PeftModel:
    """Freeze `model` and add trainable LoRA adapters on `options.target` Linears (which must be given, and each
    match something: `check_targets`; `title` names the model's version there)."""
    check_targets(model, options.target, title)
    with _quiet_peft():
        return get_peft_model(model, peft_config(options))


def check_targets(model: nn.Module, targets, title: str = "the") -> None:
    """ValueError naming each of `targets` that matches nothing in `model` as peft matches them (a module's name, or
    under `experts.` a weight's, or the end of one after a dot), and listing the names that do: the leaf names of its
    Linears and its routed experts' 3D weights. peft itself refuses only targets of which none matches: one beside
    others that match would train nothing, with at most a warning."""
    modules = [name for name, _ in model.named_modules()]
    weights = [name for name, _ in model.named_parameters()]
    missing = [t for t in targets if not any(name == t or name.endswith("." + t)
                                             for name in (weights if t.startswith(EXPERT_WEIGHTS) else modules))]
    if not missing:
        return
    linears = dict.fromkeys(name.rpartition(".")[2] for name, module in model.named_modules()
                            if isinstance(module, (nn.Linear, QuantizedLinear)))
    experts = dict.fromkeys(EXPERT_WEIGHTS + name.rpartition(".")[2] for name, weight in model.named_parameters()
                            if weight.dim() == 3 and name.rpartition(".")[0].endswith(EXPERT_WEIGHTS.rstrip(".")))
    raise ValueError(f"--lora-target {' '.join(missing)}: match{'es' * (len(missing) == 1)} nothing in {title} model; "
                     f"its targets are the Linears {' '.join(linears)}"
                     + (f" and the routed experts' weights {' '.join(experts)}" if experts else ""))


def load_lora(model: nn.Module, adapter_dir, *, trainable: bool = False) -> PeftModel:
    """Attach a saved adapter to `model` (frozen unless `trainable`).

    An adapter of the official ChatGLM2/3 / GLM-4 modules (keys `base_model.model.transformer.encoder...`)
    is converted on the way (`_load_official`); a shape that does not fit raises `CheckpointError`
    naming the file and key.
    """
    config = LoraConfig.from_pretrained(adapter_dir)
    config._register_custom_module({QuantizedLinear: LoraLinear})
    file = adapter_weights(adapter_dir)
    if is_official_adapter(_keys(file)):
        return _load_official(model, file, config, trainable)
    with _quiet_peft():
        return PeftModel.from_pretrained(model, adapter_dir, config=config, is_trainable=trainable)


def adapter_weights(adapter_dir) -> Path:
    """The weight file of a peft adapter directory: `adapter_model.safetensors`, else `adapter_model.bin`."""
    for name in ADAPTER_WEIGHTS:
        if (Path(adapter_dir) / name).is_file():
            return Path(adapter_dir) / name
    raise CheckpointError(f"{adapter_dir}: no adapter weights ({' or '.join(ADAPTER_WEIGHTS)})")


def _keys(file: Path) -> list[str]:
    if file.suffix == ".safetensors":  # the header only
        with open_safetensors(file) as f:
            return list(f.keys())
    return [key for key, _ in iter_tensors(file)]  # weights-only, memory-mapped: nothing is read yet


def _load_official(model: nn.Module, file: Path, config: LoraConfig, trainable: bool) -> PeftModel:
    """`model` (a ChatGLM2/3 / GLM-4 `GlmForCausalLM`) with the official-layout adapter in `file`, held as
    the equivalent adapter on its own modules (same r and lora_alpha: the same scaling)."""
    if not isinstance(model.config, GlmConfig):
        raise CheckpointError(f"{file}: an adapter of the official ChatGLM2/3 / GLM-4 modules "
                              "(transformer.encoder...), and the model is not a ChatGLM2/3 / GLM-4 "
                              f"({type(model.config).__name__})")
    if config.use_dora or config.modules_to_save or config.rank_pattern or config.alpha_pattern:
        raise CheckpointError(f"{file.parent / 'adapter_config.json'}: DoRA, modules_to_save, rank_pattern and "
                              "alpha_pattern are not supported on an official-layout adapter")
    config = copy.copy(config)
    try:
        config.target_modules = set(adapter_targets(config.target_modules))
    except ValueError as e:
        raise CheckpointError(f"{file.parent / 'adapter_config.json'}: {e}") from e
    config.inference_mode, config.base_model_name_or_path = not trainable, None  # the base is `model`
    state = _converted(file, qkv_rows(model.config))
    with _quiet_peft():
        peft_model = get_peft_model(model, config)
    _check_fits(peft_model, state, file)
    set_peft_model_state_dict(peft_model, {key: tensor for key, (_, tensor) in state.items()})
    return peft_model if trainable else peft_model.eval()


def _converted(file: Path, rows) -> dict:
    """{transformers adapter key: (official key, tensor)} of an official-layout adapter file."""
    state = {}
    for key, tensor in iter_tensors(file):
        try:
            pairs = adapter_to_transformers(key, tensor, rows)
        except ValueError as e:  # a fused lora_B whose rows are not this model's q | k | v
            raise CheckpointError(f"{file}: {key} has shape {list(tensor.shape)}, whose rows are not this model's "
                                  f"q | k | v rows {list(rows)}: the adapter was trained on another model") from e
        if pairs is None:
            raise CheckpointError(f"{file}: unexpected key {key} (not a LoRA weight of a ChatGLM2/3 / GLM-4 module)")
        state.update((name, (key, part)) for name, part in pairs)
    return state


def _check_fits(peft_model: PeftModel, state: dict, file: Path) -> None:
    """CheckpointError naming the file and key of the first converted tensor the injected adapter has no
    place for, or the wrong shape for, and naming the adapter weights the file lacks."""
    expected = get_peft_model_state_dict(peft_model, save_embedding_layers=False)  # adapter weights only
    for key, (origin, tensor) in state.items():
        if key not in expected:
            raise CheckpointError(f"{file}: unexpected key {origin} (its module is not among target_modules)")
        if tensor.shape != expected[key].shape:
            raise CheckpointError(f"{file}: {origin} has shape {list(tensor.shape)}, this model expects "
                                  f"{list(expected[key].shape)} ({key}): the adapter was trained on another model")
    missing = [key for key in expected if key not in state]
    if missing:
        shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        raise CheckpointError(f"{file}: missing adapter weights for {shown}")


def merge_lora(model: PeftModel) -> nn.Module:
    """Fold the adapter into the base weights and return the plain base model.

    A quantized base cannot absorb a float update: merge on the half/float model, then quantize.
    """
    if any(isinstance(m, QuantizedLinear) for m in model.modules()):
        raise ValueError("cannot merge LoRA into INT8/INT4 weights: merge on the float model, then run quantize.py")
    return model.merge_and_unload()
