"""Log-probabilities and entropies of the taken tokens, without full-vocabulary logits.

Scoring a sequence needs, at every slot, the log-softmax of the output head over the whole
vocabulary; materialised at once that is a float32 ``[B, L, V]`` array (V = 151,936 for
Qwen2.5: 2.2 GB for 4 x 896 tokens), and autodiff keeps a few more of that size. Here the
decoder runs once to its final hidden states ``[B, L, E]`` (``model.model``), and the head
is applied to ``chunk`` positions at a time in a ``lax.scan`` whose body is under
``jax.checkpoint``: forward and backward each hold one chunk's ``[B, chunk, V]`` logits, and
the backward recomputes them instead of storing them. With a ``mask`` of the slots that
matter (the loss mask), chunks with no such slot in the whole batch are skipped
(``lax.cond``); long unmasked prompts then cost no head projection at all. A chunk also holds
at most ``MAX_CHUNK_LOGITS`` logits (fewer positions for wide batches): 64 diagnostic pairs of
128 positions over Qwen2.5's vocabulary would otherwise be a 5 GB chunk.

``token_logprobs`` scores a batch of sequences (the update, SFT); ``target_logprobs`` scores
given hidden states against given targets (the collapse diagnostics, which run the decoder on
a KV cache themselves).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ragen_jax.models.qwen import Qwen2ForCausalLM, SharedPrefix

# Logits one chunk may hold ([B, positions, V] elements): 2**27 float32 = 512 MiB, plus the
# softmax's temporaries of that size. An update micro-batch of 8 x 128 positions of Qwen2.5
# (156M) takes 110 positions a chunk; the collapse diagnostics' 64 pairs 13.
MAX_CHUNK_LOGITS = 2**27


def _scores_fwd(logits: jax.Array, ids: jax.Array):
    lse = jax.nn.logsumexp(logits, axis=-1, keepdims=True)  # [..., 1]
    logp = logits - lse
    taken = jnp.take_along_axis(logp, ids[..., None], axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
    return (taken, entropy), (logits, ids, lse, entropy)


def _scores_bwd(res, cotangents):
    # d taken / d logits = onehot(ids) - p;  d entropy / d logits = -p * (log p + entropy)
    logits, ids, lse, entropy = res
    g_taken, g_entropy = (g[..., None] for g in cotangents)
    logp = logits - lse
    onehot = jax.lax.broadcasted_iota(ids.dtype, logits.shape, logits.ndim - 1) == ids[..., None]
    grad = (jnp.where(onehot, g_taken, 0.0)
            - jnp.exp(logp) * (g_taken + g_entropy * (logp + entropy[..., None])))
    return grad, None


@jax.custom_vjp
def _scores(logits: jax.Array, ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``log softmax(logits)[ids]`` and the entropy of ``softmax(logits)``, over the last
    axis. The gradient is written out, one elementwise expression of the logits: autodiff of
    the forward lines also kept the log-probs, the probabilities and a scatter of the
    gather's cotangent, each as large as the logits (XLA:CPU, 2.4 vs 3.4 GB for a chunk
    of 4 x 224 x 151,936)."""
    return _scores_fwd(logits, ids)[0]


_scores.defvjp(_scores_fwd, _scores_bwd)


def target_logprobs(model: Qwen2ForCausalLM, hidden: jax.Array, targets: jax.Array,
                    temperature: float = 1.0, *, chunk: int = 128,
                    mask: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """``log p(targets[b, t])`` under the distribution the output head gives at
    ``hidden[b, t]`` (logits divided by ``temperature``), and that distribution's entropy.

    ``hidden [B, T, E]`` are final hidden states, ``targets [B, T]`` token ids. Positions are
    processed ``chunk`` at a time (at most, and at most ``MAX_CHUNK_LOGITS`` logits; chunks are
    evened out to limit padding). With
    ``mask [B, T]``, slots where it is 0 get 0 and chunks where it is 0 for every row are not
    computed; the other slots' values do not depend on ``mask``.  # [B, T], [B, T]
    """
    b, t = targets.shape
    chunk = max(1, min(chunk, MAX_CHUNK_LOGITS // (b * model.config.vocab_size)))
    if mask is None:
        mask = jnp.ones((b, t), bool)
    mask = mask.astype(bool)
    n = max(-(-t // chunk), 1)  # number of chunks
    size = max(-(-t // n), 1)  # positions per chunk, evened out
    pad = n * size - t

    def chunks(a: jax.Array) -> jax.Array:  # [B, T, ...] -> [n, B, size, ...]
        a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        return a.reshape(b, n, size, *a.shape[2:]).swapaxes(0, 1)

    # Both functions below are checkpointed. ``body``, so that the scan's backward pass
    # keeps only each chunk's inputs (and the head's weights once; residuals coming out of
    # the cond would be stacked over chunks); ``score``, so that the cond's residuals are
    # its inputs, not the [B, size, V] logits (which ``skip`` would have to fill with zeros).
    @jax.checkpoint
    def score(h: jax.Array, ids: jax.Array) -> tuple[jax.Array, jax.Array]:
        return _scores(model.logits(h) / temperature, ids)  # of [B, size, V] logits

    def skip(h: jax.Array, ids: jax.Array) -> tuple[jax.Array, jax.Array]:
        zeros = jnp.zeros(ids.shape, jnp.float32)
        return zeros, zeros

    @jax.checkpoint
    def body(_, xs):
        h, ids, m = xs
        logp, entropy = jax.lax.cond(jnp.any(m), score, skip, h, ids)
        return None, (jnp.where(m, logp, 0.0), jnp.where(m, entropy, 0.0))

    _, (logp, entropy) = jax.lax.scan(body, None, (chunks(hidden), chunks(targets), chunks(mask)))

    def unchunk(a: jax.Array) -> jax.Array:  # [n, B, size] -> [B, T]
        return a.swapaxes(0, 1).reshape(b, n * size)[:, :t]

    return unchunk(logp), unchunk(entropy)


def token_logprobs(model: Qwen2ForCausalLM, input_ids: jax.Array, attention_mask: jax.Array,
                   positions: jax.Array, temperature: float = 1.0, *, chunk: int = 128,
                   loss_mask: jax.Array | None = None, prefix: SharedPrefix | None = None
                   ) -> tuple[jax.Array, jax.Array]:
    """``log p(token_j | tokens before j)`` and the entropy of that distribution, for every
    slot ``j >= 1`` of ``input_ids [B, L]`` (slot 0 gets 0), at ``temperature``. With
    ``prefix`` (one row per sequence, ``Qwen2Model.prefix(...).take(...)``) the rows continue
    it and slot 0 is scored too, from the prefix's last hidden state.

    With ``loss_mask [B, L]`` only its slots are scored (the others get 0, see
    ``target_logprobs``); their values equal those computed without it.  # [B, L], [B, L]
    """
    hidden = model.model(input_ids, positions, attention_mask, prefix=prefix)  # [B, L, E]
    if prefix is not None:  # the state before slot 0 is the prefix's last one
        hidden = jnp.concatenate([prefix.last_hidden[:, None].astype(hidden.dtype), hidden], 1)
        return target_logprobs(model, hidden[:, :-1], input_ids, temperature, chunk=chunk,
                               mask=loss_mask)
    mask = None if loss_mask is None else loss_mask[:, 1:]
    logp, entropy = target_logprobs(model, hidden[:, :-1], input_ids[:, 1:], temperature,
                                    chunk=chunk, mask=mask)  # [B, L - 1]
    first = jnp.zeros((input_ids.shape[0], 1), jnp.float32)
    return jnp.concatenate([first, logp], 1), jnp.concatenate([first, entropy], 1)
