"""From a rollout batch and the filter's decision to the update's ``StepBatch``.

``build_step_batch`` is the one place where rows are chosen (the kept groups, padded by
copies of kept rows to a multiple of the mini-batch size and the data-parallel device count,
RAGEN's ``batch_adjust_mode=copy``), balanced across processes (each feeds the same number of
rows), cut to a common width, and placed on the mesh as global arrays.

A row is a trajectory (``sample_unit="trajectory"``: the rollout's transcript rows) or a
turn (``"turn"``: ``RolloutBatch.turn_samples()``, each turn's prompt then its answer, with
every episode's score and group replicated beside them for the episode-level advantages of
``starpo.update``). Filtering keeps or drops whole groups either way.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import Mesh

from ragen_jax import distributed as dist
from ragen_jax.rollout.batch import RolloutBatch
from ragen_jax.rollout.sampler import bucket_length
from ragen_jax.shapes import HighWater
from ragen_jax.starpo.optimizer_step import Prefixes, interleave
from ragen_jax.starpo.update import SAMPLE_UNITS, Episodes, StepBatch


def select_rows(keep_groups: np.ndarray, group_ids: np.ndarray, multiple: int,
                rng: np.random.Generator, valid: np.ndarray | None = None) -> np.ndarray:
    """Rows of the kept groups (only the ``valid`` ones, when given: an env error's episode
    is never a row), padded to a multiple of ``multiple`` by duplicating random kept rows.
    Empty if nothing was kept."""
    chosen = keep_groups[group_ids]
    rows = np.nonzero(chosen if valid is None else chosen & valid)[0]
    if rows.size == 0:
        return rows
    short = (-rows.size) % multiple
    return np.concatenate([rows, np.sort(rng.choice(rows, size=short))]) if short else rows


def balanced_rows(keep: np.ndarray, group_ids: np.ndarray, weights: np.ndarray, multiple: int,
                  rng: np.random.Generator, valid: np.ndarray | None = None
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Multi-process row selection: this process's kept rows, padded by copies to the largest
    count any process has (rounded up to ``multiple / processes``), so that every process
    feeds the same number of rows. A process that kept nothing feeds copies of row 0 with
    weight 0 (they add nothing to the loss)."""
    per = multiple // math.gcd(multiple, jax.process_count())
    rows = select_rows(keep, group_ids, 1, rng, valid)
    target = int(dist.allgather(np.int64(rows.size)).max())
    target = -(-target // per) * per
    w = weights.astype(np.float32).copy()
    if rows.size == 0:
        w[0] = 0.0
        return np.zeros(target, np.int64), w
    extra = np.sort(rng.choice(rows, size=target - rows.size)) if target > rows.size else rows[:0]
    return np.concatenate([rows, extra]), w


def turn_ends(loss_mask: np.ndarray, turn_ids: np.ndarray) -> np.ndarray:
    """1 on the last sampled token of each turn (bi-level GAE's turn boundaries)."""
    sampled = loss_mask.astype(bool)
    nxt = np.concatenate([turn_ids[:, 1:], np.zeros_like(turn_ids[:, :1])], 1)
    nxt_sampled = np.concatenate([sampled[:, 1:], np.zeros_like(sampled[:, :1])], 1)
    return (sampled & ~(nxt_sampled & (nxt == turn_ids))).astype(np.float32)


def build_step_batch(batch: RolloutBatch, keep: np.ndarray, weights: np.ndarray, *,
                     group_offset: int, mini_batch_size: int, pad_multiple: int,
                     group_buckets: np.ndarray, mesh: Mesh, rng: np.random.Generator,
                     share_prefixes: bool = True,
                     sample_unit: str = "trajectory", micro_batches: int = 1,
                     long_rows_apart: bool = False, valid: np.ndarray | None = None,
                     marks: HighWater | None = None) -> StepBatch | None:
    """The update's rows of this process's rollout ``batch`` (``None`` if no process kept
    any). ``keep [G_local]`` and ``weights [B_local]`` come from the filter, ``group_offset``
    is this process's first global group id, ``group_buckets [G]`` the reward-std bucket of
    every global group (``starpo.gradient_analysis.reward_std_buckets``; zeros when unused).

    With ``share_prefixes`` each group's shared first prompt (``group_prefix_lengths``) goes
    into a table computed once per forward pass (``StepBatch.prefixes``), and the rows hold
    only what follows it: a group of n rows reads its prompt once instead of n times.

    ``sample_unit="turn"``: the rows are the turn rows (``weights`` stay per episode).

    ``valid [B_local]`` (None: all): the episodes that may train. The others (an env error
    ended them) give no row, not even a padding copy, so no advantage, loss or group
    statistic of the update sees them; with turn rows they are in no group of the episode
    table either.

    ``long_rows_apart`` (one device): when every mini-batch's rows but its longest micro-batch's
    worth (``micro_batches`` per mini-batch) fit in fewer slots, the batch says so
    (``StepBatch.short_width``) and the update trains those at that width
    (``update.long_rows_apart``).

    ``marks`` (``ragen_jax.shapes.HighWater``): every width is at least the widest this run
    has used at its place, so the update compiles a new program only for a new maximum."""
    marks = marks or HighWater()
    if sample_unit not in SAMPLE_UNITS:
        raise ValueError(f"algorithm.sample_unit must be one of {SAMPLE_UNITS}, got {sample_unit!r}")
    episodes = None
    if sample_unit == "turn":
        turns = batch.turn_samples()
        # Global episode ids: every process holds as many episodes (equal shares of groups).
        offset = jax.process_index() * batch.scores.size
        episode_index = (turns.episode + offset).astype(np.int32)
        episode_groups = (batch.group_ids + group_offset).astype(np.int32)
        if valid is not None:  # in no group: the estimators' segment sums drop ids below 0
            episode_groups = np.where(valid, episode_groups, -1).astype(np.int32)
        episodes = (np.asarray(batch.scores, np.float32), episode_groups)
        weights = np.asarray(weights)[turns.episode]
        valid = None if valid is None else np.asarray(valid, bool)[turns.episode]
        batch = _TurnRows(turns, batch.scores[turns.episode])
    n_dev = mesh.shape["data"] * mesh.shape["fsdp"]
    multiple = math.lcm(mini_batch_size, n_dev)
    if dist.multiprocess():
        rows, weights = balanced_rows(keep, batch.group_ids, weights, multiple, rng, valid)
    else:
        rows = select_rows(keep, batch.group_ids, multiple, rng, valid)
    if not dist.any_process(rows.size > 0):
        return None
    width = _fit_width(marks, "update/width",
                       int(batch.attention_mask[rows].any(0).nonzero()[0].max()) + 1, pad_multiple)

    def cols(x):  # this process's rows, cut or zero-padded to the global width
        x = x[rows, :width]
        return np.pad(x, ((0, 0), (0, width - x.shape[1]))) if x.shape[1] < width else x

    group_ids = batch.group_ids[rows] + group_offset
    tokens = dict(
        input_ids=cols(batch.input_ids), attention_mask=cols(batch.attention_mask),
        positions=cols(batch.position_ids),
        loss_mask=cols(batch.loss_mask.astype(np.float32) * (weights[:, None] > 0)),
        sampler_logp=cols(batch.model_logprobs), token_rewards=cols(batch.token_rewards),
        turn_end=turn_ends(cols(batch.loss_mask), cols(batch.turn_ids)))
    prefixes = None
    if share_prefixes:
        lengths = group_prefix_lengths(batch.input_ids, batch.loss_mask, batch.group_ids)
        row_lengths = lengths[batch.group_ids[rows]]
        suffix = tokens["attention_mask"].sum(1) - row_lengths

        table = prefix_table(batch.input_ids, lengths, batch.group_ids,
                             _fit_width(marks, "update/prefix", int(lengths.max()), pad_multiple))
        tokens = after_prefix(tokens, row_lengths,
                              _fit_width(marks, "update/suffix", int(suffix.max()), pad_multiple))
        # Row = global group id: every process's table, in process order.
        prefixes = Prefixes(*(dist.replicated(dist.allgather(t).reshape(-1, t.shape[1]), mesh)
                              for t in table))
    split = None
    if long_rows_apart:
        split = short_width(tokens["attention_mask"].sum(1), mini_batch_size, micro_batches,
                            pad_multiple, tokens["input_ids"].shape[1])
        if split is not None:
            split = min(marks.fit("update/short", split), tokens["input_ids"].shape[1])
    local = StepBatch(
        **tokens, scores=batch.scores[rows], group_ids=group_ids.astype(np.int32),
        bucket_ids=np.asarray(group_buckets, np.int32)[group_ids],
        advantage_scale=weights[rows].astype(np.float32),
        prefix_index=None if prefixes is None else group_ids.astype(np.int32),
        episode_index=None if episodes is None else episode_index[rows], short_width=split)
    if episodes is not None:  # every process's episodes, in process order
        episodes = Episodes(*(dist.replicated(dist.allgather(x).reshape(-1), mesh)
                              for x in episodes))
    return jax.tree.map(lambda x: dist.global_rows(x, mesh), local).replace(
        prefixes=prefixes, episodes=episodes)


def calibrate_widths(marks: HighWater, batch: RolloutBatch, rows: np.ndarray, pad_multiple: int,
                     share_prefixes: bool = True) -> None:
    """Raises the update's width marks to what ``batch``'s ``rows [B] bool`` would need
    (every process's: the widths are global), the way ``build_step_batch`` measures them.
    The trainer calls it with each validation batch's episodes of the envs it trains on: a
    first validation plays many more levels than a training step, so its longest trajectory
    and first prompt set the update's widths before the training steps meet them one at a
    time (each a program compiled mid-run)."""
    mask = batch.attention_mask[rows]
    _fit_width(marks, "update/width", int(mask.any(0).nonzero()[0].max()) + 1 if mask.any() else 0,
               pad_multiple)
    if share_prefixes:
        lengths = group_prefix_lengths(batch.input_ids, batch.loss_mask, batch.group_ids)
        row_prefix = lengths[batch.group_ids[rows]]
        _fit_width(marks, "update/prefix", int(row_prefix.max()) if row_prefix.size else 0,
                   pad_multiple)
        _fit_width(marks, "update/suffix",
                   int((mask.sum(1) - row_prefix).max()) if row_prefix.size else 0, pad_multiple)


def _fit_width(marks: HighWater, site: str, longest: int, pad_multiple: int) -> int:
    """Every process's ``longest`` at ``site``, rounded up to ``pad_multiple`` (at least one
    step), and never narrower than the site's mark, which follows."""
    longest = int(dist.allgather(np.int64(longest)).max())
    return marks.fit(site, bucket_length(longest, pad_multiple, pad_multiple))


def short_width(lengths: np.ndarray, mini_batch_size: int, micro_batches: int,
                pad_multiple: int, width: int) -> int | None:
    """The width that holds, in every mini-batch, all rows but its longest
    ``mini_batch_size / micro_batches`` (``update.long_rows_apart``), given the rows' lengths
    ``[B]``: rounded up to a quarter of the rows' ``width`` (a multiple of ``pad_multiple``),
    at most ``width``. A coarse step, and ``width`` itself when nothing is narrower: which
    rows are short changes every step, and each width is a program of its own. None with a
    single micro-batch. The mini-batches are the update's (``update.interleave``)."""
    if micro_batches < 2 or lengths.size == 0:
        return None
    parts = interleave(lengths, lengths.size // mini_batch_size)  # [mini-batches, rows]
    short = mini_batch_size - mini_batch_size // micro_batches
    quarter = bucket_length(-(-width // 4), pad_multiple, pad_multiple)
    narrow = bucket_length(np.sort(parts, axis=1)[:, short - 1].max(), quarter, quarter)
    return min(narrow, width)


class _TurnRows:
    """Turn rows (``TurnSamples``) under the names ``build_step_batch`` reads from a batch."""

    def __init__(self, turns, scores: np.ndarray):
        self.input_ids, self.attention_mask = turns.input_ids, turns.attention_mask
        self.position_ids, self.loss_mask = turns.position_ids, turns.loss_mask
        self.model_logprobs, self.token_rewards = turns.model_logprobs, turns.token_rewards
        self.turn_ids, self.group_ids, self.scores = turns.turn_ids, turns.group_ids, scores


def group_prefix_lengths(input_ids: np.ndarray, loss_mask: np.ndarray,
                         group_ids: np.ndarray) -> np.ndarray:
    """The length of each group's shared prefix ``[G]``: the tokens every row of the group
    has in common from the start, up to the first sampled token (a group's envs start from
    one state, so this is its first prompt: system message and first observation)."""
    sampled = loss_mask.astype(bool)
    first_sampled = np.where(sampled.any(1), sampled.argmax(1), input_ids.shape[1])  # [B]
    lengths = np.zeros(int(group_ids.max()) + 1, np.int64)
    for g in range(lengths.size):
        members = np.nonzero(group_ids == g)[0]
        if members.size == 0:
            continue
        n = int(first_sampled[members].min())
        differs = (input_ids[members, :n] != input_ids[members[0], :n]).any(0)
        lengths[g] = int(differs.argmax()) if differs.any() else n
    return lengths


def prefix_table(input_ids: np.ndarray, lengths: np.ndarray, group_ids: np.ndarray,
                 width: int) -> tuple[np.ndarray, np.ndarray]:
    """Each group's prefix (``lengths [G]`` tokens of its rows) as a table: ``input_ids``,
    ``attention_mask`` ``[G, width]``, real tokens first."""
    ids = np.zeros((lengths.size, width), np.int32)
    for g, n in enumerate(lengths):
        if n:
            ids[g, :n] = input_ids[np.argmax(group_ids == g), :n]
    return ids, np.arange(width)[None, :] < lengths[:, None]


def after_prefix(tokens: dict[str, np.ndarray], lengths: np.ndarray,
                 width: int) -> dict[str, np.ndarray]:
    """The ``[B, L]`` arrays ``tokens`` shifted left by each row's prefix length
    ``lengths [B]`` (what follows the prefix, from slot 0), ``width`` slots wide."""
    index = lengths[:, None] + np.arange(width)[None, :]  # [B, W]
    out = {}
    for name, x in tokens.items():
        padded = np.concatenate([x, np.zeros((x.shape[0], width), x.dtype)], 1)
        out[name] = np.take_along_axis(padded, index, 1)
    return out
