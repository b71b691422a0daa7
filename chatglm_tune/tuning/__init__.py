"""Fine-tuning: `training` (the Accelerator loop: P-tuning v2, LoRA, full; evaluation on the dev records, the run
directory written, resumed) and `curves` (its loss / dev-F1 curve). The top of the upper rooms: it imports `runs`
and `evaluation`, and only the command lines import it."""
