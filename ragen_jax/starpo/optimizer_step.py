"""One optimizer step of the actor or the critic, and the objectives it minimises.

Pieces, each a small function unit-tested on its own:

* ``actor_objective`` (clipped PPO surrogate, entropy bonus, optional KL to a reference) and
  ``critic_objective`` (clipped value loss), over a ``TrainBatch`` / ``CriticBatch``.
* ``make_optimizer_step(graphdef, config)``: the pure step: the objective's gradient
  aggregated exactly over ``micro_batches`` gradient-accumulation chunks, then optax
  (global-norm clipping, Adam, decoupled weight decay) wrapped in ``optax.apply_if_finite``
  so that a non-finite loss or gradient skips the update and is counted instead of poisoning
  the weights; ``jit_optimizer_step`` is it jitted. The learning rate is an argument of the
  step (``learning_rate(config, training_step)``), so schedules count training steps, as
  veRL's scheduler does, whatever the number of mini-batches a filtered batch yields.
* ``mini_batch_epochs``: ``ppo_epochs`` passes of mini-batch steps as one ``lax.scan``.

A whole training step (old log-probs, advantages, critic and actor epochs) is built from
these by ``starpo.update.make_update``.

Sharding: with ``mesh`` given, batches are pinned to ``("data", "fsdp")`` and new parameters
to their NNX partition specs (``with_sharding_constraint``), so XLA keeps parameters,
gradients and optimizer state sharded the same way on 1 device, 8 simulated devices or a pod.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from ragen_jax.models.kv_cache import positions_from_mask
from ragen_jax.models.placement import param_shardings
from ragen_jax.models.qwen import Qwen2ForCausalLM, Qwen2ForValue, SharedPrefix
from ragen_jax.sharding import batch_sharding
from ragen_jax.starpo import losses
from ragen_jax.starpo.token_scores import token_logprobs


@dataclasses.dataclass(frozen=True, kw_only=True)
class UpdateConfig:
    """One role's optimisation settings, resolved from the run config by
    ``config.resolve.resolve``, which gives every field without a default here (its default is
    the run config's: ``config.resolve.update_settings`` gives the default run's, for direct
    use in tests and benchmarks). ``total_steps`` and ``warmup_steps`` count training steps."""

    lr: float
    lr_schedule: str  # "constant" or "cosine": linear warmup, cosine decay to 0
    warmup_steps: int
    total_steps: int = 0  # optimizer steps, for "cosine"
    b1: float = 0.9
    b2: float = 0.999
    weight_decay: float
    grad_clip: float
    clip_low: float
    clip_high: float
    clip_c: float
    entropy_coeff: float
    kl_coef: float
    kl_estimator: str
    loss_agg_mode: str
    micro_batches: int
    temperature: float
    value_clip: float  # critic only
    max_consecutive_nonfinite: int = 1000

    def __post_init__(self):
        if self.loss_agg_mode not in losses.AGG_MODES:
            raise ValueError(f"update.loss_agg_mode must be one of {losses.AGG_MODES}, got {self.loss_agg_mode!r}")
        if self.kl_estimator not in losses.KL_ESTIMATORS:
            raise ValueError(f"update.kl_estimator must be one of {losses.KL_ESTIMATORS}, got {self.kl_estimator!r}")
        if self.lr_schedule not in ("constant", "cosine"):
            raise ValueError(f"update.lr_schedule must be 'constant' or 'cosine', got {self.lr_schedule!r}")
        if self.lr_schedule == "cosine" and self.total_steps <= self.warmup_steps:
            raise ValueError("update.total_steps must exceed update.warmup_steps for the cosine schedule")
        if self.micro_batches < 1:
            raise ValueError(f"update.micro_batches must be >= 1, got {self.micro_batches}")
        if not self.temperature > 0:
            raise ValueError(f"rollout.sampling.temperature must be > 0 for training (the update divides "
                             f"the logits by it), got {self.temperature}; validation may be "
                             "greedy with rollout.val.temperature=0")



@flax.struct.dataclass
class TrainBatch:
    """One update's data, ``[B, L]`` over token slots (real tokens form a prefix per row).

    ``loss_mask`` is 1 on sampled tokens (times any filter weight); ``old_logp`` the log-probs
    the sampler recorded (or recomputed before the update), ``ref_logp`` the reference
    policy's (None when the run has no reference)."""

    input_ids: jax.Array  # [B, L] int32
    attention_mask: jax.Array  # [B, L] bool
    positions: jax.Array  # [B, L] int32
    loss_mask: jax.Array  # [B, L] float32
    old_logp: jax.Array  # [B, L] float32
    advantages: jax.Array  # [B, L] float32
    ref_logp: jax.Array | None = None  # [B, L] float32; None without a reference policy
    prefix_index: jax.Array | None = None  # [B] int32: the rows continue these shared prefixes
    # Static: every micro-batch of a step but its longest fits in this many slots
    # (``long_rows_apart``); None: all micro-batches at the full width L.
    short_width: int | None = flax.struct.field(pytree_node=False, default=None)


def long_rows_apart(batch: TrainBatch, parts: int) -> tuple[TrainBatch, TrainBatch]:
    """A mini-batch's rows sorted by length and split in two: the shortest ``B - B / parts``
    cut to ``batch.short_width`` slots (``parts - 1`` micro-batches' worth), the longest ``B /
    parts`` at the full width (one micro-batch). A few long rows (a turn with a format
    warning) then widen one micro-batch instead of all of them. The row builder guarantees
    that the short rows fit (``rows.short_width``); the loss is a sum over rows, so the
    gradient is the same up to float summation order."""
    width, rows = batch.short_width, batch.input_ids.shape[0]
    cut = rows - rows // parts
    order = jnp.argsort(jnp.sum(batch.attention_mask, axis=1), stable=True)  # shortest first
    batch = jax.tree.map(lambda x: x[order], batch.replace(short_width=None))
    short = jax.tree.map(lambda x: x[:cut, :width] if x.ndim == 2 else x[:cut], batch)
    return short, jax.tree.map(lambda x: x[cut:], batch)


@flax.struct.dataclass
class CriticBatch:
    """The critic's data: ``old_values`` from before the update and GAE ``returns``."""

    input_ids: jax.Array  # [B, L] int32
    attention_mask: jax.Array  # [B, L] bool
    positions: jax.Array  # [B, L] int32
    loss_mask: jax.Array  # [B, L] float32
    old_values: jax.Array  # [B, L] float32
    returns: jax.Array  # [B, L] float32
    prefix_index: jax.Array | None = None  # [B] int32: the rows continue these shared prefixes


@flax.struct.dataclass
class Prefixes:
    """The shared prefixes of a step's rows (a group's common first prompt, computed once
    for the group): ``G`` token sequences, real tokens first. A batch with ``prefix_index``
    holds only what follows its prefix, with positions going on from it, and its slot 0 is
    scored from the prefix's last token."""

    input_ids: jax.Array  # [G, P] int32
    attention_mask: jax.Array  # [G, P] bool

    def run(self, model: Qwen2ForCausalLM | Qwen2ForValue) -> SharedPrefix:
        """The prefixes' keys, values and last hidden states under ``model``."""
        positions = positions_from_mask(self.attention_mask)
        return model.model.prefix(self.input_ids, positions, self.attention_mask)


def shared_prefix_arrays(model: Any, prefixes: Prefixes | None) -> tuple[jax.Array, ...] | None:
    """``Prefixes.run`` as the float arrays a gradient flows through (k, v, last hidden)."""
    if prefixes is None:
        return None
    p = prefixes.run(model)
    return p.k, p.v, p.last_hidden


def rows_prefix(arrays: tuple[jax.Array, ...] | None, prefixes: Prefixes | None,
                index: jax.Array | None) -> SharedPrefix | None:
    """Each row's prefix (``SharedPrefix.take``) from ``shared_prefix_arrays``' output."""
    if arrays is None:
        return None
    k, v, last = arrays
    return SharedPrefix(k=k, v=v, mask=prefixes.attention_mask.astype(bool),
                        last_hidden=last).take(index)


def make_optimizer(config: UpdateConfig) -> optax.GradientTransformation:
    """Global-norm clipping, Adam and decoupled weight decay (AdamW without its learning
    rate: the step multiplies by ``learning_rate(config, step)``); non-finite updates are
    skipped and counted."""
    inner = optax.chain(
        optax.clip_by_global_norm(config.grad_clip),
        optax.scale_by_adam(b1=config.b1, b2=config.b2),
        optax.add_decayed_weights(config.weight_decay),
        optax.scale(-1.0),
    )
    return optax.apply_if_finite(inner, config.max_consecutive_nonfinite)


def learning_rate(config: UpdateConfig, step: jax.Array | int) -> jax.Array:
    """The learning rate at training step ``step`` (0-based): a linear warmup over
    ``warmup_steps`` from 0, then constant, or cosine decay to 0 at ``total_steps``."""
    if config.lr_schedule == "cosine":
        fn = optax.warmup_cosine_decay_schedule(0.0, config.lr, config.warmup_steps,
                                                config.total_steps)
    elif config.warmup_steps:
        fn = optax.linear_schedule(0.0, config.lr, config.warmup_steps)
    else:
        fn = optax.constant_schedule(config.lr)
    return jnp.asarray(fn(step), jnp.float32)


def token_values(critic: Qwen2ForValue, input_ids: jax.Array, attention_mask: jax.Array,
                 positions: jax.Array, prefix: SharedPrefix | None = None) -> jax.Array:
    """The value of the state in which token ``j`` was generated (the critic's output at slot
    ``j - 1``), aligned with ``token_logprobs``; slot 0 gets 0, or with ``prefix`` the
    value at the prefix's last token.  # [B, L]"""
    values = critic(input_ids, positions, attention_mask, prefix=prefix)
    first = (jnp.zeros((values.shape[0], 1), values.dtype) if prefix is None else
             critic.score(prefix.last_hidden)[:, :1].astype(values.dtype))
    return jnp.concatenate([first, values[:, :-1]], 1)


def _micro_result(num_den: tuple[jax.Array, jax.Array], metrics: dict[str, jax.Array],
                  mask: jax.Array) -> tuple[jax.Array, tuple[jax.Array, dict[str, jax.Array]]]:
    """Packs a micro-batch's loss as ``(numerator, (denominator, metric sums))``, each metric
    weighted by the masked token count so the step can average over micro-batches."""
    num, den = num_den
    tokens = jnp.sum(mask)
    return num, (den, {k: v * tokens for k, v in metrics.items()} | {"tokens": tokens})


def critic_objective(critic: Qwen2ForValue, batch: CriticBatch, config: UpdateConfig,
                     prefix: SharedPrefix | None = None
                     ) -> tuple[jax.Array, tuple[jax.Array, dict[str, jax.Array]]]:
    """Clipped value loss, in the same ``(numerator, (denominator, metric sums))`` form."""
    values = token_values(critic, batch.input_ids, batch.attention_mask, batch.positions, prefix)
    mask = batch.loss_mask
    vf, metrics = losses.value_loss(values, batch.old_values, batch.returns, mask, config.value_clip)
    metrics = {**metrics, "critic/vf_loss": losses.masked_mean(vf, mask)}
    return _micro_result(losses.aggregate(vf, mask, config.loss_agg_mode), metrics, mask)


def actor_loss_terms(model: Qwen2ForCausalLM, batch: TrainBatch, config: UpdateConfig,
                     prefix: SharedPrefix | None = None
                     ) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
    """The actor loss's per-token terms as they enter it, coefficients applied: ``"pg"`` (the
    clipped surrogate), ``"entropy"`` (``-entropy_coeff * entropy``) and, when ``kl_coef > 0``,
    ``"kl"``; their sum is the loss before aggregation. Returns ``(terms, metrics)``, each
    term ``[B, L]`` (shared by the update and ``gradient_analysis``). ``prefix``: each row's
    shared prefix (``rows_prefix``) when the batch has ``prefix_index``."""
    mask = batch.loss_mask
    logp, entropy = token_logprobs(model, batch.input_ids, batch.attention_mask, batch.positions,
                                   config.temperature, loss_mask=mask, prefix=prefix)
    pg, pg_metrics = losses.policy_loss(logp, batch.old_logp, batch.advantages, mask,
                                        config.clip_low, config.clip_high, config.clip_c)
    terms = {"pg": pg, "entropy": -config.entropy_coeff * entropy}
    metrics = {
        **pg_metrics,
        "actor/pg_loss": losses.masked_mean(pg, mask),
        "actor/entropy": losses.masked_mean(entropy, mask),
    }
    if config.kl_coef:  # without a reference policy ``ref_logp`` is zeros: no KL to report
        kl = losses.kl_penalty(logp, batch.ref_logp, config.kl_estimator)
        terms["kl"] = config.kl_coef * kl
        metrics["actor/kl_loss"] = losses.masked_mean(kl, mask)
    return terms, metrics


def actor_objective(model: Qwen2ForCausalLM, batch: TrainBatch, config: UpdateConfig,
                    prefix: SharedPrefix | None = None
                    ) -> tuple[jax.Array, tuple[jax.Array, dict[str, jax.Array]]]:
    """``(numerator, (denominator, metric sums))`` of the actor loss on one micro-batch;
    metric sums are weighted by the micro-batch's masked token count."""
    terms, metrics = actor_loss_terms(model, batch, config, prefix)
    per_token = _sum_terms(terms)
    mask = batch.loss_mask
    return _micro_result(losses.aggregate(per_token, mask, config.loss_agg_mode), metrics, mask)


def _sum_terms(terms: dict[str, jax.Array]) -> jax.Array:
    total = terms["pg"] + terms["entropy"]
    return total + terms["kl"] if "kl" in terms else total


def make_optimizer_step(graphdef: Any, config: UpdateConfig,
                 optimizer: optax.GradientTransformation | None = None,
                 objective: Callable = actor_objective, mesh: Mesh | None = None) -> Callable:
    """The pure (not jitted) optimizer step
    ``(params, rest, opt_state, batch, learning_rate, prefixes=None) -> (params, opt_state,
    metrics)``.

    ``graphdef, params, rest = nnx.split(model, nnx.Param, ...)``. ``objective`` is
    ``actor_objective`` (``TrainBatch``) or ``critic_objective`` (``CriticBatch``, on a
    ``Qwen2ForValue``). The batch's size must be divisible by ``config.micro_batches``.
    With ``prefixes`` (the batch then has ``prefix_index``), the shared prefixes run once per
    step, before the micro-batches, which gather them by row; their gradients are summed
    over the micro-batches and taken back through the prefixes once (exact: the same
    gradient as every row running its own copy). A ``TrainBatch`` with ``short_width`` runs
    its longest rows as the last micro-batch at the full width and the others at that width
    (``long_rows_apart``).
    """
    role = "actor" if objective is actor_objective else "critic"
    optimizer = optimizer or make_optimizer(config)
    num_micro = config.micro_batches

    def numerator(params, rest, micro, shared, prefixes):
        model = nnx.merge(graphdef, params, rest)
        return objective(model, micro, config, rows_prefix(shared, prefixes, micro.prefix_index))

    grad_fn = jax.grad(numerator, argnums=(0, 3), has_aux=True)

    def step(params, rest, opt_state, batch, learning_rate, prefixes=None):
        if mesh is not None:
            batch = jax.lax.with_sharding_constraint(batch, batch_sharding(mesh))
        width, long_rows = batch.input_ids.shape[1], None
        if getattr(batch, "short_width", None) is not None:  # (a TrainBatch's option)
            if num_micro < 2:
                raise ValueError("update: short_width needs micro_batches >= 2")
            batch, long_rows = long_rows_apart(batch, num_micro)
        micro = jax.tree.map(lambda x: interleave(x, num_micro - (long_rows is not None)), batch)
        shared = pull_back = None
        if prefixes is not None:
            shared, pull_back = jax.vjp(
                lambda p: shared_prefix_arrays(nnx.merge(graphdef, p, rest), prefixes), params)

        def accumulate(carry, mb):
            grads, g_shared, den, sums = carry
            (g, gs), (d, s) = grad_fn(params, rest, mb, shared, prefixes)
            return (jax.tree.map(jnp.add, grads, g), jax.tree.map(jnp.add, g_shared, gs),
                    den + d, jax.tree.map(jnp.add, sums, s)), None

        zeros = jax.tree.map(jnp.zeros_like, params)
        _, (_, sums0) = jax.eval_shape(lambda: numerator(
            params, rest, jax.tree.map(lambda x: x[0], micro), shared, prefixes))
        init = (zeros, jax.tree.map(jnp.zeros_like, shared), jnp.zeros((), jnp.float32),
                jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), sums0))
        carry, _ = jax.lax.scan(accumulate, init, micro)
        if long_rows is not None:
            carry, _ = accumulate(carry, long_rows)
        grads, g_shared, den, sums = carry
        if prefixes is not None:
            grads = jax.tree.map(jnp.add, grads, pull_back(g_shared)[0])
        if config.loss_agg_mode == "seq-mean-token-sum-norm":
            den = jnp.float32(width)  # a constant horizon, not a count: do not add it up
        grads = jax.tree.map(lambda g: (g / jnp.maximum(den, 1e-8)).astype(g.dtype), grads)
        grad_norm = optax.global_norm(grads)
        updates, new_opt_state = optimizer.update(grads, opt_state, params)
        updates = jax.tree.map(lambda u: (learning_rate * u).astype(u.dtype), updates)
        new_params = optax.apply_updates(params, updates)
        if mesh is not None:
            new_params = jax.lax.with_sharding_constraint(new_params, param_shardings(new_params, mesh))
        tokens = jnp.maximum(sums.pop("tokens"), 1.0)
        metrics = {k: v / tokens for k, v in sums.items()}
        metrics[f"{role}/grad_norm"] = grad_norm
        metrics[f"{role}/update_skipped"] = (~jnp.isfinite(grad_norm)).astype(jnp.float32)
        metrics[f"{role}/nonfinite_total"] = new_opt_state.total_notfinite.astype(jnp.float32)
        return new_params, new_opt_state, metrics

    return step


def jit_optimizer_step(graphdef: Any, config: UpdateConfig,
                    optimizer: optax.GradientTransformation | None = None,
                    objective: Callable = actor_objective, mesh: Mesh | None = None, *,
                    donate: bool = True) -> Callable:
    """``make_optimizer_step`` jitted, with ``learning_rate`` optional (default: ``config.lr``):
    ``step(params, rest, opt_state, batch, learning_rate=None)``. With ``donate``, ``params``
    and ``opt_state`` are donated (invalid after the call; use the returned ones)."""
    step = jax.jit(make_optimizer_step(graphdef, config, optimizer, objective, mesh),
                   donate_argnums=(0, 2) if donate else ())

    def call(params, rest, opt_state, batch, learning_rate=None, prefixes=None):
        lr = config.lr if learning_rate is None else learning_rate
        return step(params, rest, opt_state, batch, jnp.asarray(lr, jnp.float32), prefixes)

    # For benches: the compiled step takes (params, rest, opt_state, batch, lr, prefixes or None).
    call.lower = lambda params, rest, opt_state, batch, prefixes=None: step.lower(
        params, rest, opt_state, batch, jnp.asarray(config.lr, jnp.float32), prefixes)
    return call


def interleave(x: jax.Array, parts: int) -> jax.Array:
    """``x [B, ...]`` as ``[parts, B / parts, ...]`` where part ``i`` holds rows ``i, i + parts,
    i + 2 parts, ...``: a batch sharded over devices in contiguous row blocks stays spread over
    every device in every part (contiguous parts would each sit on a few devices)."""
    return x.reshape(x.shape[0] // parts, parts, *x.shape[1:]).swapaxes(0, 1)


def mini_batch_epochs(step: Callable, params: Any, rest: Any, opt_state: Any, batch: Any,
                      learning_rate: jax.Array, *, epochs: int, mini_batch_size: int,
                      prefixes: Prefixes | None = None, live: jax.Array | None = None
                      ) -> tuple[Any, Any, dict[str, jax.Array]]:
    """``epochs`` passes over ``batch`` in mini-batches of ``mini_batch_size`` rows, one
    ``step`` (from ``make_optimizer_step``) each, as a ``lax.scan`` (RAGEN: 1 epoch, mini-batches of
    32 trajectories, no shuffling). Mini-batch ``i`` holds every ``n``-th row from row ``i``
    (``interleave``), not a consecutive block: the same unshuffled partition up to row order,
    which keeps every mini-batch on all data shards. ``live`` ([] int32, traced): only the
    first ``live`` mini-batches are stepped, the others (padding rows, ``rows.arrange_rows``)
    skipped, the optimizer state untouched by them (a step on a zero gradient would still move
    Adam's moments). Traceable. Returns the new params and optimizer state and the metrics
    averaged over the steps taken (plus ``train/num_mini_batches``)."""
    size = jax.tree.leaves(batch)[0].shape[0]
    if size % mini_batch_size:
        raise ValueError(f"update: batch of {size} rows is not divisible by mini_batch_size "
                         f"{mini_batch_size}")
    n = size // mini_batch_size
    minis = jax.tree.map(lambda x: interleave(x, n), batch)

    def run(carry, i):
        params, opt_state = carry
        part = jax.tree.map(lambda x: x[i], minis)
        params, opt_state, metrics = step(params, rest, opt_state, part, learning_rate, prefixes)
        return (params, opt_state), metrics

    one = run
    if live is not None:
        shapes = jax.eval_shape(run, (params, opt_state), 0)[1]

        def one(carry, i):
            skip = lambda carry, i: (carry, jax.tree.map(  # noqa: E731
                lambda x: jnp.zeros(x.shape, x.dtype), shapes))
            return jax.lax.cond(i < live, run, skip, carry, i)

    order = jnp.tile(jnp.arange(n), epochs)
    (params, opt_state), history = jax.lax.scan(one, (params, opt_state), order)
    if live is None:
        metrics = jax.tree.map(lambda x: jnp.mean(x, axis=0), history)
        metrics["train/num_mini_batches"] = jnp.float32(n * epochs)
    else:  # the skipped steps' zeros left out
        taken = (order < live).astype(jnp.float32)
        count = jnp.sum(taken)
        metrics = jax.tree.map(lambda x: jnp.tensordot(taken, x, 1) / jnp.maximum(count, 1.0),
                               history)
        metrics["train/num_mini_batches"] = count
    return params, opt_state, metrics
