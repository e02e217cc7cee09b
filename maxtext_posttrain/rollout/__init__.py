"""Rollouts with MaxText's own decode path (prefill + autoregressive over the KV cache)."""

from maxtext_posttrain.rollout.sampler import PendingRollouts, Rollouts, Sampler, SamplingParams

__all__ = ["PendingRollouts", "Rollouts", "Sampler", "SamplingParams"]
