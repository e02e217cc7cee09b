"""maxtext_posttrain: post-training objectives (SFT, preference tuning, RL, distillation) as a MaxText plugin."""
