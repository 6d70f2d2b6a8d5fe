"""Which way each outcome estimator pushes a policy on the Bandit, in expectation.

A Bernoulli policy picks the high-risk arm with probability ``p``; a group of ``n`` pulls
gets the Bandit's payoffs (``envs.bandit.EnvParams``: the high-risk arm pays 1 with
probability 0.25, the low-risk arm 0.1, so the high-risk arm is worth 2.5x as much), and an
estimator gives each pull an advantage ``A_i``. The policy gradient on the arm's logit is
``g = sum_i A_i (1[high_i] - p)``; its mean over many groups says which arm the estimator
favours, its mean over its standard deviation how many groups a step needs to see it.

    python -m experiments.studies.bandit_advantage_bias --groups 200000

Writes a markdown table to stdout (``experiments/results/bandit_advantage_bias.md``).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from ragen_jax.envs.bandit import EnvParams
from ragen_jax.starpo import advantages as adv_lib

ESTIMATORS = {
    "grpo (std-normalised)": lambda s, g, n: adv_lib.grpo(s, g, n, norm_by_std=True),
    "drgrpo (mean only)": lambda s, g, n: adv_lib.grpo(s, g, n, norm_by_std=False),
    "rloo": adv_lib.rloo,
}


def logit_gradients(key: jax.Array, p: float, groups: int, size: int, estimator) -> jax.Array:
    """``g`` of every group ``[groups]`` (module docstring)."""
    params = EnvParams()
    k_arm, k_pay = jax.random.split(key)
    high = jax.random.uniform(k_arm, (groups, size)) < p
    paid = jax.random.uniform(k_pay, (groups, size)) < params.hi_arm_prob
    scores = jnp.where(high, jnp.where(paid, params.hi_arm_score, 0.0), params.lo_arm_score)
    group_ids = jnp.repeat(jnp.arange(groups), size)
    a = estimator(scores.reshape(-1), group_ids, groups).reshape(groups, size)
    return jnp.sum(a * (high - p), axis=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--groups", type=int, default=200_000)
    ap.add_argument("--size", type=int, default=8, help="pulls per group (the presets' group_size)")
    args = ap.parse_args()
    print(f"{args.groups} groups of {args.size} pulls a cell\n")
    print("| estimator | p(high) | mean g | std g | mean / std | groups for 2 sigma |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, est in ESTIMATORS.items():
        for i, p in enumerate((0.3, 0.5, 0.7, 0.9)):
            g = logit_gradients(jax.random.key(i), p, args.groups, args.size, est)
            mean, std = float(g.mean()), float(g.std())
            need = (2 * std / abs(mean)) ** 2 if mean else float("inf")
            print(f"| {name} | {p} | {mean:+.3f} | {std:.3f} | {mean / std:+.3f} | {need:.0f} |")


if __name__ == "__main__":
    main()
