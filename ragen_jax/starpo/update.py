"""A training step's optimisation as one pure function: ``update(state, batch)``.

``TrainState`` is every array a run trains or keeps between steps (the actor's trained
variables and optimizer state, the optional critic and its optimizer state, the optional
frozen reference, the step counter); ``Networks`` holds what never changes (graph
definitions and untrained variables, e.g. the frozen base weights under LoRA).
``make_update(settings, networks, mesh)`` returns the jitted

    update(state, batch: StepBatch, *, train_actor=True, analyse_gradients=False)
        -> (state, metrics)

which reads like the algorithm: old log-probs (recomputed, or the sampler's), reference
log-probs, critic values, advantages, critic epochs, actor epochs. Each optional role is a
function chosen once when the update is built. Metrics stay on device (one fetch per step).

**Turn-wise rows** (``algorithm.sample_unit=turn``): a row is one turn, its prompt (the
context window it was given) then its answer, loss-masked to the answer. Advantages follow
RAGEN V2's turn samples: every turn row of an episode carries the episode's score. A critic-free
estimator (GRPO, Dr.GRPO, RLOO, ...) runs on the episodes, each counted once (RAGEN's
``episode_ids`` de-duplication: an episode with more turns does not weigh more in its group's
mean and std), and each turn row gets its episode's advantage on its answer tokens. GAE runs
per row, the score on the answer's last token and the critic's values of that row (RAGEN
places the episode score on each turn sample's last token). With the full context and
trajectory-level advantages, the turn rows' policy gradient equals the trajectory rows' under
token-mean aggregation (the same tokens, log-probs, advantages and token count;
``tests/starpo/test_turn_rows.py``); sequence-mean modes weigh rows, so they differ.

**Per-turn advantages** (GiGPO, ``estimators.NEEDS_TURNS``): the episode table carries every
episode's turns (``Episodes.turns``: scores and anchor ids, ``starpo.anchors``) and the rows of
either unit carry their episode and each token's turn; the estimator runs on the episodes'
turns (each episode once) and every token gets its episode's turn's advantage.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from ragen_jax.models.lora import without_adapters
from ragen_jax.starpo import gradient_analysis as grad_lib
from ragen_jax.starpo.estimators import (
    NEEDS_CRITIC,
    AdvantageInputs,
    AdvantageSettings,
    TurnTable,
    compute_advantages,
)
from ragen_jax.starpo.losses import masked_mean
from ragen_jax.starpo.optimizer_step import (
    CriticBatch,
    Prefixes,
    TrainBatch,
    UpdateConfig,
    critic_objective,
    interleave,
    learning_rate,
    make_optimizer,
    make_optimizer_step,
    mini_batch_epochs,
    rows_prefix,
    shared_prefix_arrays,
    token_values,
)
from ragen_jax.starpo.token_scores import token_logprobs


@flax.struct.dataclass
class TrainState:
    """Every array a run carries from one training step to the next (a pytree)."""

    step: jax.Array  # [] int32, training steps done
    actor: Any  # nnx.State: the actor's trained variables (all Params, or the LoRA adapters)
    actor_opt: Any  # its optax state
    critic: Any = None  # nnx.State of the critic's Params; None without a critic
    critic_opt: Any = None
    reference: Any = None  # frozen copy of the starting actor; None if no KL or under LoRA


@dataclasses.dataclass(frozen=True)
class Networks:
    """The unchanging halves of the models (``nnx.split``): graph definitions and the
    variables that are not trained."""

    actor: Any  # GraphDef
    actor_rest: Any  # nnx.State
    critic: Any = None
    critic_rest: Any = None


SAMPLE_UNITS = ("trajectory", "turn")


@flax.struct.dataclass
class Episodes:
    """Every episode of a step (all processes'), for turn rows' episode-level advantages."""

    scores: jax.Array  # [E] float32
    group_ids: jax.Array  # [E] int32, global group ids
    turns: TurnTable | None = None  # [E, T] every episode's turns (GiGPO; None for the others)


@flax.struct.dataclass
class StepBatch:
    """One step's training rows, ``[B, L]`` token slots (real tokens a prefix per row)."""

    input_ids: jax.Array  # [B, L] int32
    attention_mask: jax.Array  # [B, L] bool
    positions: jax.Array  # [B, L] int32
    loss_mask: jax.Array  # [B, L] float32, 1 on the sampled tokens of the rows that train
    sampler_logp: jax.Array  # [B, L] float32, log_softmax(logits / T) the sampler saw
    token_rewards: jax.Array  # [B, L] float32
    turn_end: jax.Array  # [B, L] float32, 1 on each turn's last sampled token
    scores: jax.Array  # [B] float32
    group_ids: jax.Array  # [B] int32, global group ids
    bucket_ids: jax.Array  # [B] int32, reward-std bucket of the row's group (gradient analysis)
    advantage_scale: jax.Array  # [B] float32, the filter's loss scaling (RAGEN scales advantages)
    # With shared prefixes (``rows.build_step_batch``), the [B, L] arrays hold what follows
    # each row's prefix ``prefixes[prefix_index[b]]`` (its group's first prompt).
    prefix_index: jax.Array | None = None  # [B] int32
    prefixes: Prefixes | None = None  # [G, P] token table, computed once per forward pass
    # Turn rows (``sample_unit=turn``): each row's global episode, and every episode.
    episode_index: jax.Array | None = None  # [B] int32
    episodes: Episodes | None = None  # [E], replicated
    # GiGPO (``estimators.NEEDS_TURNS``): the 1-based turn of each token (0 on padding); rows
    # of either unit then carry ``episode_index`` and ``episodes`` with its turn table.
    turn_ids: jax.Array | None = None  # [B, L] int32
    # How many of the update's mini-batches hold live rows (``rows.arrange_rows``): the row
    # count is a high-water mark, so a step that keeps fewer rows than an earlier one trains
    # on padding rows (loss mask 0, group and bucket -1) gathered in the last mini-batches,
    # which every pass skips. None: every row is live.
    live_mini_batches: jax.Array | None = None  # [] int32
    # Static: all rows of each mini-batch but its longest micro-batch's worth fit in this many
    # slots (``update.long_rows_apart``); None: every micro-batch at the full width.
    short_width: int | None = flax.struct.field(pytree_node=False, default=None)


@dataclasses.dataclass(frozen=True)
class StepSettings:
    """What ``make_update`` needs, resolved from the run config (``config.resolve.resolve``)."""

    actor: UpdateConfig
    critic: UpdateConfig | None  # None: no critic role
    reference: str | None  # None | "frozen_copy" | "adapters_off"
    advantages: AdvantageSettings
    mini_batch_size: int
    epochs: int
    recompute_logprobs: bool
    gradient_buckets: int  # reward-std buckets of the gradient analysis
    sample_unit: str = "trajectory"  # "trajectory" | "turn": what a row is (see the module docstring)


def init_state(settings: StepSettings, actor: Any, critic: Any = None) -> TrainState:
    """The state at step 0 from the trained variables of the actor (and critic)."""
    state = TrainState(step=jnp.zeros((), jnp.int32), actor=actor,
                       actor_opt=make_optimizer(settings.actor).init(actor))
    if settings.critic is not None:
        state = state.replace(critic=critic, critic_opt=make_optimizer(settings.critic).init(critic))
    if settings.reference == "frozen_copy":
        state = state.replace(reference=jax.tree.map(jnp.copy, actor))
    return state


def make_update(settings: StepSettings, networks: Networks, mesh: Mesh | None = None) -> Callable:
    """The jitted ``update(state, batch, *, train_actor=True, analyse_gradients=False)``
    (see the module docstring); ``state`` is donated (its arrays are invalid afterwards).
    ``train_actor=False`` trains only the critic (its warmup); ``analyse_gradients`` adds
    ``grad_analysis/*`` norms (``starpo.gradient_analysis``). The untrained variables
    (``networks.*_rest``) are arguments of the compiled function, not constants baked into
    it, so the program depends only on the settings, the graph definitions and the mesh: two
    runs in one process that agree on them (a resumed run, an evaluation after training)
    share one jitted function, traced and compiled once."""
    jitted = _jitted_update(settings, networks.actor, networks.critic, mesh)

    def call(state: TrainState, batch: StepBatch, *, train_actor: bool = True,
             analyse_gradients: bool = False) -> tuple[TrainState, dict[str, jax.Array]]:
        return jitted(state, batch, networks.actor_rest, networks.critic_rest,
                      train_actor=train_actor, analyse_gradients=analyse_gradients)

    return call


@functools.lru_cache(maxsize=16)
def _jitted_update(s: StepSettings, actor_graph: Any, critic_graph: Any, mesh: Mesh | None
                   ) -> Callable:
    """``make_update``'s jitted function of ``(state, batch, actor_rest, critic_rest)``, one
    per settings, graph definitions (hashable, equal for equal architectures) and mesh."""
    chunk = max(1, s.mini_batch_size // s.actor.micro_batches)  # rows per forward pass
    actor_step = make_optimizer_step(actor_graph, s.actor, make_optimizer(s.actor), mesh=mesh)
    critic_step = None if s.critic is None else make_optimizer_step(
        critic_graph, s.critic, make_optimizer(s.critic), critic_objective, mesh)

    def logprobs(trained, rest, batch: StepBatch) -> jax.Array:
        model = nnx.merge(actor_graph, trained, rest)
        shared = shared_prefix_arrays(model, batch.prefixes)

        def one(rows):
            return token_logprobs(model, rows.input_ids, rows.attention_mask, rows.positions,
                                  s.actor.temperature, loss_mask=rows.loss_mask,
                                  prefix=rows_prefix(shared, batch.prefixes, rows.prefix_index))[0]
        return _chunked(one, batch, chunk, s.mini_batch_size)

    old_logprobs = logprobs if s.recompute_logprobs else (lambda trained, rest, batch: batch.sampler_logp)
    reference = {None: None,
                 "frozen_copy": lambda state, rest, batch: logprobs(state.reference, rest, batch),
                 "adapters_off": lambda state, rest, batch: logprobs(without_adapters(state.actor),
                                                                     rest, batch),
                 }[s.reference]

    def update(state: TrainState, batch: StepBatch, actor_rest, critic_rest, train_actor: bool,
               analyse_gradients: bool):
        mask = batch.loss_mask > 0
        # (padding rows, ``StepBatch.live_mini_batches``, are in no group)
        metrics = {"critic/score_mean": masked_mean(batch.scores, batch.group_ids >= 0)}
        old_logp = old_logprobs(state.actor, actor_rest, batch)
        if s.recompute_logprobs:
            metrics["rollout/logprob_gap"] = masked_mean(jnp.abs(old_logp - batch.sampler_logp), mask)
        ref_logp = None if reference is None else reference(state, actor_rest, batch)
        if ref_logp is not None:
            metrics["rollout/ref_kl"] = masked_mean(old_logp - ref_logp, mask)
        values = None
        if critic_step is not None:
            values = _critic_values(critic_graph, state.critic, critic_rest, batch, chunk,
                                    s.mini_batch_size)
        adv, returns = step_advantages(s.advantages, batch, values)
        # A scale on the loss mask would cancel in token-mean aggregation; on the advantages
        # it is what RAGEN's filter_loss_scaling does.
        adv = adv * batch.advantage_scale[:, None]
        metrics["critic/advantages_mean"] = masked_mean(adv, mask)
        if critic_step is not None:
            state, critic_metrics = _train_critic(s, critic_step, state, critic_rest, batch,
                                                  values, returns)
            metrics |= critic_metrics
        rows = TrainBatch(batch.input_ids, batch.attention_mask, batch.positions,
                          batch.loss_mask, old_logp, adv, ref_logp, batch.prefix_index)
        if analyse_gradients:
            metrics |= _gradient_norms(s, actor_graph, state.actor, actor_rest, rows,
                                       batch.bucket_ids, chunk, batch.prefixes)
        if train_actor:
            lr = learning_rate(s.actor, state.step)
            actor, actor_opt, actor_metrics = mini_batch_epochs(
                actor_step, state.actor, actor_rest, state.actor_opt,
                rows.replace(short_width=batch.short_width), lr,
                epochs=s.epochs, mini_batch_size=s.mini_batch_size, prefixes=batch.prefixes,
                live=batch.live_mini_batches)
            state = state.replace(actor=actor, actor_opt=actor_opt)
            metrics |= actor_metrics | {"actor/lr": lr}
        return state.replace(step=state.step + 1), metrics

    # The state is donated: the new parameters and optimizer state reuse its buffers, so an
    # update holds one copy of them, not two. Callers must not read the old state afterwards.
    return jax.jit(update, static_argnames=("train_actor", "analyse_gradients"),
                   donate_argnames=("state",))


def step_advantages(settings: AdvantageSettings, batch: StepBatch, values: jax.Array | None = None
                    ) -> tuple[jax.Array, jax.Array | None]:
    """``(advantages [B, L], returns or None)`` of a step's rows. Turn rows with a
    critic-free estimator: the estimator on the episodes (each once), each row then gets its
    episode's advantage on its answer (see the module docstring). With a turn table (GiGPO,
    rows of either unit): the estimator on the episodes' turns, each turn one slot, and each
    token gets its episode's turn's advantage (so copies of a row, padding, count once)."""
    mask = batch.loss_mask > 0
    if batch.episodes is not None and batch.episodes.turns is not None:
        ep, played = batch.episodes, batch.episodes.turns.played
        turns = played.shape[1]
        slots = jnp.broadcast_to(jnp.arange(1, turns + 1, dtype=jnp.int32), played.shape)
        per_turn, _ = compute_advantages(settings, AdvantageInputs(
            ep.turns.rewards, played, played.astype(jnp.float32), ep.scores, ep.group_ids,
            turns=ep.turns, token_turns=slots))  # [E, T]
        turn = jnp.clip(batch.turn_ids - 1, 0, turns - 1)
        return per_turn[batch.episode_index[:, None], turn] * mask, None
    if batch.episodes is not None and settings.estimator not in NEEDS_CRITIC:
        ep = batch.episodes
        ones = jnp.ones((ep.scores.shape[0], 1), bool)
        per_episode, _ = compute_advantages(settings, AdvantageInputs(
            ep.scores[:, None], ones, ones.astype(jnp.float32), ep.scores, ep.group_ids))
        return per_episode[batch.episode_index, :1] * mask, None
    return compute_advantages(settings, AdvantageInputs(
        batch.token_rewards, mask, batch.turn_end, batch.scores, batch.group_ids), values)


def _critic_values(graphdef: Any, params: Any, rest: Any, batch: StepBatch, chunk: int,
                   mini_batch_size: int) -> jax.Array:
    """The critic's values of the batch, ``chunk`` rows per forward pass.  # [B, L]"""
    model = nnx.merge(graphdef, params, rest)
    shared = shared_prefix_arrays(model, batch.prefixes)

    def one(rows):
        return token_values(model, rows.input_ids, rows.attention_mask, rows.positions,
                            rows_prefix(shared, batch.prefixes, rows.prefix_index))
    return _chunked(one, batch, chunk, mini_batch_size)


def _train_critic(s: StepSettings, step: Callable, state: TrainState, rest: Any,
                  batch: StepBatch, old_values: jax.Array, returns: jax.Array
                  ) -> tuple[TrainState, dict[str, jax.Array]]:
    """The critic's epochs of mini-batch steps on the clipped value loss."""
    rows = CriticBatch(batch.input_ids, batch.attention_mask, batch.positions,
                       batch.loss_mask, old_values, returns, batch.prefix_index)
    params, opt, metrics = mini_batch_epochs(
        step, state.critic, rest, state.critic_opt, rows, learning_rate(s.critic, state.step),
        epochs=s.epochs, mini_batch_size=s.mini_batch_size, prefixes=batch.prefixes,
        live=batch.live_mini_batches)
    metrics = {k: v for k, v in metrics.items() if k.startswith("critic/")}
    metrics["critic/values_mean"] = masked_mean(old_values, batch.loss_mask > 0)
    return state.replace(critic=params, critic_opt=opt), metrics


def _chunked(fn: Callable[[StepBatch], jax.Array], batch: StepBatch, chunk: int,
             mini_batch_size: int) -> jax.Array:
    """``fn`` over the batch ``chunk`` rows at a time (bounded activation memory), back in
    row order as ``[B, L]``. Chunk ``c`` of ``n`` holds rows ``c, c + n, ...`` (``interleave``:
    on every data shard, like the mini-batches); with padding rows
    (``StepBatch.live_mini_batches``) they fill whole chunks, which are skipped (zeros). The
    prefix table is not sliced (``fn`` gets it as None)."""
    live = batch.live_mini_batches
    batch = batch.replace(prefixes=None, episodes=None, live_mini_batches=None)
    rows = batch.input_ids.shape[0]
    if rows % chunk:
        chunk = rows
    n = rows // chunk
    parts = jax.tree.map(lambda x: interleave(x, n), batch)
    minis = rows // mini_batch_size
    if live is None or n % minis:
        out = jax.lax.map(fn, parts)
    else:
        # Chunk c holds rows of mini-batch c mod minis only (minis divides n): padding
        # mini-batches are the last ones, so are these chunks.
        shape = jax.eval_shape(fn, jax.tree.map(lambda x: x[0], parts))
        skip = lambda part: jnp.zeros(shape.shape, shape.dtype)  # noqa: E731
        out = jax.lax.map(lambda xs: jax.lax.cond(xs[0] % minis < live, fn, skip, xs[1]),
                          (jnp.arange(n), parts))
    return out.swapaxes(0, 1).reshape(rows, *out.shape[2:])


def _gradient_norms(s: StepSettings, graphdef: Any, actor: Any, rest: Any, rows: TrainBatch,
                    bucket_ids: jax.Array, chunk: int, prefixes: Prefixes | None
                    ) -> dict[str, jax.Array]:
    """``grad_analysis/<name>``: the gradient norm of each actor-loss component by bucket,
    ``chunk`` rows per forward pass."""
    size = rows.input_ids.shape[0]
    micro = size // chunk if size % chunk == 0 else 1
    analyse = grad_lib.make_gradient_analysis(graphdef, s.actor, s.gradient_buckets, micro)
    norms = analyse(actor, rest, rows, bucket_ids, prefixes)
    return {f"grad_analysis/{k}": v for k, v in norms.items()}
