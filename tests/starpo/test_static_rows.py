"""The update's row count as a high-water mark: a step that keeps fewer rows than the update
was compiled for trains on its own rows alone, exactly as an update of that many rows would,
the rest padding that no loss, advantage, optimizer step or metric sees, and in the same
compiled program whatever the count."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ragen_jax.compilation import CompileWatch
from ragen_jax.starpo.optimizer_step import interleave
from ragen_jax.starpo.rows import arrange_rows, static_positions
from ragen_jax.starpo.update import make_update
from tests.starpo.test_update import B, build, copy, make_batch
from tests.starpo.test_update import settings as step_settings


@settings(max_examples=60, deadline=None)
@given(mini=st.integers(1, 5), live=st.integers(1, 6), extra=st.integers(0, 6))
def test_static_positions_keep_the_live_mini_batches_and_put_padding_last(mini, live, extra):
    """Arranged into ``static`` rows, the update's mini-batches (``interleave``) are the live
    rows' own mini-batches, row for row, then mini-batches of padding only."""
    n, m = live, live + extra  # mini-batches
    rows = np.arange(n * mini)
    where = static_positions(n * mini, m * mini, mini)
    assert len(set(where.tolist())) == where.size and where.max() < m * mini
    arranged = np.full(m * mini, -1)
    arranged[where] = rows
    parts = interleave(arranged, m)  # [m, mini]
    np.testing.assert_array_equal(parts[:n], interleave(rows, n))
    assert (parts[n:] == -1).all()


def _numpy(batch):
    return jax.tree.map(np.asarray, batch)


@pytest.mark.parametrize("case", [
    dict(estimator="grpo", recompute=True, reference="frozen_copy"),
    dict(estimator="gae", critic=True),
], ids=["grpo-recomputed-reference", "gae-critic"])
def test_padding_rows_change_nothing_and_any_live_count_shares_one_program(case):
    """Eight rows in mini-batches of two, trained as they are and arranged among 16 (8 padding
    rows, ``arrange_rows``): the same parameters, optimizer state (Adam's step count included:
    the padding mini-batches take no step) and metrics, the critic's epochs and the whole-batch
    passes (old and reference log-probs, values) included. Then four of the rows among the
    same 16: the same program, nothing compiled."""
    s = step_settings(mini=2, **case)
    model, networks, state = build(s, lora=False)
    batch = _numpy(make_batch(model))
    update = make_update(s, networks)
    alone, alone_metrics = update(copy(state), jax.tree.map(jnp.asarray, batch))
    padded = arrange_rows(batch, B, 2 * B, 2)
    assert padded.input_ids.shape[0] == 2 * B and int(padded.live_mini_batches) == B // 2
    assert (padded.group_ids == -1).sum() == B and padded.loss_mask[padded.group_ids < 0].sum() == 0
    new, metrics = update(copy(state), jax.tree.map(jnp.asarray, padded))
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(alone), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-6, rtol=1e-5)
    assert set(metrics) == set(alone_metrics)
    for key in alone_metrics:
        np.testing.assert_allclose(float(metrics[key]), float(alone_metrics[key]), atol=1e-5,
                                   rtol=1e-5, err_msg=key)
    assert float(metrics["train/num_mini_batches"]) == B // 2

    fewer = jax.tree.map(lambda x: x[:4] if np.ndim(x) else x, batch)
    watch = CompileWatch()
    few, few_metrics = update(copy(state), jax.tree.map(jnp.asarray, arrange_rows(fewer, 4, 2 * B, 2)))
    assert watch.take()["compile/count"] == 0
    assert float(few_metrics["train/num_mini_batches"]) == 2
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(few.actor))
    # the step did train on the four rows (the check can fail: padding alone changes nothing)
    assert not all(np.array_equal(a, b) for a, b in zip(
        jax.tree.leaves(few.actor), jax.tree.leaves(state.actor), strict=True))
