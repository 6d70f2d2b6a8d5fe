"""Supervised fine-tuning: SFT on chat trajectories, and the supervised step every stage before
RL uses (the warm start's, ``ragen_jax.warmstart``, included).

* ``conversation_data``: a JSONL of chat trajectories (``{"messages": [{"role", "content"},
  ...]}``, system first; the ``trajectories.jsonl`` our evaluation writes qualifies), tokenised
  with the model's chat template; the loss covers assistant contents and their end-of-turn.
* ``train_sft``: token-level cross-entropy on the masked tokens, AdamW, jitted.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from ragen_jax.rollout.batch import position_ids
from ragen_jax.rollout.config import RolloutConfig
from ragen_jax.rollout.context import ChatFormat
from ragen_jax.starpo.optimizer_step import Prefixes
from ragen_jax.starpo.rows import after_prefix, group_prefix_lengths, prefix_table
from ragen_jax.starpo.token_scores import token_logprobs


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
    return left_aligned(rows, masks, pad_id=chat.pad_id, pad_multiple=pad_multiple)


def left_aligned(rows: list[list[int]], masks: list[list[bool]], *, pad_id: int,
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
    init, step = _sft_step(graphdef, float(lr))
    opt_state = _on_params_mesh(init(params), params)

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
            batch["prefix_index"] = jnp.asarray(np.repeat(np.arange(picked.size, dtype=np.int32), size))
            prefixes = Prefixes(jnp.asarray(table[0][picked]), jnp.asarray(table[1][picked]))
        params, opt_state, loss = step(params, rest, opt_state, batch, prefixes)
        losses.append(float(loss))
        if progress is not None:
            progress(i + 1, losses[-1])
        elif log is not None and (i + 1) % max(steps // 5, 1) == 0:
            log(f"sft step {i + 1}/{steps}: loss {losses[-1]:.4f}")
    nnx.update(model, params)
    return losses


@functools.lru_cache(maxsize=8)
def _sft_step(graphdef: Any, lr: float) -> tuple[Callable, Callable]:
    """``(init(params) -> opt_state, step(params, rest, opt_state, batch, prefixes) ->
    (params, opt_state, loss))``, jitted, one pair per graph definition and learning rate:
    every stage and every run of a process that trains one architecture at one rate (the warm
    start's stages, a resumed run) traces and compiles them once. The untrained variables
    ``rest`` are an argument, not constants of the program."""
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(lr, weight_decay=0.0))

    @jax.jit
    def step(params, rest, opt_state, batch, prefixes):
        loss, grads = jax.value_and_grad(
            lambda p: sft_loss(nnx.merge(graphdef, p, rest), batch, prefixes))(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(optimizer.init), step
