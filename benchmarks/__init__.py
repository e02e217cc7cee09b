"""Side-by-side measurements against MaxText's own pretraining step (`python -m benchmarks.<name>`)."""
