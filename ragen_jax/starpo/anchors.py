"""GiGPO's turn table: every episode's turns as fixed-width arrays, on the host.

The rollout records, for each played turn, the anchor id of the state the turn acted from
(``rollout.agent``: a JAX env's ``envs.levels.anchor_hash``, computed on device with the step;
a host env's rendered observation text, ``levels.text_level_id``). ``turn_table`` lays those
out as ``[B, T]`` arrays with each turn's score, ``T`` the run's most turns (static, so the
update compiles once); the update groups the turns by ``(group, anchor)`` on device
(``starpo.advantages.gigpo``). Groups never span processes (each process plays whole groups),
so the table is built per process and gathered with the episodes (``starpo.rows``).

``similarity < 1`` (verl-agent's ``enable_similarity``) gives a host env's turns whose texts
are at least that similar (``difflib.SequenceMatcher.ratio``) one anchor, for text that
rarely repeats exactly: within each group, in episode then turn order, a turn joins the first
cluster whose first text is similar enough, else starts one (verl-agent's greedy clustering),
and takes that first turn's id. JAX envs keep their exact ids.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence

import numpy as np

from ragen_jax.rollout.batch import Episode
from ragen_jax.starpo.estimators import TurnTable


def turn_table(episodes: Sequence[Episode], group_ids: np.ndarray, turns: int,
               similarity: float = 1.0) -> TurnTable:
    """The table of ``episodes`` (group ``group_ids[b]``) at width ``turns`` (at least every
    episode's turn count), as host arrays: turn ``t`` of episode ``b`` at ``[b, t - 1]``, its
    score (env reward + penalty; 0 after the last turn), its penalty and its anchor id as hash lanes;
    ``similarity`` as in the module docstring (1: exact ids)."""
    n = len(episodes)
    most = max((len(ep.turns) for ep in episodes), default=0)
    if most > turns:
        raise ValueError(f"an episode played {most} turns, more than the table's {turns}")
    rewards = np.zeros((n, turns), np.float32)
    penalties = np.zeros((n, turns), np.float32)
    ids = np.zeros((n, turns), np.uint64)
    played = np.zeros((n, turns), bool)
    for b, ep in enumerate(episodes):
        k = len(ep.turns)
        if k and "anchor" not in ep.turns[0]:
            raise ValueError("the rollout recorded no anchor states (AgentRollout(..., "
                             "record_anchors=True))")
        rewards[b, :k] = [t.get("reward", 0.0) + t.get("penalty", 0.0) for t in ep.turns]
        penalties[b, :k] = [t.get("penalty", 0.0) for t in ep.turns]
        ids[b, :k] = [t["anchor"] for t in ep.turns]
        played[b, :k] = True
    if similarity < 1.0:
        _cluster_similar(episodes, np.asarray(group_ids), ids, similarity)
    lanes = np.stack([ids >> np.uint64(32), ids & np.uint64(0xFFFFFFFF)], -1).astype(np.uint32)
    return TurnTable(rewards, penalties, lanes, played)


def _cluster_similar(episodes: Sequence[Episode], group_ids: np.ndarray, ids: np.ndarray,
                     threshold: float) -> None:
    """Rewrites ``ids [B, T]`` of the host-env turns: each takes the id of the first turn of
    its cluster (module docstring)."""
    for g in np.unique(group_ids):
        clusters: list[tuple[str, int]] = []  # (first text, its id)
        for b in np.nonzero(group_ids == g)[0]:
            ep = episodes[b]
            if not ep.text_anchors:
                continue
            for t, turn in enumerate(ep.turns):
                text = turn["state"]
                for first, anchor in clusters:
                    if difflib.SequenceMatcher(None, text, first).ratio() >= threshold:
                        ids[b, t] = anchor
                        break
                else:
                    clusters.append((text, int(ids[b, t])))


def anchored_turns(table: TurnTable, group_ids: np.ndarray,
                   valid: np.ndarray | None = None) -> dict[str, float]:
    """``rollout/anchored_turns``: the share of the played turns (of ``valid`` episodes, all
    when None) whose anchor another turn of their group shares, i.e. that GiGPO gives a
    step-level advantage; ``rollout/anchored_later_turns`` the same of the turns after the
    first (a group's first turns always share its reset state); ``rollout/anchor_group_size``
    the mean size of the anchor groups (verl-agent's "avg size of step-level group")."""
    played = table.played & (True if valid is None else np.asarray(valid, bool)[:, None])
    b, t = np.nonzero(played)
    if b.size == 0:
        return {"rollout/anchored_turns": 0.0, "rollout/anchored_later_turns": 0.0,
                "rollout/anchor_group_size": 0.0}
    keys = np.stack([np.asarray(group_ids, np.int64)[b], table.anchors[b, t, 0].astype(np.int64),
                     table.anchors[b, t, 1].astype(np.int64)], 1)
    _, inverse, counts = np.unique(keys, axis=0, return_inverse=True, return_counts=True)
    shared = counts[inverse.reshape(-1)] > 1
    later = t > 0
    return {"rollout/anchored_turns": float(shared.mean()),
            "rollout/anchored_later_turns": float(shared[later].mean()) if later.any() else 0.0,
            "rollout/anchor_group_size": float(counts.mean())}
