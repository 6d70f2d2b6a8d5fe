"""Whether a run's lengths and batch sizes fit its model and its machine, checked at its start.

``check_run`` runs before the model is built (``train.run``, after the backend is up): a
``rollout.max_model_len`` past the folder's ``max_position_embeddings`` is a ``ConfigError``,
and so is a batch whose memory cannot fit; one that may not fit is a warning line of the start
summary. A batch nothing checked (``rollout.group_size=1000000``) otherwise grew until the
kernel killed the process, ~20 GB later.

The estimate is simple and coarse on purpose: its terms are the ones that grow with the
config's batch sizes and lengths, in bytes (P parameters, P_t of them trained: all, or LoRA's
adapters; p and c the bytes of ``model.param_dtype`` and of the compute dtype):

* **weights**: P x (p + c), the master weights and the sampler's copy, plus P_t x 8, AdamW's
  two float32 moments; a critic (GAE) adds P x (p + 8) for its backbone, a frozen reference
  (``algorithm.kl_coef > 0``, full fine-tuning) P x p. (The 1.5B Sokoban preset's measured
  37.4 GiB of weights, moments and sampling copy on an H200, docs/scaling.md, is this term.)
* **rollout**: the sampler's KV cache, rows x tokens x 2 (keys and values) x layers x KV
  heads x head dim x c, for the larger batch: training (``rollout.env_groups x
  rollout.group_size``) or validation (every env's ``val_groups`` x ``rollout.val.group_size``).
* **update**: one pass of ``actor.ppo_mini_batch_size / actor.micro_batches`` rows x tokens,
  each token keeping layers x v values in c for the backward pass (``model.remat``: ``none``
  6 hidden + 3 intermediate, ``dots`` the weight matmuls' outputs, ~4 hidden + 2
  intermediate, ``full`` 2 hidden), plus the float32 logits of one chunk of positions with
  their softmax and gradient, 3 x 4 x min(rows x tokens x vocab, ``MAX_CHUNK_LOGITS``)
  (``starpo.token_scores`` never holds more), and the trained weights' gradient, P_t x p.
* **host**: the batch's token arrays on the host, rows x tokens x 16 bytes (ids, masks,
  positions, log-probs), and every step's turn table (``starpo.anchors.turn_table``, made
  whatever the estimator), training rows x the run's largest ``rollout.max_turn`` x
  ``TURN_TABLE_BYTES``.

Each is taken at two token counts a row. The lower, ``rollout.response_length``: every row's
slots in the decode loop's cache hold at least its answer budget, and every update row is
padded to a multiple of the update's width step (``shapes.update_multiple``: with
``actor.row_pad_multiple=0`` an eighth of ``rollout.max_model_len``), so the update pass is
taken at that width; this is memory the run surely needs, and past the memory there is the
run is refused at its start, naming the field that dominates (``rollout.max_model_len=2**40``
and ``rollout.max_turn=10**9`` ran out of memory a minute later otherwise). The typical, a first prompt
of ``PROMPT_TOKENS`` plus ``rollout.max_turn`` turns of ``TURN_TOKENS`` and an answer budget
each (at most ``rollout.max_model_len``): past the memory there is, the start summary warns.
(``max_model_len`` itself would warn on every run of presets whose episodes stay far below
it, such as the CPU presets' 3,600 tokens.) The memory there is: every device's
allocator limit added up (XLA's share of a GPU), and the host's RAM (the cgroup's limit when
lower) for the host's part; on XLA:CPU one pool, the RAM, for all of it.

Not counted: attention scores (a T x T matrix per head with ``model.attention_impl=xla``),
the collapse diagnostics' scoring (``diagnostics.micro_batch_tokens`` bounds it), what a mesh
replicates (the pool is the job's, not one device's: a run that passes can still run out on
one device; per-device numbers are in docs/scaling.md) and everything below these terms. It
catches the impossible, not the tight.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import jax
import numpy as np

from ragen_jax.config.fields import ConfigError
from ragen_jax.config.resolve import Resolved
from ragen_jax.config.schema import DTYPES, compute_dtype
from ragen_jax.models import QwenConfig
from ragen_jax.shapes import update_multiple
from ragen_jax.starpo.token_scores import MAX_CHUNK_LOGITS

GIB = 2**30
HOST_BYTES_PER_TOKEN = 16  # int32 ids, attention and loss masks, positions, float32 log-probs
# A turn table's cell: float32 reward and penalty, uint64 anchor id, bool played, the id's two
# uint32 lanes.
TURN_TABLE_BYTES = 25
# A typical row's prompt, in round figures: the system message and first state (~200 tokens
# in the tiny Bandit run's trajectories), then per turn its state, warning and budget line.
PROMPT_TOKENS = 256
TURN_TOKENS = 128


def gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def _n(count: int, word: str) -> str:
    return f"{count} {word}" + ("" if count == 1 else "s")


def architecture(plan: Resolved) -> QwenConfig:
    """The run's model shapes: the folder's ``config.json`` or the tiny model's fields."""
    from ragen_jax.models.weights import load_config as load_model_config
    from ragen_jax.policy import tiny_config

    model = plan.run.model
    return load_model_config(model.path) if model.path else tiny_config(model)


def parameters(arch: QwenConfig, lora_rank: int = 0) -> tuple[int, int]:
    """``(all, trained)`` parameter counts of ``arch``: every weight, and the weights an
    update trains (all of them, or with ``lora_rank`` the adapters of every linear layer)."""
    h, i, layers = arch.hidden_size, arch.intermediate_size, arch.num_hidden_layers
    d = arch.head_dim or h // arch.num_attention_heads
    q, kv = arch.num_attention_heads * d, arch.num_key_value_heads * d
    # (in, out) of each linear layer of a decoder layer: q, k, v, o, gate, up, down
    linears = [(h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h)]
    per_layer = sum(a * b for a, b in linears) + q + 2 * kv + 2 * h  # + q/k/v biases, norms
    total = layers * per_layer + arch.vocab_size * h * (1 if arch.tie_word_embeddings else 2) + h
    trained = layers * lora_rank * sum(a + b for a, b in linears) if lora_rank else total
    return total, trained


@dataclasses.dataclass(frozen=True)
class Estimate:
    """The estimate's terms in bytes (see the module docstring) at one token count."""

    tokens: int  # tokens a row is taken to hold
    rows: int  # rows of the rollout's larger batch
    rows_field: str  # the fields that set them
    pass_rows: int  # rows of one update pass
    update_tokens: int  # tokens of one update row
    turns: int  # the turn table's turns (the run's largest rollout.max_turn)
    weights: int
    rollout: int
    update: int
    host: int  # the token arrays and the turn table
    turn_table: int  # (of host)

    @property
    def total(self) -> int:
        return self.weights + self.rollout + self.update + self.host

    def parts(self) -> str:
        """The terms, in words."""
        update = (f", update pass {gib(self.update)} ({_n(self.pass_rows, 'row')} of "
                  f"{_n(self.update_tokens, 'token')})" if self.update else "")
        return (f"weights and optimizer {gib(self.weights)}, rollout KV cache "
                f"{gib(self.rollout)} ({_n(self.rows, 'row')} of {_n(self.tokens, 'token')})"
                f"{update}, host batch {gib(self.host - self.turn_table)}, turn table "
                f"{gib(self.turn_table)} ({_n(self.turns, 'turn')})")


def estimate(plan: Resolved, arch: QwenConfig, tokens: int, *, update: bool = True,
             update_tokens: int | None = None, backend: str | None = None) -> Estimate:
    """The memory of ``plan``'s run on ``arch`` with ``tokens`` tokens a row (``update``:
    with the update's pass, its rows ``update_tokens`` long, default ``tokens``)."""
    run = plan.run
    p = np.dtype(DTYPES[run.model.param_dtype]).itemsize
    c = np.dtype(DTYPES[compute_dtype(run.model, backend)[0]]).itemsize
    total, trained = parameters(arch, run.model.lora_rank)
    weights = total * (p + c) + trained * 8
    if plan.step.critic is not None:
        weights += total * (p + 8)
    if plan.step.reference == "frozen_copy":
        weights += total * p
    r = plan.rollout
    val_groups = sum(e.val_groups for e in plan.envs)  # every env's, validated in one batch
    train_rows, val_rows = r.env_groups * r.group_size, val_groups * r.val.group_size
    rows, field = ((train_rows, f"rollout.env_groups x rollout.group_size = {r.env_groups} x "
                                f"{r.group_size}") if train_rows >= val_rows else
                   (val_rows, f"rollout.val.env_groups x rollout.val.group_size = {val_groups} x "
                              f"{r.val.group_size}"))
    d = arch.head_dim or arch.hidden_size // arch.num_attention_heads
    kv_per_token = 2 * arch.num_hidden_layers * arch.num_key_value_heads * d * c
    pass_rows = max(1, run.actor.ppo_mini_batch_size // run.actor.micro_batches)
    h, i = arch.hidden_size, arch.intermediate_size
    kept = {"full": 2 * h, "dots": 4 * h + 2 * i}.get(run.model.remat, 6 * h + 3 * i)
    width = tokens if update_tokens is None else update_tokens
    activations = pass_rows * width * arch.num_hidden_layers * kept * c
    logits = 3 * 4 * min(pass_rows * width * arch.vocab_size, MAX_CHUNK_LOGITS)
    turns = max(plan.rollout_for(e).max_turn for e in plan.envs)
    turn_table = train_rows * turns * TURN_TABLE_BYTES
    return Estimate(tokens=tokens, rows=rows, rows_field=field, pass_rows=pass_rows,
                    update_tokens=width, turns=turns, weights=weights,
                    rollout=rows * tokens * kv_per_token,
                    update=activations + logits + trained * p if update else 0,
                    host=rows * tokens * HOST_BYTES_PER_TOKEN + turn_table, turn_table=turn_table)


def host_memory() -> int:
    """Bytes of RAM this process may use: the machine's, or its cgroup's limit if lower."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            ram = min(ram, int(text))
    return ram


def device_memory(devices: list[Any] | None = None) -> int | None:
    """The job's device memory (each local device's allocator limit, times the processes),
    or None where devices report none (XLA:CPU: they use the host's RAM)."""
    devices = jax.local_devices() if devices is None else devices
    limits = [(d.memory_stats() or {}).get("bytes_limit") for d in devices]
    if not limits or any(x is None for x in limits):
        return None
    return int(sum(limits)) * jax.process_count()


def verdict(plan: Resolved, arch: QwenConfig, devices_bytes: int | None, host_bytes: int,
            backend: str | None = None) -> str | None:
    """Raises ``ConfigError`` when the lower estimate exceeds the memory there is (naming the
    field that dominates it, with the estimate); returns the warning line when the upper one
    does, else None. ``devices_bytes`` None: one pool, the host's ``host_bytes``."""
    r = plan.rollout
    width = update_multiple(plan.run.actor.row_pad_multiple, r.max_model_len)
    low = estimate(plan, arch, r.response_length, update_tokens=width, backend=backend)
    typical = min(r.max_model_len, PROMPT_TOKENS + r.max_turn * (TURN_TOKENS + r.response_length))
    high = estimate(plan, arch, typical, backend=backend)

    def over(e: Estimate) -> tuple[int, int, str] | None:
        """(needed, available, where) of the first pool ``e`` does not fit, else None."""
        if devices_bytes is None:
            pools = [(e.total, host_bytes, "host memory (XLA:CPU's devices use it)")]
        else:
            pools = [(e.total - e.host, devices_bytes, "device memory"),
                     (e.host, host_bytes, "host memory")]
        return next(((need, have, where) for need, have, where in pools if need > have), None)

    failed = over(low)
    if failed:
        need, have, where = failed
        big = max(("weights", low.weights), ("rollout", low.rollout), ("update", low.update),
                  ("host", low.host - low.turn_table), ("turns", low.turn_table),
                  key=lambda kv: kv[1])[0]
        field = {
            "weights": "model (its weights and optimizer state; mesh.fsdp shards them, "
                       "model.lora_rank trains adapters only)",
            "update": (f"rollout.max_model_len={r.max_model_len} (an update row is padded to "
                       f"a multiple of {width} tokens: actor.row_pad_multiple, or with 0 an "
                       f"eighth of it)"),
            "turns": (f"rollout.max_turn={low.turns} (the turn table holds "
                      f"{r.env_groups * r.group_size} episodes x {low.turns} turns)"),
        }.get(big, f"{low.rows_field} = {low.rows} rows")
        raise ConfigError(f"{field}: the run needs at least {gib(need)} of {where}, which has "
                          f"{gib(have)} ({low.parts()}; estimate: ragen_jax/budget.py)")
    failed = over(high)
    if failed:
        need, have, where = failed
        return (f"about {gib(need)} of {where}, which has {gib(have)}: it may not fit; lower "
                f"{high.rows_field} ({high.rows} rows) or the update pass's rows (actor."
                f"ppo_mini_batch_size / actor.micro_batches) ({high.parts()}; estimate: "
                f"ragen_jax/budget.py)")
    return None


def check_run(plan: Resolved, devices: list[Any] | None = None) -> str | None:
    """The start's checks (see the module docstring): raises ``ConfigError`` for a length past
    the model's positions or a batch that cannot fit; returns a warning line or None."""
    arch = architecture(plan)
    r = plan.rollout
    if plan.run.model.path and r.max_model_len > arch.max_position_embeddings:
        raise ConfigError(f"rollout.max_model_len={r.max_model_len} exceeds the model's "
                          f"max_position_embeddings={arch.max_position_embeddings} "
                          f"({plan.run.model.path}/config.json)")
    backend = (devices[0].platform if devices else None) or jax.default_backend()
    return verdict(plan, arch, device_memory(devices), host_memory(), backend)
