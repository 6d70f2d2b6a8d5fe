"""One iteration's data path, from the rollout to the update's ``StepBatch``.

Read top to bottom, an iteration (``Trainer.train_step``) is:

1. ``gather_episodes``: every process's per-episode values (scores, which episodes count,
   lengths, env tags, entropies), in one exchange: the filter and the reward normalisation
   decide for every group of the step at once.
2. The filter (``starpo.filtering``) and the normalisation (``starpo.normalization``).
3. ``build_step_batch``, in named phases: ``_this_process`` (this process's share of the
   filter's decision, and its rows: trajectories or turns), ``_choose`` (the kept rows, then
   one exchange, ``_agree``, of every process's row count and widths: they depend on which
   rows were kept; ``_fit_widths``), ``_pad_rows`` (copies of kept rows up to a common count, RAGEN's
   ``batch_adjust_mode=copy``), ``_cut_tokens`` (the rows at the common width),
   ``_share_prefixes``, ``arrange_rows`` (the rows among as many as the update was compiled
   for, the ``update/rows`` mark: padding rows in whole mini-batches that it skips) and
   ``_place`` (every process's prefix and episode tables, and its rows as its shard of
   global arrays).

A row is a trajectory (``sample_unit="trajectory"``: the rollout's transcript rows) or a
turn (``"turn"``: ``RolloutBatch.turn_samples()``, each turn's prompt then its answer, with
every episode's score and group replicated beside them for the episode-level advantages of
``starpo.update``). Filtering keeps or drops whole groups either way. For GiGPO the trainer
passes each process's turn table (``starpo.anchors.turn_table``), gathered with the episode
table in ``_place``, and the rows carry each token's turn.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh

from ragen_jax import distributed as dist
from ragen_jax.rollout.batch import RolloutBatch
from ragen_jax.rollout.sampler import bucket_length
from ragen_jax.shapes import HighWater
from ragen_jax.starpo.estimators import TurnTable
from ragen_jax.starpo.optimizer_step import Prefixes, interleave
from ragen_jax.starpo.update import SAMPLE_UNITS, Episodes, StepBatch

# ----------------------------------------------------------------------------------------------
# 1. Every process's episodes
# ----------------------------------------------------------------------------------------------


class GlobalEpisodes(NamedTuple):
    """Every process's episodes of one iteration, processes in order: ``[G, S]`` by global
    group, or ``[G * S]`` rows."""

    scores: np.ndarray  # [G, S] the raw scores
    valid: np.ndarray | None  # [G, S] the episodes that may train (None: no env error ended one)
    sampled: np.ndarray  # [G, S] sampled tokens per episode
    lengths: np.ndarray  # [G * S] tokens per episode
    tag_ids: np.ndarray  # [G * S] each episode's env of the run
    entropies: np.ndarray | None  # [G, S] (None: the filter does not read them)
    here: slice  # this process's rows of the G * S


def gather_episodes(batch: RolloutBatch, groups: int,
                    entropies: Any | None = None) -> GlobalEpisodes:
    """The iteration's exchange of rollout values (one collective): ``batch`` is this
    process's share of the step's ``groups`` groups; ``entropies [B]`` its episodes' mean
    token entropies, when the filter reads them."""
    local = {"scores": batch.scores, "failed": batch.env_failed,
             "sampled": batch.loss_mask.sum(1), "lengths": batch.attention_mask.sum(1),
             "tag_ids": batch.tag_ids}
    if entropies is not None:
        local["entropies"] = entropies
    every = dist.allgather_rows(local)
    size = every["scores"].size // groups
    # Episodes an env error ended (a hang, a crash) say nothing about the policy: they leave
    # the filter's statistics, the normalisation and the update (None: none failed, the exact
    # arithmetic of a run without errors).
    valid = ~every["failed"].reshape(groups, -1)
    part = dist.share(groups, "rollout.env_groups")
    return GlobalEpisodes(
        scores=every["scores"].reshape(groups, -1), valid=None if valid.all() else valid,
        sampled=every["sampled"].reshape(groups, -1), lengths=every["lengths"],
        tag_ids=every["tag_ids"],
        entropies=every["entropies"].reshape(groups, -1) if entropies is not None else None,
        here=slice(part.start * size, part.stop * size))


# ----------------------------------------------------------------------------------------------
# 3. The update's rows (2., the filter and the normalisation, are in their own modules)
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RowSettings:
    """How the update's rows are built (the run's ``actor`` and ``algorithm`` settings).

    ``pad_multiple``: every width is a multiple of it. ``share_prefixes``: each group's
    shared first prompt (``group_prefix_lengths``) goes into a table computed once per
    forward pass (``StepBatch.prefixes``) and the rows hold only what follows it: a group of
    n rows reads its prompt once instead of n times. ``sample_unit``: what a row is.
    ``long_rows_apart`` (one device): when every mini-batch's rows but its longest
    micro-batch's worth (``micro_batches`` per mini-batch) fit in fewer slots, the batch says
    so (``StepBatch.short_width``) and the update trains those at that width
    (``update.long_rows_apart``)."""

    mini_batch_size: int
    pad_multiple: int
    share_prefixes: bool = True
    sample_unit: str = "trajectory"
    micro_batches: int = 1
    long_rows_apart: bool = False

    def __post_init__(self):
        if self.sample_unit not in SAMPLE_UNITS:
            raise ValueError(f"algorithm.sample_unit must be one of {SAMPLE_UNITS}, "
                             f"got {self.sample_unit!r}")


class _Source(NamedTuple):
    """This process's candidate rows with the filter's decision on each."""

    rows: Any  # the rollout batch (trajectory rows) or ``_TurnRows``
    keep: np.ndarray  # [G_local] the kept groups
    weights: np.ndarray  # [R] each row's weight
    valid: np.ndarray | None  # [R] the rows that may train (None: all)
    group_offset: int  # this process's first global group id
    # Turn rows or a turn table: every local episode's (score, group[, turn table])
    episodes: tuple[np.ndarray, np.ndarray, TurnTable | None] | None
    episode_index: np.ndarray | None  # [R] each row's global episode id (with ``episodes``)


def select_rows(keep_groups: np.ndarray, group_ids: np.ndarray, multiple: int,
                rng: np.random.Generator, valid: np.ndarray | None = None) -> np.ndarray:
    """Rows of the kept groups (only the ``valid`` ones, when given: an env error's episode
    is never a row), padded to a multiple of ``multiple`` by duplicating random kept rows.
    Empty if nothing was kept."""
    rows = kept_rows(keep_groups, group_ids, valid)
    if rows.size == 0:
        return rows
    return _pad_rows(rows, -(-rows.size // multiple) * multiple, rng)


def kept_rows(keep_groups: np.ndarray, group_ids: np.ndarray,
              valid: np.ndarray | None = None) -> np.ndarray:
    """The rows of the kept groups (only the ``valid`` ones, when given)."""
    chosen = keep_groups[group_ids]
    return np.nonzero(chosen if valid is None else chosen & valid)[0]


def turn_ends(loss_mask: np.ndarray, turn_ids: np.ndarray) -> np.ndarray:
    """1 on the last sampled token of each turn (bi-level GAE's turn boundaries)."""
    sampled = loss_mask.astype(bool)
    nxt = np.concatenate([turn_ids[:, 1:], np.zeros_like(turn_ids[:, :1])], 1)
    nxt_sampled = np.concatenate([sampled[:, 1:], np.zeros_like(sampled[:, :1])], 1)
    return (sampled & ~(nxt_sampled & (nxt == turn_ids))).astype(np.float32)


def build_step_batch(batch: RolloutBatch, keep: np.ndarray, weights: np.ndarray,
                     settings: RowSettings, *, group_buckets: np.ndarray, mesh: Mesh,
                     rng: np.random.Generator, valid: np.ndarray | None = None,
                     marks: HighWater | None = None,
                     turns: TurnTable | None = None) -> StepBatch | None:
    """The update's rows of this process's rollout ``batch`` (``None`` if no process kept
    any). ``keep [G]``, ``weights [G * S]`` and ``valid [G, S]`` (None: all) are the
    filter's decisions on every process's groups (``batch`` holds this process's share,
    ``dist.share``); ``group_buckets [G]`` the reward-std bucket of every group
    (``starpo.gradient_analysis.reward_std_buckets``; zeros when unused).

    The episodes that are not ``valid`` (an env error ended them) give no row, not even a
    padding copy, so no advantage, loss or group statistic of the update sees them; with
    turn rows they are in no group of the episode table either.

    ``marks`` (``ragen_jax.shapes.HighWater``): every width is at least the widest this run
    has used at its place, so the update compiles a new program only for a new maximum.

    ``turns``: this process's episodes' turn table (``starpo.anchors.turn_table``) for the
    per-turn estimators (GiGPO): the rows then carry their tokens' turns and their episodes,
    and the episode table carries every process's turn tables."""
    marks = marks or HighWater()
    src = _this_process(batch, keep, weights, valid, settings.sample_unit, turns)
    prefix_lengths = (group_prefix_lengths(src.rows.input_ids, src.rows.loss_mask,
                                           src.rows.group_ids)
                      if settings.share_prefixes else None)
    chosen = _choose(src, prefix_lengths, settings, mesh, marks)
    if chosen is None:
        return None
    rows, weights, count, widths = chosen
    rows = _pad_rows(rows, count, rng)
    # The update's row count is a mark too: a step that keeps fewer rows than an earlier
    # one (a filter, an env error) trains on as many, the rest padding (``arrange_rows``).
    static = marks.fit("update/rows", count)
    tokens = _cut_tokens(src.rows, rows, weights, widths["update/width"], turns is not None)
    prefixes = None
    if prefix_lengths is not None:
        tokens, prefixes = _share_prefixes(src.rows, rows, tokens, prefix_lengths, widths)
    split = _split_width(tokens, settings, marks) if settings.long_rows_apart else None
    group_ids = (src.rows.group_ids[rows] + src.group_offset).astype(np.int32)
    local = StepBatch(
        **tokens, scores=src.rows.scores[rows], group_ids=group_ids,
        bucket_ids=np.asarray(group_buckets, np.int32)[group_ids],
        advantage_scale=weights[rows].astype(np.float32),
        prefix_index=None if prefixes is None else group_ids,
        episode_index=None if src.episode_index is None else src.episode_index[rows],
        short_width=split)
    local = arrange_rows(local, count, static, settings.mini_batch_size)
    return _place(local, prefixes, src.episodes, mesh)


def _this_process(batch: RolloutBatch, keep: np.ndarray, weights: np.ndarray,
                  valid: np.ndarray | None, sample_unit: str,
                  table: TurnTable | None = None) -> _Source:
    """This process's share of the filter's decisions, on its rows: the batch's
    trajectories, or its turn rows (each with its episode's weight and validity); with turn
    rows or a turn ``table``, its episodes (and each row's) for the episode table."""
    groups = len(keep)
    part = dist.share(groups, "rollout.env_groups")
    keep = np.asarray(keep)[part]
    weights = np.asarray(weights).reshape(groups, -1)[part].reshape(-1)
    if valid is not None:
        valid = np.asarray(valid).reshape(groups, -1)[part].reshape(-1)
    # Global episode ids: every process holds as many episodes (equal shares of groups).
    offset = jax.process_index() * batch.scores.size
    episode_groups = (batch.group_ids + part.start).astype(np.int32)
    if valid is not None:  # in no group: the estimators' segment sums drop ids below 0
        episode_groups = np.where(valid, episode_groups, -1).astype(np.int32)
    episodes = (np.asarray(batch.scores, np.float32), episode_groups, table)
    if sample_unit != "turn":
        if table is None:
            return _Source(batch, keep, weights, valid, part.start, None, None)
        return _Source(batch, keep, weights, valid, part.start, episodes,
                       (np.arange(batch.scores.size) + offset).astype(np.int32))
    turns = batch.turn_samples()
    return _Source(
        rows=_TurnRows(turns, batch.scores[turns.episode]), keep=keep,
        weights=weights[turns.episode],
        valid=None if valid is None else np.asarray(valid, bool)[turns.episode],
        group_offset=part.start, episodes=episodes,
        episode_index=(turns.episode + offset).astype(np.int32))


def _choose(src: _Source, prefix_lengths: np.ndarray | None, settings: RowSettings,
            mesh: Mesh, marks: HighWater
            ) -> tuple[np.ndarray, np.ndarray, int, dict[str, int]] | None:
    """This process's kept rows and row weights, and what every process agreed on: the row
    count each feeds (the largest any kept, rounded up so that the mini-batch size and the
    data-parallel device count divide the whole) and the widths (``_fit_widths``). None
    when no process kept a row.

    A process that kept nothing feeds copies of its row 0 with weight 0 (they add nothing to
    the loss), and its widths are row 0's."""
    rows = kept_rows(src.keep, src.rows.group_ids, src.valid)
    weights = np.asarray(src.weights, np.float32)
    if rows.size == 0:
        weights = weights.copy()
        weights[0] = 0.0
    measured = rows if rows.size else np.zeros(1, np.int64)
    agreed = _agree({"rows": rows.size, **_widths(src.rows, measured, prefix_lengths)})
    count = agreed.pop("rows")
    if count == 0:
        return None
    per = row_multiple(settings, mesh)
    return rows, weights, -(-count // per) * per, _fit_widths(marks, agreed, settings.pad_multiple)


def row_multiple(settings: RowSettings, mesh: Mesh) -> int:
    """What every process's row count is a multiple of: its part of the least common
    multiple of the mini-batch size and the data-parallel device count (so that both divide
    the global batch)."""
    multiple = math.lcm(settings.mini_batch_size, mesh.shape["data"] * mesh.shape["fsdp"])
    return multiple // math.gcd(multiple, jax.process_count())


def most_rows(rows: int, settings: RowSettings, mesh: Mesh) -> int:
    """The row count (per process) an update of at most ``rows`` rows per process is
    compiled for: ``rows`` rounded up to ``row_multiple``. The trainer starts the
    ``update/rows`` mark there (every trajectory, or every turn of the longest episodes), so
    that no step's filter or env errors compile an update of its own."""
    per = row_multiple(settings, mesh)
    return -(-rows // per) * per


# Padding rows are copies of the first live row (real tokens, valid indices: the whole-batch
# passes read them without a fully masked row) that no loss, group or bucket sees.
_ROW_FIELDS = ("input_ids", "attention_mask", "positions", "loss_mask", "sampler_logp",
               "token_rewards", "turn_end", "scores", "group_ids", "bucket_ids",
               "advantage_scale", "prefix_index", "episode_index", "turn_ids")
_PADDING = {"loss_mask": 0.0, "advantage_scale": 0.0, "scores": 0.0, "group_ids": -1,
            "bucket_ids": -1}


def static_positions(live: int, static: int, mini_batch_size: int) -> np.ndarray:
    """Where each of ``live`` rows goes among ``static`` (both multiples of
    ``mini_batch_size``) so that the update's mini-batches (``optimizer_step.interleave``)
    are those of the ``live`` rows alone, then mini-batches of padding only: live row
    ``j * n + i`` (mini-batch ``i`` of ``n = live / mini_batch_size``, its ``j``-th row) goes to
    row ``j * m + i`` (``m = static / mini_batch_size``).  # [live] int64"""
    n, m = live // mini_batch_size, static // mini_batch_size
    r = np.arange(live)
    return (r // n) * m + r % n


def arrange_rows(local: StepBatch, count: int, static: int, mini_batch_size: int) -> StepBatch:
    """This process's ``count`` rows as its share of a batch of ``static`` rows per process
    (``static_positions`` over every process's rows, so rows may change process; padding
    rows ``_PADDING``), with ``live_mini_batches``: how many of the update's mini-batches hold
    live rows (the rest it skips). Unchanged when ``static == count``."""
    p, k = jax.process_index(), jax.process_count()
    fields = {f.name: getattr(local, f.name) for f in dataclasses.fields(local)
              if f.name in _ROW_FIELDS and getattr(local, f.name) is not None}
    live = k * count // mini_batch_size
    if static == count:
        return local.replace(live_mini_batches=np.int32(live))
    every = dist.allgather_rows(fields)  # [k * count, ...], processes in order
    where = static_positions(k * count, k * static, mini_batch_size)
    mine = slice(p * static, (p + 1) * static)
    out = {}
    for name, x in every.items():
        full = np.repeat(x[:1], k * static, axis=0)
        if name in _PADDING:
            full[:] = _PADDING[name]
        full[where] = x
        out[name] = full[mine]
    return local.replace(**out, live_mini_batches=np.int32(live))



def _widths(rows: Any, chosen: np.ndarray, prefix_lengths: np.ndarray | None) -> dict[str, int]:
    """The longest ``chosen`` row (to its last real token), and with shared prefixes the
    longest group prefix of all of ``rows`` and the longest part of a chosen row after it."""
    mask = rows.attention_mask[chosen]
    # (0 for a row 0 without tokens, an episode whose env failed to reset)
    out = {"update/width": int(mask.any(0).nonzero()[0].max()) + 1 if mask.any() else 0}
    if prefix_lengths is not None:
        out["update/prefix"] = int(prefix_lengths.max())
        out["update/suffix"] = int((mask.sum(1) - prefix_lengths[rows.group_ids[chosen]]).max())
    return out


def _agree(values: dict[str, int]) -> dict[str, int]:
    """Every process's largest of each of ``values``, in one exchange."""
    every = dist.allgather(np.array(list(values.values()), np.int64)).max(0)
    return {name: int(n) for name, n in zip(values, every, strict=True)}


def _fit_widths(marks: HighWater, longest: dict[str, int], pad_multiple: int) -> dict[str, int]:
    """Each site's ``longest`` rounded up to ``pad_multiple`` (at least one step), never
    narrower than the site's mark, which follows."""
    return {site: marks.fit(site, bucket_length(n, pad_multiple, pad_multiple))
            for site, n in longest.items()}


def _pad_rows(rows: np.ndarray, count: int, rng: np.random.Generator) -> np.ndarray:
    """``rows`` and sorted random copies of them up to ``count``; a process with no row
    feeds ``count`` copies of row 0."""
    if rows.size == 0:
        return np.zeros(count, np.int64)
    if count <= rows.size:
        return rows
    return np.concatenate([rows, np.sort(rng.choice(rows, size=count - rows.size))])


def _cut_tokens(source: Any, rows: np.ndarray, weights: np.ndarray, width: int,
                with_turns: bool = False) -> dict[str, np.ndarray]:
    """The token arrays of ``rows``, cut or zero-padded to ``width``; the loss on the rows
    of positive weight only; ``with_turns``: each token's turn too (``turn_ids``)."""

    def cols(x):
        x = x[rows, :width]
        return np.pad(x, ((0, 0), (0, width - x.shape[1]))) if x.shape[1] < width else x

    return dict(
        input_ids=cols(source.input_ids), attention_mask=cols(source.attention_mask),
        positions=cols(source.position_ids),
        loss_mask=cols(source.loss_mask.astype(np.float32) * (weights[:, None] > 0)),
        sampler_logp=cols(source.model_logprobs), token_rewards=cols(source.token_rewards),
        turn_end=turn_ends(cols(source.loss_mask), cols(source.turn_ids)),
        **({"turn_ids": cols(source.turn_ids).astype(np.int32)} if with_turns else {}))


def _share_prefixes(source: Any, rows: np.ndarray, tokens: dict[str, np.ndarray],
                    lengths: np.ndarray, widths: dict[str, int]
                    ) -> tuple[dict[str, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """``tokens`` with each row's group prefix (``lengths [G_local]``) cut off (what follows
    it, from slot 0), and this process's prefix table (``prefix_table``), at the agreed
    widths."""
    table = prefix_table(source.input_ids, lengths, source.group_ids, widths["update/prefix"])
    return after_prefix(tokens, lengths[source.group_ids[rows]], widths["update/suffix"]), table


def _split_width(tokens: dict[str, np.ndarray], settings: RowSettings,
                 marks: HighWater) -> int | None:
    """The width of the rows that ``long_rows_apart`` trains apart from the longest
    (``short_width``), never narrower than its mark."""
    width = tokens["input_ids"].shape[1]
    split = short_width(tokens["attention_mask"].sum(1), settings.mini_batch_size,
                        settings.micro_batches, settings.pad_multiple, width)
    return None if split is None else min(marks.fit("update/short", split), width)


def _place(local: StepBatch, table: tuple[np.ndarray, np.ndarray] | None,
           episodes: tuple[np.ndarray, np.ndarray, TurnTable | None] | None,
           mesh: Mesh) -> StepBatch:
    """``local`` as this process's shard of global arrays on ``mesh``, with every process's
    prefix table (row = global group id) and episode table (with its turn table, if any),
    replicated (processes in order)."""
    prefixes = None
    if table is not None:
        every = dist.allgather_rows({"input_ids": table[0], "attention_mask": table[1]})
        prefixes = Prefixes(dist.replicated(every["input_ids"], mesh),
                            dist.replicated(every["attention_mask"], mesh))
    if episodes is not None:
        scores, groups, turns = episodes
        table = {} if turns is None else {"rewards": turns.rewards, "penalties": turns.penalties,
                                          "anchors": turns.anchors, "played": turns.played}
        every = {name: dist.replicated(x, mesh) for name, x in dist.allgather_rows(
            {"scores": scores, "group_ids": groups} | table).items()}
        episodes = Episodes(every["scores"], every["group_ids"], None if turns is None else
                            TurnTable(every["rewards"], every["penalties"], every["anchors"],
                                      every["played"]))
    live = dist.replicated(np.asarray(local.live_mini_batches, np.int32), mesh)
    return jax.tree.map(lambda x: dist.global_rows(x, mesh), local.replace(live_mini_batches=None)
                        ).replace(prefixes=prefixes, episodes=episodes, live_mini_batches=live)


def calibrate_widths(marks: HighWater, batch: RolloutBatch, rows: np.ndarray,
                     settings: RowSettings) -> None:
    """Raises the update's width marks to what ``batch``'s ``rows [B] bool`` would need
    (every process's: the widths are global), the way ``build_step_batch`` measures them.
    The trainer calls it with each validation batch's episodes of the envs it trains on: a
    first validation plays many more levels than a training step, so its longest trajectory
    and first prompt set the update's widths before the training steps meet them one at a
    time (each a program compiled mid-run)."""
    mask = batch.attention_mask[rows]
    longest = {"update/width": int(mask.any(0).nonzero()[0].max()) + 1 if mask.any() else 0}
    if settings.share_prefixes:
        lengths = group_prefix_lengths(batch.input_ids, batch.loss_mask, batch.group_ids)
        row_prefix = lengths[batch.group_ids[rows]]
        longest["update/prefix"] = int(row_prefix.max()) if row_prefix.size else 0
        longest["update/suffix"] = int((mask.sum(1) - row_prefix).max()) if row_prefix.size else 0
    _fit_widths(marks, _agree(longest), settings.pad_multiple)


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
