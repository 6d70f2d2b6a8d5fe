"""Collapse diagnostics on constructed score matrices with known answers, and the scorer."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ragen_jax.models import Qwen2ForCausalLM, QwenConfig
from ragen_jax.starpo.diagnostics import collapse_metrics, cross_scores
from ragen_jax.starpo.token_scores import token_logprobs


def test_input_blind_reasoning_has_zero_mi_and_chance_retrieval():
    rng = np.random.default_rng(0)
    n = 8
    per_z = rng.normal(size=(16, 1))  # the score of z does not depend on x at all
    m = collapse_metrics(np.repeat(per_z, n, axis=1), rng.integers(0, n, 16))
    assert m["mi_estimate"] == pytest.approx(0.0, abs=1e-6)
    assert m["retrieval_accuracy"] == pytest.approx(1 / n)
    assert m["retrieval_accuracy@4"] == pytest.approx(m["retrieval_chance_level@4"])
    assert m["conditional_entropy_est"] == pytest.approx(m["reasoning_entropy_est"], abs=1e-6)
    assert m["mi_zscore"] == pytest.approx(0.0, abs=1e-4)


def test_input_copying_reasoning_has_mi_near_log_n_and_perfect_retrieval():
    n = 8
    scores = np.full((n, n), -20.0)
    np.fill_diagonal(scores, 0.0)
    m = collapse_metrics(scores, np.arange(n))
    assert m["mi_estimate"] == pytest.approx(math.log(n), abs=1e-6)
    assert m["mi_upper_bound"] == pytest.approx(math.log(n))
    assert m["retrieval_accuracy"] == 1.0 and m["retrieval_above_chance"] == pytest.approx(1 - 1 / n)
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
    assert collapse_metrics(copy, np.array([1, 3]), labels)["retrieval_accuracy"] == 1.0


def test_ragen_names_are_per_token_means_and_seq_names_sums_with_an_ema_of_the_std():
    """RAGEN's ``mi_estimate`` etc. come from the per-token matrix, ``mi_seq_estimate`` etc.
    from the sums; ``mi_zscore_ema`` divides by an EMA of the marginal's std (hand-computed)."""
    rng = np.random.default_rng(2)
    lengths = np.array([3.0, 5.0, 2.0, 7.0])[:, None]
    sums = rng.normal(size=(4, 3)) * lengths
    truth = np.array([0, 1, 2, 0])
    m = collapse_metrics(sums / lengths, truth, seq_scores=sums, std_ema=(0.5, 2.0), ema_decay=0.9)

    def hand(matrix):
        matched = matrix[np.arange(4), truth]
        marginal = np.log(np.exp(matrix).sum(1)) - math.log(3)
        return matched, marginal, matched - marginal

    for suffix, matrix, prev in (("", sums / lengths, 0.5), ("_seq", sums, 2.0)):
        matched, marginal, gap = hand(matrix)
        ema = 0.9 * prev + 0.1 * marginal.std()
        name = "mi_seq_estimate" if suffix else "mi_estimate"
        est = "_seq_est" if suffix else "_est"
        assert m[name] == pytest.approx(gap.mean(), abs=1e-5)
        assert m[f"conditional_entropy{est}"] == pytest.approx(-matched.mean(), abs=1e-5)
        assert m[f"reasoning_entropy{est}"] == pytest.approx(-marginal.mean(), abs=1e-5)
        assert m[f"marginal_std{suffix}"] == pytest.approx(marginal.std(), abs=1e-5)
        assert m[f"mi_zscore{suffix}"] == pytest.approx((gap / (marginal.std() + 1e-3)).mean(), abs=1e-4)
        assert m[f"marginal_std_ema{suffix}"] == pytest.approx(ema, abs=1e-5)
        assert m[f"mi_zscore_ema{suffix}"] == pytest.approx((gap / (ema + 1e-3)).mean(), abs=1e-4)
    assert m["mi_estimate"] != pytest.approx(m["mi_seq_estimate"], abs=1e-3)
    first = collapse_metrics(sums / lengths, truth)  # no EMA yet: it starts at the std itself
    assert first["marginal_std_ema"] == pytest.approx(first["marginal_std"])
    assert "mi_seq_estimate" not in first


def test_cross_scores_equal_separate_teacher_forcing():
    cfg = QwenConfig.tiny(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    model = Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(0))
    inputs = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    reasonings = [[10, 11], [12, 13, 14], [15]]  # a one-token z is scored from x's last logits
    mean, total = cross_scores(model, inputs, reasonings)
    assert mean.shape == (3, 3)
    pairs = [(i, j, x + z) for i, z in enumerate(reasonings) for j, x in enumerate(inputs)]
    width = max(len(seq) for *_, seq in pairs)
    ids = np.zeros((len(pairs), width), np.int32)  # every [x | z], right-padded, in one batch
    for row, (*_, seq) in enumerate(pairs):
        ids[row, :len(seq)] = seq
    real = jnp.asarray(ids > 0)  # token 0 is not used above
    positions = jnp.broadcast_to(jnp.arange(width), ids.shape)
    logp, _ = token_logprobs(model, jnp.asarray(ids), real, positions)
    for row, (i, j, _) in enumerate(pairs):
        x, z = inputs[j], reasonings[i]
        expected = float(logp[row, len(x):len(x) + len(z)].sum())
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


def _two_turn_batch():
    """4 episodes of 2 turns; episodes 0 and 1 are identical up to turn 2's sampled tokens."""
    ids = np.array([[5, 6, 1, 2, 7, 3, 4, 0],
                    [5, 6, 1, 2, 7, 8, 0, 0],
                    [5, 9, 1, 7, 2, 2, 0, 0],
                    [5, 9, 0, 0, 0, 0, 0, 0]], np.int32)  # episode 3 sampled nothing
    mask = np.array([[0, 0, 1, 1, 0, 1, 1, 0],
                     [0, 0, 1, 1, 0, 1, 0, 0],
                     [0, 0, 1, 0, 1, 1, 0, 0],
                     [0, 0, 0, 0, 0, 0, 0, 0]], bool)
    turns = np.array([[1, 1, 1, 1, 2, 2, 2, 0],
                      [1, 1, 1, 1, 2, 2, 0, 0],
                      [1, 1, 1, 2, 2, 2, 0, 0],
                      [1, 1, 0, 0, 0, 0, 0, 0]], np.int16)
    return ids, mask, turns


def test_trajectory_uniform_pairs_slices_labels_and_determinism():
    from ragen_jax.starpo.diagnostics import trajectory_uniform_pairs

    ids, mask, turns = _two_turn_batch()
    # every possible (episode, turn) pair: X = tokens before the turn's first sampled token
    expected = {(5, 6): [1, 2], (5, 6, 1, 2, 7): [3, 4], (5, 9): [1], (5, 9, 1, 7): [2, 2]}
    expected_z = {((5, 6, 1, 2, 7), 0): [3, 4], ((5, 6, 1, 2, 7), 1): [8]}
    inputs, zs, col, labels = trajectory_uniform_pairs(ids, mask, turns, 64, np.random.default_rng(3))
    assert len(inputs) == len(zs) == 64 and col.tolist() == list(range(64))
    seen = set()
    for x, z in zip(inputs, zs, strict=True):
        assert tuple(x) in expected, x
        if tuple(x) == (5, 6, 1, 2, 7):  # episodes 0 and 1 share this X, with different Z
            assert z in (expected_z[(tuple(x), 0)], expected_z[(tuple(x), 1)])
            seen.add(tuple(z))
        else:
            assert z == expected[tuple(x)]
        assert x != [5, 9] or z == [1]
    assert seen == {(3, 4), (8,)}  # both episodes were drawn
    assert {tuple(x) for x in inputs} == set(expected)  # every turn of every episode, not 3
    for i in range(64):  # identical prompts, and only they, share a label
        for j in range(64):
            assert (labels[i] == labels[j]) == (inputs[i] == inputs[j])
    again = trajectory_uniform_pairs(ids, mask, turns, 64, np.random.default_rng(3))
    assert again[0] == inputs and again[1] == zs and again[3].tolist() == labels.tolist()
    other = trajectory_uniform_pairs(ids, mask, turns, 64, np.random.default_rng(4))
    assert other[0] != inputs
    assert trajectory_uniform_pairs(ids, np.zeros_like(mask), turns, 8, np.random.default_rng(0))[0] == []


def test_trajectory_uniform_pairs_pick_trajectory_then_turn_uniformly():
    from ragen_jax.starpo.diagnostics import trajectory_uniform_pairs

    # episode 0 has 1 turn, episode 1 has 3: trajectory-uniform gives episode 0's turn 1/2 of
    # the pairs (turn-uniform sampling would give it 1/4)
    ids = np.array([[5, 1, 0, 0, 0, 0, 0], [5, 4, 7, 2, 7, 3, 0]], np.int32)
    mask = np.array([[0, 1, 0, 0, 0, 0, 0], [0, 1, 0, 1, 0, 1, 0]], bool)
    turns = np.array([[1, 1, 0, 0, 0, 0, 0], [1, 1, 2, 2, 3, 3, 0]], np.int16)
    inputs, zs, _, labels = trajectory_uniform_pairs(ids, mask, turns, 4000, np.random.default_rng(0))
    first_episode = np.mean([x == [5] and z == [1] for x, z in zip(inputs, zs, strict=True)])
    turn1 = np.mean([x == [5] for x in inputs])
    assert 0.47 < first_episode < 0.53 and 0.63 < turn1 < 0.70  # 1/2 and 1/2 + 1/6
    assert len(set(labels.tolist())) == 3  # [5] is one prompt whichever episode it came from


def test_first_turn_validity_counts_format_errors():
    from ragen_jax.starpo.diagnostics import first_turn_validity

    trajs = [{"turns": [{"format_error": ""}, {"format_error": "no match"}]},
             {"turns": [{"format_error": "unknown action"}]},
             {"turns": [{"format_error": ""}]},
             {"turns": []}]  # never played a turn (length-truncated)
    assert first_turn_validity(trajs) == (3, 2)


def test_valid_thinking_counts_needs_parse_and_nonblank_reasoning():
    from ragen_jax.starpo.diagnostics import valid_thinking_counts

    trajs = [{"turns": [{"format_error": "", "think": "box is left"},
                        {"format_error": "", "think": "  \n"},  # blank reasoning
                        {"format_error": "tags", "think": "lost"}]},  # did not parse
             {"turns": [{"format_error": "", "think": "go up"}]},
             {"turns": [{"turn": 1}]}]  # started, never answered: not counted
    assert valid_thinking_counts(trajs) == (4, 2)


def _scoring_case():
    """A small model, 3 inputs and 2 reasonings (6 pairs), and their scores in one pass."""
    cfg = QwenConfig.tiny(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    model = Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(1))
    inputs = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    reasonings = [[10, 11], [12, 13, 14]]
    return model, inputs, reasonings, cross_scores(model, inputs, reasonings)


def test_cross_scores_micro_batches_match_one_pass():
    model, inputs, reasonings, whole = _scoring_case()
    for size in (1, 4, 100):  # 6 rows: uneven chunks are padded with filler rows
        parts = cross_scores(model, inputs, reasonings, micro_batch_size=size)
        for a, b in zip(parts, whole, strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4)


def test_cross_scores_token_bound_sets_the_micro_batch(monkeypatch):
    """``micro_batch_tokens`` caps a pass at that many cache slots (pairs x (input width 64 +
    reasoning width 16) here), whatever ``micro_batch_size`` allows; the scores do not change."""
    from ragen_jax.starpo import diagnostics

    model, inputs, reasonings, whole = _scoring_case()
    scored = diagnostics._pair_scores
    rows = []

    def spy(model, cache, first_logp, x_len, column, z_ids, z_real):
        rows.append(z_ids.shape[0])
        return scored(model, cache, first_logp, x_len, column, z_ids, z_real)

    monkeypatch.setattr(diagnostics, "_pair_scores", spy)
    for tokens, per_pass in ((160, 2), (100, 1), (10_000, 6)):  # 6 pairs of 80 slots
        rows.clear()
        parts = cross_scores(model, inputs, reasonings, micro_batch_size=128,
                             micro_batch_tokens=tokens)
        assert rows == [per_pass] * (6 // per_pass)
        for a, b in zip(parts, whole, strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4)
