"""The trainer on top of the engine: data, optimizer, LoRA, checkpoints, progress."""
