"""What one sampled turn is: the static decoding settings (``SamplingParams``), a token's draw
under them (``sample_token``: temperature, top-k, top-p, with the log-probs a trainer needs) and
a call's result (``SampleOutput``). Shared by the dense and the paged sampler
(``sampler.py``, ``paged_sampling.py``)."""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp

from ragen_jax.models.kv_cache import KVCache

_NEG_INF = float("-inf")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Static decoding settings (each distinct value compiles once).

    temperature: 0 means greedy. top_k: 0 means off. top_p: 1.0 means off. Ties at the top-k
    or top-p threshold are kept (so slightly more than k tokens can survive on exact ties).
    """

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"bad sampling params {self}")


@flax.struct.dataclass
class SampleOutput:
    """The result of one ``Sampler`` call (device arrays)."""

    tokens: jax.Array  # [B, N] int32 generated tokens; pad_id after a sequence ends
    mask: jax.Array  # [B, N] bool: token was generated (stop token included)
    logprobs: jax.Array  # [B, N] float32 under the sampling distribution; 0 where masked
    model_logprobs: jax.Array  # [B, N] float32 log_softmax(logits / T); 0 where masked
    lengths: jax.Array  # [B] int32 generated tokens per sequence
    steps: jax.Array  # [] int32 decode steps run (= cache slots used after the prompt)
    prompt_tokens: jax.Array  # [B, P] the bucketed (left-padded) prompt chunk
    prompt_mask: jax.Array  # [B, P] bool
    cache: KVCache  # the cache after this turn (prompt and generated tokens in it)

    def slots(self) -> tuple[jax.Array, jax.Array]:
        """The turn's cache slots as ``(tokens, mask)`` of shape ``[B, P + steps]``.

        Appending these per turn gives the trajectory's slot sequence; a full forward pass over
        it with ``attention_mask = mask`` and ``positions_from_mask(mask)`` recomputes
        ``model_logprobs`` (generated token ``i`` is predicted at slot ``P - 1 + i``).
        """
        steps = int(self.steps)
        tokens = jnp.concatenate([self.prompt_tokens, self.tokens[:, :steps]], axis=1)
        mask = jnp.concatenate([self.prompt_mask, self.mask[:, :steps]], axis=1)
        return tokens, mask


def _filter_logits(logits, sp: SamplingParams):
    """Applies temperature, top-k, top-p; returns the (masked) logits to sample from."""
    x = logits / sp.temperature
    if sp.top_k and sp.top_k < x.shape[-1]:
        top_vals, _ = jax.lax.top_k(x, sp.top_k)  # [B, k], sorted descending
        x = jnp.where(x < top_vals[:, -1:], _NEG_INF, x)
        sorted_x = top_vals
    else:
        sorted_x = -jnp.sort(-x, axis=-1) if sp.top_p < 1.0 else None
    if sp.top_p < 1.0:
        probs = jax.nn.softmax(sorted_x, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        keep = mass_before < sp.top_p
        threshold = jnp.min(jnp.where(keep, sorted_x, jnp.inf), axis=-1, keepdims=True)
        x = jnp.where(x < threshold, _NEG_INF, x)
    return x


def sample_token(logits, key, sp: SamplingParams):
    """One token per row from ``logits[B, V]``: (token, logprob, model_logprob). ``key`` is
    one key for the batch or ``[B]`` keys, one per row (a row's draw then does not depend on
    which other rows share the batch: a multi-process rollout equals a single-process one)."""
    if sp.temperature == 0:
        lp = jax.nn.log_softmax(logits, axis=-1)
        tok = jnp.argmax(logits, axis=-1)
        chosen = jnp.take_along_axis(lp, tok[:, None], axis=-1)[:, 0]
        return tok.astype(jnp.int32), chosen, chosen
    model_lp = jax.nn.log_softmax(logits / sp.temperature, axis=-1)
    x = _filter_logits(logits, sp)
    if key.ndim:
        tok = jax.vmap(lambda k, row: jax.random.categorical(k, row))(key, x)
    else:
        tok = jax.random.categorical(key, x, axis=-1)
    samp_lp = jax.nn.log_softmax(x, axis=-1)
    pick = lambda a: jnp.take_along_axis(a, tok[:, None], axis=-1)[:, 0]  # noqa: E731
    return tok.astype(jnp.int32), pick(samp_lp), pick(model_lp)


@flax.struct.dataclass
class Draws:
    """A decode loop's per-row state besides the cache: which rows are done, how many tokens
    each drew, the tokens and their log-probs so far, each row's stop-string automaton state."""

    done: jax.Array  # [B] bool
    lengths: jax.Array  # [B] int32
    tokens: jax.Array  # [B, N] int32
    logprobs: jax.Array  # [B, N] float32
    model_logprobs: jax.Array  # [B, N] float32
    text: jax.Array  # [B] int32

    @classmethod
    def start(cls, done: jax.Array, n: int, pad_id: int) -> Draws:
        b = done.shape[0]
        return cls(done, jnp.zeros((b,), jnp.int32), jnp.full((b, n), pad_id, jnp.int32),
                   jnp.zeros((b, n), jnp.float32), jnp.zeros((b, n), jnp.float32),
                   jnp.zeros((b,), jnp.int32))


def draw_step(draws: Draws, step: jax.Array, logits: jax.Array, key: jax.Array, stop: jax.Array,
              budget: jax.Array, stop_table: jax.Array | None, sp: SamplingParams, pad_id: int
              ) -> tuple[jax.Array, jax.Array, Draws]:
    """One decode step's draw for every row from ``logits [B, V]`` (``key``: one key or ``[B]``
    keys, folded with ``step``): ``(token [B], emitted [B], draws)``. A row is done after a
    stop token ``stop [B, K]``, a completed stop string (``stop_table``) or its ``budget``;
    a done row emits ``pad_id``."""
    step_key = jax.vmap(jax.random.fold_in, (0, None))(key, step) if key.ndim else \
        jax.random.fold_in(key, step)
    tok, lp, mlp = sample_token(logits, step_key, sp)
    emit = ~draws.done  # [B]
    tok = jnp.where(emit, tok, pad_id)
    lengths = draws.lengths + emit
    is_stop = jnp.any(tok[:, None] == stop, axis=-1)
    text = draws.text
    if stop_table is not None:  # one gather per row: the stop-string automaton's step
        text = jnp.where(emit, stop_table[text, tok], text)
        is_stop = is_stop | (text == stop_table.shape[0] - 1)
    return tok, emit, Draws(
        done=draws.done | (emit & (is_stop | (lengths >= budget))), lengths=lengths,
        tokens=draws.tokens.at[:, step].set(tok),
        logprobs=draws.logprobs.at[:, step].set(jnp.where(emit, lp, 0.0)),
        model_logprobs=draws.model_logprobs.at[:, step].set(jnp.where(emit, mlp, 0.0)), text=text)
