"""Sokoban's validation is held out by room: no training episode of the tiny preset, at any
turn, shows a validation level's starting board (compared by state: room, boxes and player),
at the preset's 6x6 with one box and at 8x8 with two (the largest the tests and studies use;
7x7 runs the same code between them).

A board shows the room, the boxes and the player, not where the episode started, so an
episode in a validation level's room can push its way onto that level's starting board (level
identity alone let the preset's prior data show 68 of its 245). Two checks, both by state:

* played (the preset's 6x6): the prior's scripted episodes (the first ``PLAYED`` rows of each
  of its collections, with their policies, seeds and held-out set) never show a validation
  starting board, no step changes an episode's room, and the collections are the groups
  ``warmstart.data_seeds`` names;
* reasoned (every size): every level the prior's collections (of ``EPISODES`` episodes each:
  a prefix of the preset's seeds) and the first ``STEPS`` RL steps reset (every seed, reset
  only) lies in a room no validation level has; the room never
  changes, so no episode from them, played by any policy, can show a validation starting
  board. At 8x8 the collections' seeds come from ``warmstart.data_seeds`` (what the
  played check ties them to) instead of playing them: the same proof at a third of the cost.
"""

from pathlib import Path

import jax
import numpy as np
import pytest

from ragen_jax import warmstart
from ragen_jax.config.loading import load_config
from ragen_jax.rollout.agent import AgentRollout, train_seeds
from ragen_jax.rollout.env_driver import JaxEnvDriver
from ragen_jax.train import Trainer

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = {  # the tiny preset, and its env at the larger sizes the tests and studies use
    "6x6-1box": [],
    "8x8-2boxes": ["--config.env.params.dim_room=(8, 8)", "--config.env.params.num_boxes=2"],
}
STEPS = 25  # RL steps whose resets are checked
# The preset's prior data, a quarter of it: a prefix of the same seeds, played by the same
# policies (every held-out reset runs the generator: a reset of all 4,096 + 4,096 at 8x8 is
# most of the test's time, and a quarter still meets validation rooms without holding out).
EPISODES = 1024
PLAYED = 256  # rows played of each prior collection: the validation reset's size (one compile)


def boards(host) -> np.ndarray:
    """``[B]`` bytes of each row's board (room, boxes, player) in a batched host state."""
    rows = [np.asarray(x).reshape(len(host.player), -1).astype(np.int8)
            for x in (host.room_fixed, host.boxes, host.player)]
    return np.array([r.tobytes() for r in np.concatenate(rows, 1)], object)


def rooms(host) -> np.ndarray:
    """``[B]`` bytes of each row's room (walls and targets)."""
    return np.array([r.tobytes() for r in np.asarray(host.room_fixed, np.int8)], object)


def prior_seeds(trainer: Trainer) -> list[np.ndarray]:
    """The group seeds of the prior's two collections, from the config: the mixture's
    episodes in groups of one per action, then the single-turn rows' own, one a level."""
    w, rollout = trainer.run.warmstart, trainer.slots[0].rollout
    seed = w.seed_for(trainer.run.seed)
    return [warmstart.data_seeds(w.episodes, rollout.env.num_actions, seed),
            warmstart.data_seeds(w.turns.episodes, 1, seed + 1)]


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_no_training_episode_shows_a_validation_starting_board(setting, tmp_path, monkeypatch):
    run = load_config([
        "--config", str(ROOT / "configs/sokoban.py"), f"--config.trainer.output_dir={tmp_path}",
        f"--config.trainer.total_steps={STEPS}", "--config.warmstart.cache=False",
        "--config.model.hidden_size=32", "--config.model.intermediate_size=64",
        "--config.model.num_hidden_layers=1", f"--config.warmstart.episodes={EPISODES}",
        f"--config.warmstart.turns.episodes={EPISODES}", *SETTINGS[setting]])
    collections: list[np.ndarray] = []  # each prior collection's group seeds, all of them
    shown: list[np.ndarray] = []  # every board a played prior episode showed at a turn
    collect, reset, step = AgentRollout.collect, JaxEnvDriver.reset, JaxEnvDriver.step

    def spy_collect(self, policy, seeds, key, **kw):
        assert kw.get("held_out", True), "the prior's data must hold validation out"
        size = kw.get("group_size") or self.config.group_size
        collections.append(np.asarray(seeds))
        return collect(self, policy, seeds[:PLAYED // size], key, **kw)

    def spy_reset(self, seeds, *, held_out=True):
        out = reset(self, seeds, held_out=held_out)
        if held_out:
            shown.append(boards(out.host))
        return out

    def spy_step(self, states, actions, keys):
        before = np.asarray(jax.device_get(states.room_fixed))
        states, host, outcome = step(self, states, actions, keys)
        np.testing.assert_array_equal(host.room_fixed, before)  # a room is never changed
        shown.append(boards(host))
        return states, host, outcome

    monkeypatch.setattr(warmstart, "train_sft", lambda *a, **k: [0.0])  # the data is what is checked
    trainer = Trainer(run)
    rollout = trainer.slots[0].rollout
    val = reset(rollout.driver, trainer.plan.rollout.val.seed + np.arange(trainer.slots[0].val_groups),
                held_out=False)
    val_boards, val_rooms = set(boards(val.host)), set(rooms(val.host))
    hits: set = set()
    if setting == "6x6-1box":
        with monkeypatch.context() as m:
            m.setattr(AgentRollout, "collect", spy_collect)
            m.setattr(JaxEnvDriver, "reset", spy_reset)
            m.setattr(JaxEnvDriver, "step", spy_step)
            trainer.warmstart()
        shown = np.concatenate(shown)
        # Two collections (the mixture's episodes, the single-turn rows' own), each reset and
        # stepped at least once.
        assert len(collections) == 2 and len(shown) >= 4 * PLAYED
        for got, want in zip(collections, prior_seeds(trainer), strict=True):
            np.testing.assert_array_equal(got, want)
        hits = {b for b in shown if b in val_boards}
    else:
        collections = prior_seeds(trainer)

    # Every seed the prior and the first STEPS RL steps reset (a group's episodes share its
    # seed's level), in chunks of the validation reset's size: programs already compiled.
    seeds = np.concatenate(collections + [train_seeds(trainer.plan.rollout, i) for i in range(STEPS)])
    chunks = np.resize(seeds, -(-len(seeds) // len(val.levels)) * len(val.levels))
    chunks = chunks.reshape(-1, len(val.levels))
    held = np.concatenate([rooms(reset(rollout.driver, c).host) for c in chunks])
    met = {r for r in held if r in val_rooms}
    assert not hits and not met, (
        f"{setting}: {len(hits)} of {len(val_boards)} validation starting boards shown by "
        f"the played prior boards; {len(met)} of {len(val_rooms)} validation rooms "
        f"among {len(seeds)} training resets")
    if setting == "6x6-1box":  # a small generator: without holding out, the streams meet them
        plain = np.concatenate([rooms(reset(rollout.driver, c, held_out=False).host)
                                for c in chunks])
        assert {r for r in plain if r in val_rooms}
