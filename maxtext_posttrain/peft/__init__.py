"""LoRA / QLoRA (qwix) wiring for the generic loop, and adapter export into a plain MaxText checkpoint."""
