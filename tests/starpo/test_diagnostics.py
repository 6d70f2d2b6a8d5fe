"""Collapse diagnostics on constructed score matrices with known answers, and the scorer."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ragen_jax.models import Qwen2ForCausalLM, QwenConfig
from ragen_jax.starpo.diagnostics import collapse_metrics, cross_scores
from ragen_jax.starpo.update import token_logprobs


def test_input_blind_reasoning_has_zero_mi_and_chance_retrieval():
    rng = np.random.default_rng(0)
    n = 8
    per_z = rng.normal(size=(16, 1))  # the score of z does not depend on x at all
    m = collapse_metrics(np.repeat(per_z, n, axis=1), rng.integers(0, n, 16))
    assert m["mi_estimate"] == pytest.approx(0.0, abs=1e-6)
    assert m["retrieval_acc@1"] == pytest.approx(1 / n)
    assert m["retrieval_acc@4"] == pytest.approx(m["retrieval_chance@4"])
    assert m["conditional_entropy_est"] == pytest.approx(m["reasoning_entropy_est"], abs=1e-6)
    assert m["mi_zscore"] == pytest.approx(0.0, abs=1e-4)


def test_input_copying_reasoning_has_mi_near_log_n_and_perfect_retrieval():
    n = 8
    scores = np.full((n, n), -20.0)
    np.fill_diagonal(scores, 0.0)
    m = collapse_metrics(scores, np.arange(n))
    assert m["mi_estimate"] == pytest.approx(math.log(n), abs=1e-6)
    assert m["mi_upper_bound"] == pytest.approx(math.log(n))
    assert m["retrieval_acc@1"] == 1.0 and m["retrieval_margin@1"] == pytest.approx(1 - 1 / n)
    assert m["mi_zscore"] > 1.0


def test_identical_prompts_count_as_correct_and_order_does_not_matter():
    rng = np.random.default_rng(1)
    scores = rng.normal(size=(6, 4))
    truth = np.array([0, 1, 2, 3, 0, 1])
    labels = np.array([0, 1, 1, 2])  # columns 1 and 2 are the same prompt
    m = collapse_metrics(scores, truth, labels)
    rows, cols = rng.permutation(6), rng.permutation(4)
    inverse = np.argsort(cols)
    m2 = collapse_metrics(scores[rows][:, cols], inverse[truth[rows]], labels[cols])
    for k, v in m.items():
        assert m2[k] == pytest.approx(v, abs=1e-6), k
    copy = np.full((2, 4), -9.0)
    copy[0, 2] = 0.0  # z0's true prompt is column 1, an identical prompt sits in column 2
    copy[1, 3] = 0.0
    assert collapse_metrics(copy, np.array([1, 3]), labels)["retrieval_acc@1"] == 1.0


def test_cross_scores_equal_separate_teacher_forcing():
    cfg = QwenConfig.tiny(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    model = Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(0))
    inputs = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    reasonings = [[10, 11], [12, 13, 14]]
    mean, total = cross_scores(model, inputs, reasonings)
    assert mean.shape == (2, 3)
    for i, z in enumerate(reasonings):
        for j, x in enumerate(inputs):
            seq = jnp.asarray([x + z], jnp.int32)
            logp, _ = token_logprobs(model, seq, jnp.ones_like(seq, bool), jnp.arange(seq.shape[1])[None])
            expected = float(logp[0, len(x):].sum())
            assert float(total[i, j]) == pytest.approx(expected, abs=1e-4)
            assert float(mean[i, j]) == pytest.approx(expected / len(z), abs=1e-4)


def test_first_turn_pairs_from_a_batch_layout():
    from ragen_jax.starpo.diagnostics import first_turn_pairs

    # 3 episodes, groups [0, 0, 1]; prompt tokens, then turn-1 response (mask 1), then turn 2.
    ids = np.array([[5, 6, 7, 1, 2, 9, 3, 0],
                    [5, 6, 7, 4, 9, 8, 3, 0],
                    [5, 8, 7, 2, 9, 1, 0, 0]], np.int32)
    mask = np.array([[0, 0, 0, 1, 1, 0, 1, 0],
                     [0, 0, 0, 1, 0, 0, 1, 0],
                     [0, 0, 0, 1, 1, 1, 0, 0]], bool)
    turns = np.array([[1, 1, 1, 1, 1, 2, 2, 0],
                      [1, 1, 1, 1, 2, 2, 2, 0],
                      [1, 1, 1, 1, 1, 1, 0, 0]], np.int16)
    inputs, zs, col = first_turn_pairs(ids, mask, turns, np.array([0, 0, 1]), 8, np.random.default_rng(0))
    assert inputs == [[5, 6, 7], [5, 8, 7]]
    assert zs == [[1, 2], [4], [2, 9, 1]]
    assert col.tolist() == [0, 0, 1]
    inputs, zs, col = first_turn_pairs(ids, mask, turns, np.array([0, 0, 1]), 2, np.random.default_rng(0))
    assert len(zs) == 2 and len(set(map(tuple, zs))) == 2
