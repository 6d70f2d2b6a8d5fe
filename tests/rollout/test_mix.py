"""Several envs in one batch (``rollout.mix``): a scripted policy plays SimpleSokoban (1 group)
and FrozenLake (2 groups) together; rows, tags, seeds, padding and per-tag metrics are
checked by hand, and each env's rows equal what that env's own rollout plays."""

import dataclasses
from pathlib import Path

import jax
import numpy as np
import pytest

from ragen_jax.envs import make
from ragen_jax.rollout import ScriptedPolicy
from ragen_jax.rollout.agent import AgentRollout, train_seeds
from ragen_jax.rollout.config import PromptConfig, RolloutConfig, ValidationConfig
from ragen_jax.rollout.mix import EnvSlot, collect_train, collect_val, tag_metrics
from ragen_jax.starpo.normalization import normalize_batch

CFG = RolloutConfig(env_groups=3, group_size=2, max_turn=2, response_length=16, prompt=PromptConfig(enable_think=False), val=ValidationConfig(env_groups=3, seed=50))
ROOT = Path(__file__).resolve().parents[2]
TOKEN_FIELDS = ("input_ids", "attention_mask", "position_ids", "loss_mask", "logprobs",
                "token_rewards", "turn_ids")


@pytest.fixture(scope="module")
def slots(tok):
    sokoban = AgentRollout(*make("sokoban", dim_room=(6, 6), num_boxes=1), tok, CFG, tag="SimpleSokoban")
    lake = AgentRollout(*make("frozenlake", is_slippery=True), tok, CFG, tag="FrozenLake")
    return [EnvSlot(sokoban, groups=1, val_groups=2), EnvSlot(lake, groups=2, val_groups=1)]


def _policy(tok):
    """Every row answers Up, then Left (valid in both envs: Sokoban's Up/Left, FrozenLake's)."""
    return ScriptedPolicy.from_texts(tok, lambda row, call: ["<answer>Up</answer>",
                                                             "<answer>Left</answer>"][call % 2])


def test_one_batch_holds_every_envs_groups_in_order(slots, tok):
    key = jax.random.key(7)
    batch = collect_train(slots, _policy(tok), CFG, iteration=5, key=key)
    seeds = train_seeds(CFG, 5)  # 10015, 10016, 10017: group 0 Sokoban's, 1-2 FrozenLake's
    np.testing.assert_array_equal(batch.tag_ids, [0, 0, 1, 1, 1, 1])
    np.testing.assert_array_equal(batch.group_ids, [0, 0, 1, 1, 2, 2])
    np.testing.assert_array_equal(batch.env_ids, np.arange(6))
    np.testing.assert_array_equal(batch.seeds, np.repeat(seeds, 2))
    assert [t["tag"] for t in batch.trajectories] == ["SimpleSokoban"] * 2 + ["FrozenLake"] * 4
    assert [t["group_id"] for t in batch.trajectories] == [0, 0, 1, 1, 2, 2]
    assert [t["env_id"] for t in batch.trajectories] == list(range(6))
    # Each env's rows are what its own rollout plays on its seeds (FrozenLake slips: the same
    # env keys through the row offset), padded to the common width.
    alone = [slots[0].rollout.collect(_policy(tok), seeds[:1], key),
             slots[1].rollout.collect(_policy(tok), seeds[1:], key, row_offset=2)]
    width = max(b.input_ids.shape[1] for b in alone)
    assert batch.input_ids.shape == (6, width)
    for rows, ref in zip((slice(0, 2), slice(2, 6)), alone, strict=True):
        for name in TOKEN_FIELDS:
            got, want = getattr(batch, name)[rows], getattr(ref, name)
            np.testing.assert_array_equal(got[:, :want.shape[1]], want, err_msg=name)
            assert not got[:, want.shape[1]:].any() or name == "input_ids"
        np.testing.assert_array_equal(batch.scores[rows], ref.scores)
        assert (batch.input_ids[rows, ref.input_ids.shape[1]:] == ref.pad_id).all()
    # Metrics: each env's own, side by side; the rollout/ counters summed.
    for tag, ref in zip(("SimpleSokoban", "FrozenLake"), alone, strict=True):
        for k, v in ref.metrics.items():
            if k.startswith(tag + "/"):
                assert batch.metrics[k] == v, k
    assert batch.metrics["rollout/num_trajectories"] == 6
    assert batch.metrics["rollout/num_groups"] == 3
    assert batch.metrics["rollout/tokens"] == sum(b.metrics["rollout/tokens"] for b in alone)
    assert batch.metrics["FrozenLake/pass@2"] == alone[1].metrics["FrozenLake/pass@2"]
    train = tag_metrics(batch.metrics, ["SimpleSokoban", "FrozenLake"], "train/")
    assert "train/SimpleSokoban/success" in train and "train/FrozenLake/success" in train
    assert "rollout/num_trajectories" in train
    # Turn rows (sample_unit=turn) come from the concatenated episodes.
    turns = batch.turn_samples()
    assert set(turns.episode.tolist()) == set(range(6))
    np.testing.assert_array_equal(turns.group_ids, batch.group_ids[turns.episode])


def test_one_env_is_its_own_rollout_unchanged(slots, tok):
    key = jax.random.key(3)
    one = slots[1]._replace(groups=2)  # the lake's batch size of the mixed batch: one compile
    cfg = dataclasses.replace(CFG, env_groups=2)
    batch = collect_train([one], _policy(tok), cfg, iteration=2, key=key)
    ref = one.rollout.collect(_policy(tok), train_seeds(cfg, 2), key)
    for name in (*TOKEN_FIELDS, "scores", "group_ids", "seeds"):
        np.testing.assert_array_equal(getattr(batch, name), getattr(ref, name), err_msg=name)
    assert batch.metrics == ref.metrics
    np.testing.assert_array_equal(batch.tag_ids, np.zeros(4))


def test_validation_plays_each_envs_share_on_the_fixed_seeds(slots, tok):
    keys = []

    def val_key(i):
        keys.append(i)
        return jax.random.key(100 + i)

    batch = collect_val(slots, _policy(tok), CFG, val_key)
    assert keys == [0, 1]
    # val_group_size 1: SimpleSokoban seeds 50, 51; FrozenLake seed 50 (each env's own first seeds)
    np.testing.assert_array_equal(batch.seeds, [50, 51, 50])
    np.testing.assert_array_equal(batch.tag_ids, [0, 0, 1])
    np.testing.assert_array_equal(batch.group_ids, [0, 1, 2])
    assert batch.metrics["SimpleSokoban/pass@1"] == batch.metrics["SimpleSokoban/success"]
    assert "FrozenLake/success" in batch.metrics
    only_val = [slots[0]._replace(groups=0), slots[1]._replace(groups=2)]  # a validation-only env
    assert collect_train(only_val, _policy(tok), dataclasses.replace(CFG, env_groups=2), 0,
                         jax.random.key(0)).trajectories[0]["tag"] == "FrozenLake"


def test_inductive_normalisation_groups_rows_by_their_env(slots, tok):
    batch = collect_train(slots, _policy(tok), CFG, iteration=0, key=jax.random.key(0))
    scores = np.array([1.0, 3.0, 0.0, 0.0, 4.0, 8.0], np.float32)  # by hand: Sokoban's mean 2, the lake's 3
    batch = dataclasses.replace(batch, scores=scores)
    out = normalize_batch(batch, scores.reshape(3, 2), batch.tag_ids, slice(None), "inductive", "mean")
    np.testing.assert_allclose(out.scores, [-1, 1, -3, -3, 1, 5])  # not the batch mean's 16/6
    out = normalize_batch(batch, scores.reshape(3, 2), batch.tag_ids, slice(None), "inductive", "mean_std")
    lake = scores[2:]
    np.testing.assert_allclose(out.scores[:2], [-1 / np.sqrt(2), 1 / np.sqrt(2)], rtol=1e-5)
    np.testing.assert_allclose(out.scores[2:], (lake - lake.mean()) / lake.std(ddof=1), rtol=1e-5)
    # The normalised score sits on each row's last sampled token.
    last = [np.nonzero(row)[0][-1] for row in batch.loss_mask]
    np.testing.assert_allclose(out.token_rewards[np.arange(6), last], out.scores)


def test_two_envs_with_one_tag_are_an_error():
    from ragen_jax.config.fields import ConfigError
    from ragen_jax.config.loading import from_config_dict, load_config
    from ragen_jax.train import build_envs

    c = load_config(["--config", str(ROOT / "configs/mixed.py"), "--config.env.mix.0.tag=",
                     "--config.env.mix.1.tag=Sokoban"])
    with pytest.raises(ConfigError, match=r"env\.mix\[1\]\.tag: 'Sokoban' names two envs"):
        build_envs(from_config_dict(c))


def test_a_host_env_with_its_own_budget_mixes_with_a_grid(slots, tok):
    """Countdown (a host env, one answer per episode: its own max_turn 1) and FrozenLake (a
    JAX env, two turns) in one batch."""
    one_step = dataclasses.replace(CFG, max_turn=1, max_actions_per_traj=1, max_actions_per_turn=1)
    countdown = AgentRollout(*make("countdown"), tok, one_step, tag="Countdown")
    mixed = [EnvSlot(countdown, groups=1, val_groups=1), slots[1]._replace(groups=2)]
    policy = ScriptedPolicy.from_texts(tok, lambda row, call: "<answer>Up</answer>")
    batch = collect_train(mixed, policy, CFG, iteration=0, key=jax.random.key(0))
    assert [t["tag"] for t in batch.trajectories] == ["Countdown"] * 2 + ["FrozenLake"] * 4
    np.testing.assert_array_equal(batch.num_turns, [1, 1, 2, 2, 2, 2])
    np.testing.assert_array_equal(batch.tag_ids, [0, 0, 1, 1, 1, 1])
    assert batch.metrics["Countdown/num_turns"] == 1 and batch.metrics["FrozenLake/num_turns"] == 2
    # The one-turn Countdown rows are padded to the two-turn lake rows' width.
    lengths = batch.attention_mask.sum(1)
    assert lengths[:2].max() < lengths[2:].min() and batch.input_ids.shape[1] >= lengths.max()


def test_padding_fraction_at_the_updates_width():
    from ragen_jax.rollout.batch import padding_fraction

    assert padding_fraction(np.array([64, 32]), 64) == 0.25  # width 64: 96 real of 128
    assert padding_fraction(np.array([65, 63]), 64) == 1 - 128 / 256  # width rounds up to 128
    assert padding_fraction(np.array([], int), 64) == 0.0
