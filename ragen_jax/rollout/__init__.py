"""Rollouts: the KV-cache sampler, the context manager, scripted policies and the multi-turn
agent loop."""

from ragen_jax.rollout.agent import (
    AgentRollout,
    Policy,
    collect,
    train_seeds,
    val_seeds,
)
from ragen_jax.rollout.batch import RolloutBatch
from ragen_jax.rollout.config import RolloutConfig
from ragen_jax.rollout.context import ChatFormat, ContextConfig, parse_response
from ragen_jax.rollout.env_driver import env_functions
from ragen_jax.rollout.sampler import Sampler, bucket_length
from ragen_jax.rollout.sampling import SampleOutput, SamplingParams
from ragen_jax.rollout.scripted import RandomActionPolicy, ScriptedPolicy

__all__ = [
    "AgentRollout",
    "ChatFormat",
    "ContextConfig",
    "Policy",
    "RandomActionPolicy",
    "RolloutBatch",
    "RolloutConfig",
    "SampleOutput",
    "Sampler",
    "SamplingParams",
    "ScriptedPolicy",
    "bucket_length",
    "collect",
    "env_functions",
    "parse_response",
    "train_seeds",
    "val_seeds",
]
