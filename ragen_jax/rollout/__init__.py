"""Rollouts: the KV-cache sampler (and, later, the multi-turn agent loop)."""

from ragen_jax.rollout.sampler import SampleOutput, Sampler, SamplingParams, bucket_length

__all__ = ["SampleOutput", "Sampler", "SamplingParams", "bucket_length"]
