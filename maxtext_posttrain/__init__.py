"""maxtext_posttrain: post-training objectives (SFT, preference tuning, RL, distillation) as a MaxText plugin."""

import os

# MaxText imports transformers on its training path for model configs only (no PyTorch models), and transformers
# then prints advice about the missing PyTorch and RoPE-config warnings on every start. Quiet them through
# transformers' own switches unless the user set them; set TRANSFORMERS_VERBOSITY=warning to see them again.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
