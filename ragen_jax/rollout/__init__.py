"""Rollouts: the KV-cache sampler, the context manager and the multi-turn agent loop."""

from ragen_jax.rollout.agent import (
    AgentRollout,
    RolloutBatch,
    RolloutConfig,
    ScriptedPolicy,
    collect,
    train_seeds,
    val_seeds,
)
from ragen_jax.rollout.context import ChatFormat, ContextConfig, parse_response
from ragen_jax.rollout.sampler import SampleOutput, Sampler, SamplingParams, bucket_length

__all__ = [
    "AgentRollout",
    "ChatFormat",
    "ContextConfig",
    "RolloutBatch",
    "RolloutConfig",
    "SampleOutput",
    "Sampler",
    "SamplingParams",
    "ScriptedPolicy",
    "bucket_length",
    "collect",
    "parse_response",
    "train_seeds",
    "val_seeds",
]
