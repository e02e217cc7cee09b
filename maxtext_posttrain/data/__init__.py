"""Post-training data: bundled arithmetic problems (TFDS builder), record sources and the SFT input pipeline."""
