"""Rollout filtering: hand-built cases and a plain-Python port of RAGEN's selection loop."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ragen_jax.starpo.filtering import FilterConfig, filter_groups, select_groups


def reference_select(scores: list[float], c: FilterConfig) -> set[int]:
    """RAGEN's ``_select_top_groups`` as plain Python (ties broken by index)."""
    idx = list(range(len(scores)))
    if not c.include_zero:
        idx = [i for i in idx if abs(scores[i]) > 1e-10]
        if not idx:
            return set()
    s = {i: scores[i] for i in idx}
    largest = c.filter_type == "largest"
    by_best = sorted(idx, key=lambda i: (-s[i] if largest else s[i], i))
    if c.strategy == "top_p":
        if c.value >= 1:
            return set(idx)
        if c.top_p_prob_mode == "softmax":
            logits = [s[i] if largest else -s[i] for i in by_best]
            m = max(logits)
            z = sum(math.exp(x - m) for x in logits)
            cum, k = 0.0, 0
            for x in logits:
                cum += math.exp(x - m) / z
                if cum >= c.value:
                    break
                k += 1
            return set(by_best[:min(k + 1, len(idx))])
        threshold = c.value * sum(s.values()) - c.selection_eps
        total, chosen = 0.0, []
        for i in by_best:
            if total >= threshold or s[i] <= 0:
                break
            total += s[i]
            chosen.append(i)
        return set(chosen) if total >= threshold else set()
    if c.strategy in ("top_k", "top_k_abs"):
        k = int(c.value * len(scores)) if c.strategy == "top_k" else int(c.value)
        return set(by_best[:max(min(k, len(idx)), 1)])
    f32 = np.float32  # RAGEN computes these thresholds in float32 torch
    if largest:
        top = f32(max(s.values()))
        return {i for i in idx if f32(s[i]) >= top * f32(c.value) - f32(1e-10)}
    low = f32(min(s.values()))
    return {i for i in idx if f32(s[i]) <= low / (f32(c.value) + f32(1e-10)) + f32(1e-10)}


def kept(scores, **kw) -> set[int]:
    keep = select_groups(jnp.asarray(scores, jnp.float32), FilterConfig(**kw))
    return set(np.flatnonzero(np.asarray(keep)).tolist())


def test_hand_cases():
    s = [0.0, 3.0, 1.0, 2.0, 0.5]
    assert kept(s) == {0, 1, 2, 3, 4}  # RAGEN default keeps all
    assert kept(s, include_zero=False) == {1, 2, 3, 4}
    assert kept(s, strategy="top_k", value=0.25) == {1}  # int(0.25 * 5) = 1
    assert kept(s, strategy="top_k", value=0.5) == {1, 3}
    assert kept(s, strategy="top_k", value=0.1) == {1}  # at least one group
    assert kept(s, strategy="top_k", value=0.4, filter_type="smallest") == {0, 4}
    assert kept(s, strategy="top_k_abs", value=3) == {1, 3, 2}
    # linear top_p: total 6.5, threshold 0.5 * 6.5 - 0.01 = 3.24: 3.0 < 3.24, 3.0 + 2.0 >= 3.24.
    assert kept(s, value=0.5) == {1, 3}
    assert kept(s, value=0.46) == {1}  # threshold 2.98 reached by 3.0 alone
    assert kept([0.0, 0.0], value=0.5) == set()  # threshold unreachable: nothing kept
    assert kept(s, strategy="min_p", value=0.5) == {1, 3}  # >= 1.5
    # softmax top_p over [0, 3, 1, 2, .5]: p(3) = 0.61 < 0.9, + p(2) = 0.84 < 0.9, + p(1) -> 0.92
    assert kept(s, value=0.9, top_p_prob_mode="softmax") == {1, 3, 2}


@settings(max_examples=60, deadline=None)
@given(scores=st.lists(st.floats(-2, 5, allow_nan=False).map(lambda x: round(x, 2)), min_size=1, max_size=9),
       strategy=st.sampled_from(["top_p", "top_k", "top_k_abs", "min_p"]),
       value=st.sampled_from([0.1, 0.25, 0.5, 0.75, 0.9, 1.0, 2.0]),
       filter_type=st.sampled_from(["largest", "smallest"]),
       include_zero=st.booleans(), mode=st.sampled_from(["linear", "softmax"]))
def test_matches_ragen_reference(scores, strategy, value, filter_type, include_zero, mode):
    if strategy == "min_p" and filter_type == "smallest":
        scores = [abs(x) for x in scores]  # RAGEN's "smallest" min_p assumes scores >= 0
    if len(set(scores)) < len(scores) and strategy != "min_p":
        scores = [x + 1e-3 * i for i, x in enumerate(scores)]  # tie order is unspecified
    c = FilterConfig(strategy=strategy, value=value, filter_type=filter_type,
                     include_zero=include_zero, top_p_prob_mode=mode)
    scores32 = [float(np.float32(x)) for x in scores]
    assert kept(scores32, strategy=strategy, value=value, filter_type=filter_type,
                include_zero=include_zero, top_p_prob_mode=mode) == reference_select(scores32, c)


def test_filter_groups_weights_and_metrics():
    scores = jnp.array([[1.0, 1.0, 1.0], [0.0, 1.0, 2.0], [0.0, 0.0, 4.0], [2.0, 2.0, 2.0]])
    keep, weights, m = filter_groups(scores, FilterConfig(strategy="top_k", value=0.5, loss_scaling="sqrt"))
    np.testing.assert_array_equal(np.asarray(keep), [False, True, True, False])
    np.testing.assert_allclose(np.asarray(weights), [0] * 3 + [math.sqrt(0.5)] * 6 + [0] * 3, rtol=1e-6)
    assert float(m["rollout/filter_kept_ratio"]) == 0.5
    assert float(m["rollout/filter_zero_count"]) == 2.0
    std = np.std([[0, 1, 2], [0, 0, 4]], axis=1, ddof=1)
    assert float(m["rollout/chosen_in_group_reward_std"]) == pytest.approx(std.mean(), rel=1e-6)
    _, _, m = filter_groups(scores[jnp.array([0, 3])], FilterConfig(include_zero=False))
    assert float(m["rollout/empty_after_filter"]) == 1.0


def test_bad_config_names_the_field():
    with pytest.raises(ValueError, match="filter.strategy"):
        FilterConfig(strategy="best")


def test_entropy_metrics_hand_values():
    scores = jnp.zeros((3, 2))  # no reward signal: only the entropies decide
    entropies = jnp.array([[1.0, 3.0], [2.0, 2.0], [0.5, 0.5]])
    # "entropy": the group mean (2, 2, 0.5); "entropy_variance": the unbiased std (sqrt 2, 0, 0).
    keep, _, m = filter_groups(scores, FilterConfig(strategy="top_k_abs", value=1, metric="entropy_variance"),
                               entropies=entropies)
    assert np.asarray(keep).tolist() == [True, False, False]
    assert float(m["rollout/in_group_entropy_std"]) == pytest.approx(math.sqrt(2) / 3, abs=1e-6)
    assert float(m["rollout/chosen_in_group_entropy_std"]) == pytest.approx(math.sqrt(2), abs=1e-6)
    assert float(m["rollout/in_group_entropy_mean"]) == pytest.approx(4.5 / 3, abs=1e-6)
    assert float(m["rollout/in_group_entropy_max"]) == pytest.approx(5.5 / 3, abs=1e-6)
    keep, _, m = filter_groups(scores, FilterConfig(strategy="top_k_abs", value=1, metric="entropy",
                                                    filter_type="smallest"), entropies=entropies)
    assert np.asarray(keep).tolist() == [False, False, True]
    assert float(m["rollout/chosen_in_group_entropy_mean"]) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="needs entropies"):
        filter_groups(scores, FilterConfig(metric="entropy"))


def test_trajectory_entropies_are_the_masked_mean_of_token_entropies():
    from flax import nnx

    from ragen_jax.models import Qwen2ForCausalLM, QwenConfig
    from ragen_jax.starpo.filtering import trajectory_entropies
    from ragen_jax.starpo.token_scores import token_logprobs

    model = Qwen2ForCausalLM(QwenConfig.tiny(vocab_size=64, hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=2, num_attention_heads=4,
                                             num_key_value_heads=2, head_dim=8), rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    b, length = 5, 12
    ids = rng.integers(0, 64, (b, length)).astype(np.int32)
    attn = np.arange(length)[None] < rng.integers(6, length + 1, b)[:, None]
    pos = np.broadcast_to(np.arange(length, dtype=np.int32), (b, length))
    loss = attn & (rng.random((b, length)) < 0.5) & (np.arange(length) > 0)
    loss[3] = False  # a row that sampled nothing gets 0
    got = trajectory_entropies(model, ids, attn, pos, loss, 0.7, rows_per_pass=2)  # 3 passes, padded
    _, ent = token_logprobs(model, jnp.asarray(ids), jnp.asarray(attn), jnp.asarray(pos), 0.7)
    ent = np.asarray(ent)
    expected = [ent[i][loss[i]].mean() if loss[i].any() else 0.0 for i in range(b)]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    assert got[3] == 0.0
