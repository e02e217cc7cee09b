"""The bundled tokenizer is what scripts/build_tokenizer.py builds, and MaxText's tokenizer code loads it."""

import os
import subprocess
import sys

from maxtext.input_pipeline import input_pipeline_utils
from tests import paths

ASSET = paths.REPO / "maxtext_posttrain" / "assets" / "arithmetic.model"


def test_rebuild_reproduces_the_bundled_model_byte_for_byte(tmp_path):
  output = tmp_path / "arithmetic.model"
  completed = subprocess.run(
      [sys.executable, str(paths.REPO / "scripts" / "build_tokenizer.py"), f"--output={output}"],
      env=dict(os.environ, PYTHONPATH=str(paths.REPO)),
      capture_output=True,
      text=True,
      timeout=300,
      check=False,
  )
  assert completed.returncode == 0, completed.stderr[-3000:]
  assert output.read_bytes() == ASSET.read_bytes()


def test_maxtext_loads_it_with_single_digit_pieces_and_newlines():
  tokenizer = input_pipeline_utils.get_tokenizer(str(ASSET), "sentencepiece", add_bos=False, add_eos=False)
  text = "12 + 345 = 357\n#### 357"
  ids = tokenizer.encode(text)
  assert tokenizer.decode(ids) == text
  pieces = [tokenizer.decode([i]) for i in ids]
  assert all(len(p) == 1 for p in pieces if p.strip().isdigit())
  assert (tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id) == (0, 2, 3)
