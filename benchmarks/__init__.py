"""Side-by-side measurements against MaxText's own pretraining step (`python -m benchmarks.<name>`)."""

# Imported before any benchmark module imports MaxText, so the package's quiet defaults for transformers' start-up
# advice apply here as they do to the package's own commands.
import maxtext_posttrain  # pylint: disable=unused-import
