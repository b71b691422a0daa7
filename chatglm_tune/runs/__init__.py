"""Models and training runs as directories: `loading` (a model from what a directory names: base, P-tuning prefix or
LoRA adapter, quantization, the run's prompt settings; `chatglm_tune.from_pretrained`), `rundir` (a run directory:
what it holds, atomic publishing, --resume checks), `lora` (LoRA through peft: apply, load, merge) and `auto`
(registration with transformers' Auto classes). An upper room: it imports `models/` (the registry) and the shared
rooms, never `tuning`, `evaluation` or a command line."""
