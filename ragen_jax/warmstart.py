"""The warm start: a run's supervised stages before RL, its data and its cache.

A random-init tiny model cannot emit a parsable answer, so RL would learn nothing from it.
Before the first RL step the trainer calls ``WarmStart`` once, which runs, in order:

* the optional SFT stage on chat transcripts (``config.sft``: ``sft.conversation_data``);
* single-turn steps (``warmstart.turns.steps``) on ``turn_observation_rows``: each answered
  turn of scripted episodes, cut out short, which teaches reading the state;
* whole-episode steps (``warmstart.steps``) on ``warmstart_data``: scripted episodes in the
  rollout's own multi-turn chat format, answered with random valid actions
  (``rollout.scripted.RandomActionPolicy``: the format only, ``<answer>Up || Left</answer>``
  and the end-of-turn token) or, with ``solver_share`` > 0, a mixture of the env's optimal
  moves and random legal ones (``SolverMixturePolicy``: a little of the task, as an instruct
  checkpoint knows it a little).

Every stage trains with ``sft.train_sft``. A tiny model's result is kept on disk
(safetensors, ``cache_dir``) under a hash of everything that made it (``cache_inputs``), so
runs of one configuration share one prior: built once, then loaded.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

from ragen_jax.config.schema import RunConfig, WarmstartConfig
from ragen_jax.policy import build_actor, trained
from ragen_jax.progress import Phase
from ragen_jax.rollout.agent import AgentRollout
from ragen_jax.rollout.batch import Episode
from ragen_jax.rollout.config import RolloutConfig
from ragen_jax.rollout.context import ChatFormat
from ragen_jax.rollout.env_driver import row_state
from ragen_jax.rollout.mix import EnvSlot
from ragen_jax.rollout.scripted import RandomActionPolicy, SolverMixturePolicy
from ragen_jax.sft import conversation_data, left_aligned, train_sft

# ----------------------------------------------------------------------------------------------
# The data
# ----------------------------------------------------------------------------------------------


def warmstart_data(env: Any, env_params: Any, tokenizer: Any, config: RolloutConfig,
                   episodes: int, seed: int, *, legal_only: bool = False,
                   solver_share: float = 0.0, metrics: dict | None = None,
                   observation_rows: dict | None = None, system_rows: bool = False,
                   group_size: int = 0, held_out: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Token arrays (``input_ids``, ``attention_mask``, ``position_ids``, ``loss_mask``,
    ``group_ids``) of about ``episodes`` episodes answered by ``RandomActionPolicy``.

    The warm-start must teach the format and no preference: episodes come in groups that
    share an initial state, one per valid action, and each answers its first turn with a
    different action first (later actions and turns are random). Without this balance a
    small model memorizes the sampling noise of a few episodes per prompt (on Bandit it
    started out certain of the wrong arm on some pairs, which RL then cannot undo).

    ``legal_only`` draws every action from those that change the state (the env's
    ``action_is_effective``: no walking into a wall or off the grid), still uniformly and
    with no look-ahead, so nothing about the goal is taught. What it adds is a reason to read
    the state: with purely random answers the policy starts with answers independent of its
    input (I(X;Z) = 0, RAGEN V2's template collapse) and on FrozenLake and Sokoban RL never
    left that point. ``solver_share`` > 0 answers with ``SolverMixturePolicy`` instead (and
    ignores ``legal_only``: its random moves are always legal): each action is the env's
    optimal move with that probability, which is meant to teach the task a little, as an
    instruct checkpoint knows it a little. ``metrics``, when given, receives the generated
    episodes' rollout metrics (without the env tag: ``effective_action_rate``, ``success``, ...);
    ``observation_rows``, when given, receives the same episodes' ``turn_observation_rows``
    (each starting with the system message when ``system_rows``). ``group_size`` > 0 sets the
    episodes per level instead (1: every episode on a level of its own, for data whose policy
    needs no balanced opening, e.g. the solver's rows). ``held_out``: held-out ids
    (``envs.levels.holdout_hash``: levels, Sokoban's rooms) the data never plays (the run's
    validation levels'): a seed drawing one is drawn again.
    """
    rollout = AgentRollout(env, env_params, tokenizer, config)
    if held_out is not None:
        rollout.hold_out(held_out)
    _, first = rollout.reset_envs(np.zeros(1, np.int64))
    n_actions = max(1, len(env.action_names_for(row_state(first, 0))))  # free text: 0 names
    size = group_size or n_actions
    group_seeds = data_seeds(episodes, size, seed)
    if solver_share > 0:
        policy = SolverMixturePolicy(env, env_params, tokenizer, config.context, seed,
                                     solver_share=solver_share)
    else:
        policy = RandomActionPolicy(env, env_params, tokenizer, config.context, seed,
                                    legal_only=legal_only)
    batch = rollout.collect(policy, group_seeds, jax.random.key(seed), group_size=size)
    if batch.metrics[f"{rollout.tag}/format_error_rate"] > 0:
        raise AssertionError("warm-start answers do not parse; the chat format changed?")
    if metrics is not None:
        metrics.update({k.split("/", 1)[-1]: v for k, v in batch.metrics.items()})
    if observation_rows is not None:
        observation_rows.update(turn_observation_rows(batch.episodes, rollout.chat, system=system_rows,
                                                      pad_multiple=config.sampler.prompt_pad_multiple))
    return {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask,
            "position_ids": batch.position_ids, "loss_mask": batch.loss_mask,
            "group_ids": batch.group_ids}


def data_seeds(episodes: int, size: int, seed: int) -> np.ndarray:
    """The group seeds of ``warmstart_data``'s ``episodes`` episodes in groups of ``size``
    (at least one group): a range of warm-start seed ``seed``'s own, far from the training and
    validation seeds."""
    return 2**30 + seed * 100_003 + np.arange(max(1, episodes // size))


def turn_observation_rows(episodes: Sequence[Episode], chat: ChatFormat, *,
                          pad_multiple: int = 64, system: bool = False) -> dict[str, np.ndarray]:
    """Short single-turn rows cut from played episodes: per answered turn, the chunk the
    transcript inserts before it (glue, the turn's user block with its state, the assistant
    header; no system message, no history, no reward line) followed by the answer as
    sampled; ``loss_mask`` on the answer.

    Why: a random-init tiny model learns to read the state from these ~80-token rows in a few
    hundred steps, where the same labels inside ~500-token transcripts taught it nothing in
    as many steps (``experiments/results/learning_curves.md``). The tokens of a row are the
    ones its turn shows inside a transcript (``ChatFormat.next_chunk``), so what is learnt
    there is read off the same text later.

    ``system``: each row starts with the episode's system message instead (the first prompt
    of a rollout, ``ChatFormat.first_chunk``, with the turn's user block): what the policy
    reads at its first turn, the system message included. Rows are then ~4x longer; see
    ``shared_prefix_batches``, which lets ``train_sft`` run that common start once per step."""
    rows, masks = [], []
    for ep in episodes:
        for turn in range(1, len(ep.pieces) // 2 + 1):
            block = ep.blocks[turn - 1]
            text = chat.first_chunk(ep.system, block) if system else chat.next_chunk(block, emitted_eot=True)
            head = chat.encode([text])[0]
            answer = [int(i) for i in ep.answer_ids(turn)]
            rows.append(head + answer)
            masks.append([False] * len(head) + [True] * len(answer))
    if not rows:
        raise ValueError("no answered turn to cut observation rows from")
    return left_aligned(rows, masks, pad_id=chat.pad_id, pad_multiple=pad_multiple)


def shared_prefix_batches(data: dict[str, np.ndarray], size: int, seed: int) -> dict[str, np.ndarray]:
    """``data``'s rows shuffled once and cut into groups of ``size`` (``group_ids``; the
    remainder dropped): ``train_sft`` then draws one whole group per step of ``size`` rows and
    runs the tokens they all start with (the system message) once for the group, exactly
    (``starpo.rows.group_prefix_lengths``). The mini-batches are fixed sets of rows."""
    n = data["input_ids"].shape[0] // size * size
    if n == 0:
        raise ValueError(f"fewer rows ({data['input_ids'].shape[0]}) than one batch of {size}")
    order = np.random.default_rng(seed).permutation(data["input_ids"].shape[0])[:n]
    out = {k: v[order] for k, v in data.items() if k != "group_ids"}
    out["group_ids"] = np.arange(n) // size
    return out


def concat_data(parts: list[dict[str, np.ndarray]], *, pad_id: int) -> dict[str, np.ndarray]:
    """Several ``warmstart_data`` sets (one per env of a mixed run) as one: rows in order,
    right-padded to the widest (``pad_id``, zeros), group ids renumbered (dropped when a set
    has none). ``train_sft`` takes whole groups of one size: when the envs' group sizes
    differ (their action counts), the group ids are dropped and mini-batches take single rows."""
    if len(parts) == 1:
        return parts[0]
    width = max(p["input_ids"].shape[1] for p in parts)
    out = {}
    for k in ("input_ids", "attention_mask", "position_ids", "loss_mask"):
        out[k] = np.concatenate([np.pad(p[k], ((0, 0), (0, width - p[k].shape[1])),
                                        constant_values=pad_id if k == "input_ids" else 0)
                                 for p in parts])
    if any("group_ids" not in p for p in parts):
        return out
    sizes = {p["input_ids"].shape[0] // (int(p["group_ids"].max()) + 1) for p in parts}
    if len(sizes) == 1:
        offsets = np.cumsum([0] + [int(p["group_ids"].max()) + 1 for p in parts])
        out["group_ids"] = np.concatenate([p["group_ids"] + o for p, o in zip(parts, offsets, strict=False)])
    return out


# ----------------------------------------------------------------------------------------------
# The cache: the warm-started tiny model on disk
# ----------------------------------------------------------------------------------------------

# Bump when what a cached prior means changes while ``cache_inputs`` stays the same (the
# scripted policies, the data's layout, the supervised step's arithmetic).
CACHE_VERSION = 2


def cache_dir() -> Path:
    """``$RAGEN_JAX_CACHE``, default ``~/.cache/ragen_jax``."""
    return Path(os.environ.get("RAGEN_JAX_CACHE") or Path.home() / ".cache" / "ragen_jax")


def cache_inputs(run: RunConfig, rollout: RolloutConfig, seed: int, vocab: dict[str, int],
                 held_out: np.ndarray) -> dict[str, Any]:
    """Exactly what determines a tiny model's warm start, and the cache version: its key.

    ``rollout`` is the run's rollout settings (``Resolved.rollout``), ``seed`` the warm
    start's (``WarmstartConfig.seed_for``), ``vocab`` the tokenizer's, ``held_out`` the
    validation levels' held-out ids the data skips. Left out, because they change no warm-start data or
    step: RL's sampling (the scripted policies sample nothing), batch shape (``env_groups``,
    ``group_size``), context window and score placement (the data is the whole transcript:
    ``tests/test_sft.py`` checks it is the same), validation settings (only through the
    held-out levels, which are in), the sampler's memory layout (``sampler.share_prompt_cache``,
    ``sampler.cache_multiple``, ``sampler.paged``, ``sampler.kv_blocks``,
    ``sampler.kv_block_size``) and ``warmstart.cache`` itself.

    Version 1 keys (a ``repr`` of the rollout settings) name other folders: a prior cached
    under one is not found and is simply built again under this key."""
    w = run.warmstart
    return {
        "version": CACHE_VERSION,
        # The architecture, dtypes and kernels: the starting weights and the arithmetic.
        "model": dataclasses.asdict(run.model),
        # The envs played, their parameters, each one's share of the episodes (mix groups,
        # per-env rollout values) and tags (a mixed run's metrics are named by them).
        "env": dataclasses.asdict(run.env),
        # The data's seed and the initial weights' (a tiny model is built from it).
        "seed": seed,
        # How much data of which policy, and the supervised steps on it.
        "warmstart": {"episodes": w.episodes, "legal_actions": w.legal_actions,
                      "solver_share": w.solver_share, "steps": w.steps,
                      "batch_size": w.batch_size, "lr": w.lr},
        # The single-turn rows (their own policy, episodes and form) and their steps.
        "turns": {"steps": w.turns.steps, "batch_size": w.turns.batch_size,
                  "solver_share": w.turn_share, "episodes": w.turns.episodes,
                  "system_prompt": w.turns.system_prompt} if w.turns.steps else None,
        # The episodes' length: turns, actions, tokens; when one ends as too long; the
        # answer budget and stop strings that cut a scripted answer; the rows' padding.
        "episodes": {"max_turn": rollout.max_turn,
                     "max_actions_per_traj": rollout.max_actions_per_traj,
                     "response_length": rollout.response_length,
                     "max_model_len": rollout.max_model_len, "overlong": rollout.window.overlong,
                     "stop_strings": list(rollout.sampling.stop_strings),
                     "pad_multiple": rollout.sampler.prompt_pad_multiple},
        # The prompts' wording and the answers' format and parsing (``ContextConfig``).
        "context": dataclasses.asdict(rollout.context),
        # The tokens every text becomes.
        "vocab": _digest(sorted(vocab.items())),
        # The levels the data never plays (the run's validation levels).
        "held_out": hashlib.sha256(np.sort(held_out).tobytes()).hexdigest(),
    }


def cache_key(inputs: dict[str, Any]) -> str:
    """A short hash of ``cache_inputs``: the name of a cached warm start."""
    return _digest(inputs)[:20]


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def _flat(model: Any) -> dict[str, Any]:
    return {"/".join(map(str, path)): v for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def save_params(model: Any, folder: Path, meta: dict[str, Any]) -> None:
    """Writes ``model``'s parameters (``params.safetensors``) and ``meta`` (``meta.json``)
    into ``folder`` atomically: a reader sees all of it or nothing."""
    tmp = folder.with_name(f"{folder.name}.tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file({k: np.asarray(jax.device_get(v.get_value())) for k, v in _flat(model).items()},
              str(tmp / "params.safetensors"))
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    shutil.rmtree(folder, ignore_errors=True)  # a broken copy (``load_params`` refused it)
    try:
        tmp.rename(folder)
    except OSError:  # another process wrote it meanwhile: keep theirs
        shutil.rmtree(tmp, ignore_errors=True)


def load_params(model: Any, folder: Path) -> dict[str, Any] | None:
    """Loads ``folder``'s parameters into ``model`` in place (shardings kept) and returns its
    meta; ``None`` (model untouched) when the folder is missing, incomplete or of another
    shape."""
    try:
        arrays = load_file(str(folder / "params.safetensors"))
        meta = json.loads((folder / "meta.json").read_text())
    except (OSError, ValueError, SafetensorError):
        return None
    flat = _flat(model)
    if set(arrays) != set(flat) or any(arrays[k].shape != v.get_value().shape for k, v in flat.items()):
        return None
    for k, v in flat.items():
        old = v.get_value()
        v.set_value(jax.device_put(arrays[k].astype(old.dtype), old.sharding))
    return meta


# ----------------------------------------------------------------------------------------------
# The stages
# ----------------------------------------------------------------------------------------------

_STEPS_NOTE = "{} supervised steps (the first one compiles)"


class Outcome(NamedTuple):
    """What ``WarmStart`` returns: the actor (another object when the warm start's seed built
    a new one), the stages' metrics, and the cache folder it was loaded from (None: built)."""

    actor: Any
    metrics: dict[str, float]
    loaded_from: Path | None


@dataclasses.dataclass
class WarmStart:
    """The supervised stages of one run before RL (see the module docstring).

    ``rollout``: the run's rollout settings (``Resolved.rollout``); ``slots``: the run's envs
    (those with training groups make the data); ``held_out``: the validation levels the data
    skips; ``phase(what, total, note)``: a long phase's progress display; ``log``: a line for
    the run's log; ``is_main``: this process writes the cache."""

    run: RunConfig
    rollout: RolloutConfig
    slots: Sequence[EnvSlot]
    tokenizer: Any
    held_out: np.ndarray
    phase: Callable[[str, int | None, str], Phase]
    log: Callable[[str], None]
    is_main: bool = True

    def __call__(self, actor: Any, mesh: Mesh) -> Outcome:
        """Runs the configured stages on ``actor`` (in place; a tiny model whose warm-start
        seed is not the run's is built again from that seed, on ``mesh``)."""
        run, metrics, loaded_from = self.run, {}, None
        if run.sft.steps:
            metrics |= self._chat_sft(actor)
        w = run.warmstart
        if w.steps or w.turns.steps:
            seed = w.seed_for(run.seed)
            tiny = not run.model.path and not run.model.lora_rank and not run.sft.steps
            if tiny and seed != run.seed:
                actor = build_actor(run.model, seed, mesh)
            folder = self.folder(seed) if tiny and w.cache else None
            meta = load_params(actor, folder) if folder else None
            if meta is not None:
                loaded_from = folder
                self.log(f"warm-start loaded from {folder}")
                metrics |= meta  # the metrics of the build, so a run's step 0 reads the same
            else:
                if folder is not None:
                    self.log(f"building the warm-start prior (once for this config, then cached "
                             f"under {folder.parent})")
                metrics |= self._scripted(actor, seed)
                if folder is not None and self.is_main:
                    save_params(actor, folder, metrics)
                    self.log(f"warm-start saved to {folder}")
        return Outcome(actor, metrics, loaded_from)

    def folder(self, seed: int) -> Path:
        """Where this run's warm-started tiny model of warm-start seed ``seed`` is cached."""
        key = cache_key(cache_inputs(self.run, self.rollout, seed, self.tokenizer.get_vocab(),
                                     self.held_out))
        name = "mixed" if self.run.env.mix else self.run.env.name
        return cache_dir() / f"warmstart-{name}-{key}"

    def _chat_sft(self, actor: Any) -> dict[str, float]:
        """The SFT stage on ``sft.data``'s chat transcripts."""
        run = self.run
        data = conversation_data(run.sft.data, self.tokenizer, max_len=run.rollout.max_model_len)
        with self.phase("SFT on " + Path(run.sft.data).name, run.sft.steps,
                        _STEPS_NOTE.format(run.sft.steps)) as phase:
            losses = train_sft(actor, data, steps=run.sft.steps, batch_size=run.sft.batch_size,
                               lr=run.sft.lr, progress=_loss_progress(phase), **self._fit(run.seed))
        return {"sft/loss_first": losses[0], "sft/loss_last": losses[-1]}

    def _scripted(self, actor: Any, seed: int) -> dict[str, float]:
        """The warm start on the run's training envs: their data, then the single-turn and
        whole-episode steps."""
        w, pad_id = self.run.warmstart, self.tokenizer.pad_token_id or 0
        parts, turns, metrics = self._data(w, seed)
        if w.turns.steps:  # single-turn observation rows first (turn_observation_rows)
            with self.phase("warm-start, single turns", w.turns.steps,
                            _STEPS_NOTE.format(w.turns.steps)) as phase:
                losses = train_sft(actor, concat_data(turns, pad_id=pad_id), steps=w.turns.steps,
                                   batch_size=w.turns.batch_size, lr=w.lr,
                                   progress=_loss_progress(phase), **self._fit(seed))
            metrics |= {"warmstart/turn_loss_first": losses[0], "warmstart/turn_loss_last": losses[-1]}
        if w.steps:
            with self.phase("warm-start", w.steps, _STEPS_NOTE.format(w.steps)) as phase:
                losses = train_sft(actor, concat_data(parts, pad_id=pad_id), steps=w.steps,
                                   batch_size=w.batch_size, lr=w.lr,
                                   progress=_loss_progress(phase), **self._fit(seed))
            metrics |= {"warmstart/loss_first": losses[0], "warmstart/loss_last": losses[-1]}
        return metrics

    def _data(self, w: WarmstartConfig, seed: int
              ) -> tuple[list[dict[str, np.ndarray]], list[dict[str, np.ndarray]], dict[str, float]]:
        """Every training env's whole-episode data and single-turn rows, and the data's
        metrics. With several envs (``env.mix``) each plays its share of the episodes, in
        proportion to its groups, and the model trains on the mixture (``concat_data``)."""
        slots = [s for s in self.slots if s.groups]
        total = sum(s.groups for s in slots)
        parts, stats, turns = [], [], []
        episodes = w.episodes + (w.turns.episodes if w.own_turn_data else 0)
        data_phase = self.phase("warm-start data", None, f"playing ~{episodes} scripted episodes")
        for slot in slots:
            share = lambda n, groups=slot.groups: max(1, round(n * groups / total))  # noqa: E731  (this env's part of n episodes)
            stats.append({})
            turns.append({} if w.turns.steps else None)
            data = dict(env=slot.rollout.env, env_params=slot.rollout.env_params, tokenizer=self.tokenizer,
                        config=slot.rollout.config, seed=seed, legal_only=w.legal_actions,
                        episodes=share(w.episodes), held_out=self.held_out)
            parts.append(warmstart_data(**data, solver_share=w.solver_share, metrics=stats[-1],
                                        observation_rows=None if w.own_turn_data else turns[-1]))
            if w.own_turn_data:  # the single-turn rows' own episodes and form
                own = {"seed": seed + 1} | ({"episodes": share(w.turns.episodes), "group_size": 1}
                                            if w.turns.episodes else {})
                warmstart_data(**data | own, solver_share=w.turn_share,
                               observation_rows=turns[-1], system_rows=w.turns.system_prompt)
                if w.turns.system_prompt:
                    turns[-1] |= shared_prefix_batches(turns[-1], w.turns.batch_size, seed)
        data_phase.close()
        return parts, turns, _data_metrics(slots, parts, stats)

    def _fit(self, seed: int) -> dict[str, Any]:
        """``train_sft``'s arguments shared by every stage."""
        return {"seed": seed, "trainable": trained(self.run.model)}


def _data_metrics(slots: list[EnvSlot], parts: list[dict[str, np.ndarray]],
                  stats: list[dict[str, float]]) -> dict[str, float]:
    """The scripted data's ``effective_action_rate`` (effective / executed actions) and
    success: with several envs, each one's, and the mean over all their episodes."""
    rows = np.array([p["input_ids"].shape[0] for p in parts], np.float64)
    out = {}
    for name, key in (("effective_action_rate", "effective_action_rate"), ("data_success", "success")):
        values = np.array([st[key] for st in stats])
        out[f"warmstart/{name}"] = float(values[0] if len(slots) == 1 else values @ rows / rows.sum())
        if len(slots) > 1:
            out |= {f"warmstart/{slot.tag}/{name}": float(v) for slot, v in zip(slots, values, strict=True)}
    return out


def _loss_progress(phase: Phase) -> Callable[[int, float], None]:
    """``train_sft``'s ``progress`` callback: each step's loss on ``phase``."""
    return lambda done, loss: phase.update(done, f"loss {loss:.4f}")
