"""Supervised stages before RL: the warm-start and SFT on chat trajectories.

* ``warmstart_data``: plays the env through the same multi-turn rollout and chat format as
  RL, answering with *random valid actions* (``rollout.scripted.RandomActionPolicy``: the
  policy learns only the answer format, ``<answer>Up || Left</answer>`` and the end-of-turn
  token, not the task; a random-init model cannot emit a parsable answer without it) or,
  with ``solver_share`` > 0, with a mixture of the env's optimal moves and random legal ones
  (``SolverMixturePolicy``: meant as an instruct-like starting policy for the tiny model; an
  option, not yet a preset default, see the README).
* ``cache_key`` / ``save_params`` / ``load_params``: the warm-started tiny model kept on
  disk (safetensors) under a hash of everything that made it, so runs share one prior.
* ``conversation_data``: a JSONL of chat trajectories (``{"messages": [{"role", "content"},
  ...]}``, system first; the ``trajectories.jsonl`` our evaluation writes qualifies), tokenised
  with the model's chat template; the loss covers assistant contents and their end-of-turn.
* ``train_sft``: token-level cross-entropy on the masked tokens, AdamW, jitted.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

from ragen_jax.rollout.agent import AgentRollout
from ragen_jax.rollout.batch import Episode, position_ids
from ragen_jax.rollout.config import RolloutConfig
from ragen_jax.rollout.context import ChatFormat
from ragen_jax.rollout.env_driver import row_state
from ragen_jax.rollout.scripted import RandomActionPolicy, SolverMixturePolicy
from ragen_jax.starpo.optimizer_step import Prefixes
from ragen_jax.starpo.rows import after_prefix, group_prefix_lengths, prefix_table
from ragen_jax.starpo.token_scores import token_logprobs


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
    episodes' rollout metrics (without the env tag: ``action_is_effective``, ``success``, ...);
    ``observation_rows``, when given, receives the same episodes' ``turn_observation_rows``
    (each starting with the system message when ``system_rows``). ``group_size`` > 0 sets the
    episodes per level instead (1: every episode on a level of its own, for data whose policy
    needs no balanced opening, e.g. the solver's rows). ``held_out``: level ids
    (``envs.levels``) the data never plays (the run's validation levels): a seed drawing one
    is drawn again.
    """
    rollout = AgentRollout(env, env_params, tokenizer, config)
    if held_out is not None:
        rollout.hold_out(held_out)
    _, first = rollout.reset_envs(np.zeros(1, np.int64))
    n_actions = max(1, len(env.action_names_for(row_state(first, 0))))  # free text: 0 names
    size = group_size or n_actions
    groups = max(1, episodes // size)
    group_seeds = 2**30 + seed * 100_003 + np.arange(groups)  # far from train/val seeds
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
    return _left_aligned(rows, masks, pad_id=chat.pad_id, pad_multiple=pad_multiple)


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
    right-padded to the widest (``pad_id``, zeros), group ids renumbered (dropped when a set has none). ``train_sft`` takes
    whole groups of one size: when the envs' group sizes differ (their action counts), the
    group ids are dropped and mini-batches take single rows."""
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


def conversation_data(path: str | os.PathLike, tokenizer: Any, *, max_len: int,
                      pad_multiple: int = 64) -> dict[str, np.ndarray]:
    """Token arrays from a JSONL of ``{"messages": [...]}`` conversations (see module doc).
    Conversations longer than ``max_len`` tokens are cut there."""
    chat = ChatFormat(tokenizer, dataclasses.replace(RolloutConfig().context, prefill_tag=False))
    rows, masks = [], []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            messages = json.loads(line)["messages"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"sft.data: {path} line {n}: not a {{'messages': [...]}} object ({e})") from None
        roles = [m.get("role") for m in messages]
        if len(roles) < 3 or roles[0] != "system" or any(
                r != ("user" if i % 2 else "assistant") for i, r in enumerate(roles[1:], 1)):
            raise ValueError(f"sft.data: {path} line {n}: roles must be system, user, assistant, "
                             f"user, ... (got {roles})")
        pieces = [(chat.prefix + messages[0]["content"] + chat.system_to_user, False)]
        for i, m in enumerate(messages[1:], 1):
            if m["role"] == "user":
                glue = "" if i == 1 else chat.assistant_to_user
                pieces.append((glue + m["content"] + chat.user_to_assistant, False))
            else:
                pieces.append((m["content"] + chat.eot_text, True))
        ids, mask = [], []
        for text, trained in pieces:
            t = tokenizer(text, add_special_tokens=False)["input_ids"]
            ids += t
            mask += [trained] * len(t)
        rows.append(ids[:max_len])
        masks.append(mask[:max_len])
    if not rows:
        raise ValueError(f"sft.data: {path} holds no conversation")
    return _left_aligned(rows, masks, pad_id=chat.pad_id, pad_multiple=pad_multiple)


def _left_aligned(rows: list[list[int]], masks: list[list[bool]], *, pad_id: int,
                  pad_multiple: int) -> dict[str, np.ndarray]:
    """Token rows as left-aligned ``[N, L]`` arrays (``L`` a multiple of ``pad_multiple``),
    the loss on ``masks``."""
    width = -(-max(map(len, rows)) // pad_multiple) * pad_multiple
    out = {"input_ids": np.full((len(rows), width), pad_id, np.int32),
           "attention_mask": np.zeros((len(rows), width), bool),
           "loss_mask": np.zeros((len(rows), width), bool)}
    for b, (r, m) in enumerate(zip(rows, masks, strict=True)):
        out["input_ids"][b, :len(r)] = r
        out["attention_mask"][b, :len(r)] = True
        out["loss_mask"][b, :len(r)] = m
    out["position_ids"] = position_ids(out["attention_mask"])
    return out


def sft_loss(model: Any, batch: dict[str, jax.Array], prefixes: Prefixes | None = None
             ) -> jax.Array:
    """Mean negative log-likelihood of the ``loss_mask`` tokens (of the rows continuing
    ``prefixes[batch["prefix_index"]]``, when given)."""
    mask = batch["loss_mask"].astype(jnp.float32)
    prefix = None
    if prefixes is not None:
        prefix = prefixes.run(model).take(batch["prefix_index"])
    logp, _ = token_logprobs(model, batch["input_ids"], batch["attention_mask"],
                             batch["position_ids"], loss_mask=mask, prefix=prefix)
    return -jnp.sum(logp * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def _on_params_mesh(tree: Any, params: Any) -> Any:
    """``tree`` with every leaf that is not on a mesh replicated on the mesh of ``params``.

    The step returns its optimizer state on that mesh; an optimizer state made outside it
    (AdamW's scalar step count) would differ from the step's output in type, and the second
    step would compile the whole program again."""
    meshes = [x.sharding.mesh for x in jax.tree.leaves(params)
              if isinstance(getattr(x, "sharding", None), NamedSharding)]
    if not meshes:
        return tree
    replicated = NamedSharding(meshes[0], PartitionSpec())
    return jax.tree.map(lambda x: x if isinstance(getattr(x, "sharding", None), NamedSharding)
                        else jax.device_put(x, replicated), tree)


def train_sft(model: Any, data: dict[str, np.ndarray], *, steps: int, batch_size: int, lr: float,
              seed: int, trainable: Any = nnx.Param, log: Any = None,
              share_prefix: bool = True,
              progress: Callable[[int, float], None] | None = None) -> list[float]:
    """``steps`` AdamW steps on random mini-batches of ``data``; updates ``model`` in place
    and returns the loss per step. ``trainable`` is the NNX filter of trained variables
    (``nnx.LoRAParam`` with adapters). With ``data["group_ids"]`` (rows of a group
    contiguous, equal sizes) mini-batches take whole groups: the warm-start's answers to one
    prompt then meet in one gradient, whose preference terms cancel; each group's common
    first prompt then runs once per step (``starpo.rows.group_prefix_lengths``, exact).
    ``progress(done, loss)`` is called after every step (a run's progress bar); without it,
    ``log`` gets a line at each fifth of the steps."""
    graphdef, params, rest = nnx.split(model, trainable, ...)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(lr, weight_decay=0.0))
    opt_state = _on_params_mesh(optimizer.init(params), params)

    @jax.jit
    def step(params, opt_state, batch, prefixes):
        loss, grads = jax.value_and_grad(
            lambda p: sft_loss(nnx.merge(graphdef, p, rest), batch, prefixes))(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    rng = np.random.default_rng(seed)
    groups = data.get("group_ids")
    data = {k: v for k, v in data.items() if k != "group_ids"}
    n = data["input_ids"].shape[0]
    size = 1 if groups is None else n // (int(groups.max()) + 1)
    table = None
    if groups is not None and share_prefix:  # rows: what follows their group's prompt
        lengths = group_prefix_lengths(data["input_ids"], data["loss_mask"], groups)
        suffix = data["attention_mask"].sum(1) - lengths[groups]
        table = prefix_table(data["input_ids"], lengths, groups, int(lengths.max()))
        data = after_prefix(data, lengths[groups], int(suffix.max()))
    # Trim the common padding so the step compiles for the data's real width only.
    width = int(data["attention_mask"].any(0).nonzero()[0].max()) + 1
    losses = []
    for i in range(steps):
        k = max(1, batch_size // size)
        picked = rng.choice(n // size, size=min(k, n // size), replace=False)
        idx = (picked[:, None] * size + np.arange(size)).reshape(-1)
        batch = {k: jnp.asarray(v[idx, :width]) for k, v in data.items()}
        prefixes = None
        if table is not None:
            batch["prefix_index"] = jnp.repeat(jnp.arange(picked.size), size)
            prefixes = Prefixes(jnp.asarray(table[0][picked]), jnp.asarray(table[1][picked]))
        params, opt_state, loss = step(params, opt_state, batch, prefixes)
        losses.append(float(loss))
        if progress is not None:
            progress(i + 1, losses[-1])
        elif log is not None and (i + 1) % max(steps // 5, 1) == 0:
            log(f"sft step {i + 1}/{steps}: loss {losses[-1]:.4f}")
    nnx.update(model, params)
    return losses


# ----------------------------------------------------------------------------------------------
# The warm-started model on disk
# ----------------------------------------------------------------------------------------------

CACHE_FORMAT = 1  # bump when what a cached prior means changes without its inputs changing


def cache_dir() -> Path:
    """``$RAGEN_JAX_CACHE``, default ``~/.cache/ragen_jax``."""
    return Path(os.environ.get("RAGEN_JAX_CACHE") or Path.home() / ".cache" / "ragen_jax")


def cache_key(**inputs: Any) -> str:
    """A short hash of ``inputs`` (JSON-able after ``repr`` of the odd value): the name of a
    cached warm-start, which changes whenever anything that made it changes."""
    text = json.dumps({"format": CACHE_FORMAT, **inputs}, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


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
