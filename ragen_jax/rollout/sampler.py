"""Batched generation with a KV cache: one jitted prefill + ``lax.while_loop`` decode.

Per call (one turn):

1. The host left-pads the prompt chunk to a power-of-two bucket (bounding recompiles), or
   to a multiple of ``bucket_multiple`` (less padding to prefill, a few more shapes).
2. On device, in one jitted function whose KV cache argument is donated: prefill the chunk into
   the cache (continuing an existing cache for later turns; a chunk of more than
   ``prefill_tokens`` tokens in blocks of rows), then decode token by token in a
   ``lax.while_loop`` until every sequence has hit a stop token, completed a stop string
   (``rollout.sampling.stop_strings``: a per-token automaton stepped per row, ``stop_strings.py``) or
   spent its token budget, or the static ``max_new_tokens`` steps are done. No host round
   trip happens inside the loop.
   On the CPU the model runs in ``decode_layout`` (``[in, out]`` weights: a batch-8 decode
   step of the 0.5B shape 1.4x faster than in the Hugging Face ``[out, in]`` layout, the same
   at batch 1; ``layout=False`` turns it off).
3. Each generated token is also fed back into the cache (the last one included), so the
   returned cache holds the whole trajectory and the next turn only prefills its new tokens.

Slot layout: the turn occupies ``prompt_bucket + steps`` consecutive cache slots, shared by the
batch; ``SampleOutput`` returns the slot tokens and validity (``prompt_tokens``/``prompt_mask``
and ``tokens[:, :steps]``/``mask[:, :steps]``), which is exactly what the trainer needs to
recompute ``model_logprobs`` with one full forward pass (see ``models/qwen.py``).

Log-probs: ``logprobs`` is the log-probability of each sampled token under the distribution it
was drawn from (temperature, then top-k, then top-p, renormalised); ``model_logprobs`` is
``log_softmax(logits / temperature)`` without truncation, the quantity a trainer recomputes.
For greedy decoding (temperature 0) both are the temperature-1 ``log_softmax(logits)``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ragen_jax.models.copies import (
    decode_layout,
    decode_layout_by_default,
    in_decode_layout,
    per_layer,
)
from ragen_jax.models.kv_cache import KVCache, positions_from_mask
from ragen_jax.models.paged_cache import DEFAULT_BLOCK_SIZE, BlockAllocator
from ragen_jax.models.qwen import Qwen2ForCausalLM
from ragen_jax.rollout.paged_sampling import (
    PagedState,
    empty_pages,
    first_turn_plan,
    generate_paged_jit,
    next_turn_plan,
)
from ragen_jax.rollout.sampling import Draws, SampleOutput, SamplingParams, draw_step
from ragen_jax.rollout.stop_strings import StopAutomaton
from ragen_jax.shapes import HighWater, round_up


def bucket_length(n: int, minimum: int = 16, multiple: int | None = None) -> int:
    """The smallest power of two >= max(n, minimum), or with ``multiple`` the smallest
    multiple of it (fewer padded tokens, more distinct shapes)."""
    n = max(int(n), minimum, 1)
    if multiple:
        return -(-n // multiple) * multiple
    return 1 << (n - 1).bit_length()


def pad_prompts(prompts, mask=None, *, bucket: int | None = None, pad_id: int = 0,
                min_bucket: int = 16, multiple: int | None = None):
    """Host-side: left-pads prompts into ``[B, bucket]`` numpy arrays (tokens, mask).

    ``prompts`` is a list of token lists, or a ``[B, T]`` array with an optional ``mask``
    (padding anywhere; only real tokens are kept, in order).
    """
    if isinstance(prompts, np.ndarray | jax.Array):
        arr = np.asarray(prompts)
        m = np.ones(arr.shape, bool) if mask is None else np.asarray(mask).astype(bool)
        rows = [arr[i][m[i]].tolist() for i in range(arr.shape[0])]
    else:
        rows = [list(map(int, p)) for p in prompts]
    longest = max(len(r) for r in rows)
    size = bucket if bucket is not None else bucket_length(longest, min_bucket, multiple)
    if longest > size:
        raise ValueError(f"prompt of {longest} tokens does not fit bucket {size}")
    tokens = np.full((len(rows), size), pad_id, np.int32)
    valid = np.zeros((len(rows), size), bool)
    for i, r in enumerate(rows):
        if r:
            tokens[i, size - len(r):] = r
            valid[i, size - len(r):] = True
    return tokens, valid


def prefill_tokens_by_default() -> int:
    """The most tokens one prefill block takes when nobody says: 2048 on the CPU (the 0.5B
    shape's layer matmuls ran at the matmul peak on 8 x 256 tokens and at 81% of it on
    32 x 256), unbounded (0) elsewhere."""
    return 2048 if jax.default_backend() == "cpu" else 0


def prefill_block_rows(batch: int, length: int, budget: int, shards: int = 1,
                       unit: int = 1) -> int:
    """Rows per prefill block: ``batch`` rows of ``length`` tokens are prefilled in blocks of
    at most ``budget`` tokens where they can be (``budget`` <= 0: one block). The largest
    divisor of ``batch`` that is a multiple of ``unit x shards`` (whole groups of ``unit``
    rows, and a batch split over ``shards`` devices stays evenly split, see ``_prefill``) and
    fits the budget; the smallest such multiple if none fits."""
    step = unit * shards
    if budget <= 0 or batch * length <= budget or batch % step:
        return batch
    fits = [r for r in range(step, batch, step) if batch % r == 0 and r * length <= budget]
    return max(fits, default=step)


def _prefill(model, tokens, pos, mask, cache: KVCache, last, budget: int):
    """``model(tokens, pos, mask, cache, logits_at=last)`` on a per-layer cache, run over
    blocks of rows of at most ``budget`` tokens one after another (``lax.map``; the rows per
    block from ``prefill_block_rows``) when that is fewer than the batch. Why: XLA:CPU's layer
    matmuls on many thousands of tokens at once run slower per token than on a few thousand
    (the 0.5B shape: 32 x 256 tokens took 4.6x the time of 8 x 256, in blocks of 8 rows 4.0x).
    Block ``j`` of ``n`` holds units ``j, j + n, j + 2n, ...``, a unit being one row, or a
    group prefix's rows with theirs (so a batch split over devices stays split)."""
    b = tokens.shape[0]
    unit = b // cache.groups if cache.groups else 1
    rows = prefill_block_rows(b, tokens.shape[1], budget, model.model.batch_shards(), unit)
    if rows >= b:
        return model(tokens, pos, mask, cache, logits_at=last)
    n = b // rows

    def split(x):  # [B, ...] -> [n, rows, ...]
        x = x.reshape(rows // unit, n, unit, *x.shape[1:]).swapaxes(0, 1)
        return x.reshape(n, rows, *x.shape[3:])

    def join(x):  # [n, rows, ...] -> [B, ...]
        x = x.reshape(n, rows // unit, unit, *x.shape[2:]).swapaxes(0, 1)
        return x.reshape(b, *x.shape[3:])

    def block(xs):
        t, p, m, at, k, v, valid, lengths, prefix = xs
        part = cache.replace(k=k, v=v, valid=valid, lengths=lengths)
        if prefix is not None:
            part = part.replace(prefix_k=prefix[0], prefix_v=prefix[1], prefix_valid=prefix[2])
        logits, part = model(t, p, m, part, logits_at=at)
        return logits, (part.k, part.v, part.valid, part.lengths)

    prefix = None
    if cache.groups:  # [G, ...] -> [n, G / n, ...]: the prefixes of each block's groups
        prefix = jax.tree.map(lambda x: x.reshape(rows // unit, n, *x.shape[1:]).swapaxes(0, 1),
                              (cache.prefix_k, cache.prefix_v, cache.prefix_valid))
    xs = jax.tree.map(split, (tokens, pos, mask, last, cache.k, cache.v, cache.valid,
                              cache.lengths))
    logits, (k, v, valid, lengths) = jax.lax.map(block, (*xs, prefix))
    k, v, valid, lengths, logits = jax.tree.map(join, (k, v, valid, lengths, logits))
    return logits, cache.replace(k=k, v=v, valid=valid, lengths=lengths,
                                 index=(cache.index + tokens.shape[1]).astype(jnp.int32))


class HashedGraph:
    """A graph definition as a jit static argument, hashed once: nnx hashes a ``GraphDef``
    anew on every call (~1 ms for the tiny model, most of a batch-1 call's host time)."""

    __slots__ = ("graphdef", "_hash")

    def __init__(self, graphdef):
        self.graphdef, self._hash = graphdef, hash(graphdef)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return self is other or (isinstance(other, HashedGraph) and self.graphdef == other.graphdef)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _empty_cache(config, batch: int, size: int) -> KVCache:
    """``KVCache.init`` (per layer) as one program, not one dispatch per layer's array."""
    return KVCache.init(config, batch, size, stacked=False)


@functools.partial(jax.jit, static_argnums=1)
def _grown(cache: KVCache, size: int) -> KVCache:
    """``cache.grow(size)`` as one program (its buffers cannot be donated: they are smaller)."""
    return cache.grow(size)


def _generate(graph, state, cache, tokens, mask, stop, budget, active, key, expand=None,
              stop_table=None, *, sp, pad_id, group_prefix=False, prefill_tokens=0):
    """Prefill ``tokens[B, P]`` into ``cache``, then decode up to ``sp.max_new_tokens``.
    ``stop_table [S + 1, V]``: a ``StopAutomaton``'s table (None: no stop strings); each row's
    state starts at 0 and a row whose state reaches ``S`` (a completed string) is done.
    With ``expand [B']`` the prefilled rows are distinct prompts: row ``expand[i]`` of the
    prefill becomes row ``i`` of the decode (its cache slots and next-token logits copied;
    with ``group_prefix`` the prefill's cache becomes the decode cache's shared prefix
    instead, ``expand`` then being B / B' consecutive rows per prompt). ``graph``: the
    model's ``HashedGraph``."""
    model = nnx.merge(graph.graphdef, state)
    p = tokens.shape[1]
    n = sp.max_new_tokens

    # Prefill; logits only at each row's last real token.
    last = (p - 1 - jnp.argmax(mask[:, ::-1], axis=1)).astype(jnp.int32)  # [B]
    pos = positions_from_mask(mask, cache.lengths)
    logits, cache = _prefill(model, tokens, pos, mask, cache, last, prefill_tokens)
    if group_prefix:
        rows = KVCache.init(model.config, expand.shape[0], n, cache.k[0].dtype,
                            stacked=False).with_group_prefix(cache)
        cache, logits, tokens, mask = rows, logits[expand], tokens[expand], mask[expand]
    elif expand is not None:
        cache, logits, tokens, mask = (cache.take(expand), logits[expand], tokens[expand],
                                       mask[expand])

    def cond(s):
        step, _, _, draws = s
        return (step < n) & ~jnp.all(draws.done)

    def body(s):
        step, cache, logits, draws = s
        tok, emit, draws = draw_step(draws, step, logits, key, stop, budget, stop_table, sp,
                                     pad_id)
        # Feed the token back (padding slot for finished rows) so the cache holds it.
        new_logits, cache = model(tok[:, None], cache.lengths[:, None], emit[:, None], cache)
        return step + 1, cache, new_logits[:, 0], draws

    init = (jnp.zeros((), jnp.int32), cache, logits[:, 0],
            Draws.start(~active | (budget <= 0), n, pad_id))
    step, cache, _, draws = jax.lax.while_loop(cond, body, init)
    out_mask = jnp.arange(n)[None, :] < draws.lengths[:, None]
    return SampleOutput(tokens=draws.tokens, mask=out_mask, logprobs=draws.logprobs,
                        model_logprobs=draws.model_logprobs, lengths=draws.lengths, steps=step,
                        prompt_tokens=tokens, prompt_mask=mask, cache=cache)


@functools.cache
def generate_jit(expanded: bool, options: tuple[tuple[str, str], ...] = ()):
    """The jitted ``_generate``: in place (the cache argument donated) or ``expanded`` (the
    output cache has more rows than the input: nothing to donate), compiled with ``options``."""
    return jax.jit(_generate, static_argnames=("graph", "sp", "pad_id", "group_prefix",
                                               "prefill_tokens"),
                   donate_argnames=() if expanded else ("cache",),
                   compiler_options=dict(options) or None)


class Sampler:
    """Generates continuations for a batch of prompts with a (possibly continued) KV cache.

    The model is split once into graph definition and parameter state, so parameters are
    jit arguments (not constants baked into the program). Call ``update(model)`` after a
    training step to sample from new weights without recompiling. A model with stacked
    layers is first copied ``per_layer``, and on the CPU into ``decode_layout`` (``compute_copy``
    already is both; ``layout=False`` keeps the Hugging Face layout). ``compiler_options``:
    XLA options for the sampler's program (``jax.jit``'s ``compiler_options``; none by default).
    ``prefill_tokens``: a prompt chunk of more tokens than this (rows x bucket) is prefilled
    in blocks of rows of at most this many tokens (``prefill_block_rows``; 0: in one piece;
    default ``prefill_tokens_by_default()``); the result is the same either way.
    ``episode_slots``: a cache that must grow grows at once to at least this many slots (the
    rollout's whole episode, ``episode_slots(rollout)``), so a run's turns after the first
    share one cache shape, compiled once, whatever lengths the answers take; None: to the
    next power of two (or multiple of ``cache_multiple``) each time.
    ``paged``: the paged KV cache instead (``paged_sampling``; same tokens): pools of
    ``kv_blocks`` blocks of ``block_size`` tokens (0: enough for every row at
    ``max_row_tokens``, default ``episode_slots`` or 4096), decode attention by
    ``paged_impl`` (``paged_attention.PAGED_IMPLS``).
    """

    def __init__(self, model: Qwen2ForCausalLM, *, pad_id: int = 0, min_bucket: int = 16,
                 bucket_multiple: int | None = None, share_prompts: bool = True,
                 cache_multiple: int | None = None, layout: bool | None = None,
                 group_prefix: bool = True, compiler_options: dict | None = None,
                 prefill_tokens: int | None = None, episode_slots: int | None = None,
                 paged: bool = False, kv_blocks: int = 0, block_size: int = DEFAULT_BLOCK_SIZE,
                 max_row_tokens: int | None = None, paged_impl: str = "auto"):
        # ``layout``: decode in ``decode_layout`` (default: on the CPU); decided once, here.
        self.layout = decode_layout_by_default() if layout is None else layout
        self.prefill_tokens = prefill_tokens_by_default() if prefill_tokens is None else int(
            prefill_tokens)
        self.options = tuple(sorted((compiler_options or {}).items()))
        self.update(model)
        self.config = model.config
        self.pad_id = int(pad_id)
        self.min_bucket = int(min_bucket)
        self.bucket_multiple = bucket_multiple
        self.share_prompts = share_prompts
        self.cache_multiple = cache_multiple
        self.group_prefix = group_prefix
        self.episode_slots = episode_slots
        # The paged cache (``paged_sampling``): pools of ``kv_blocks`` blocks (0: enough for
        # every row at ``max_row_tokens``) of ``block_size`` tokens, rows of at most
        # ``max_row_tokens`` tokens (default: ``episode_slots``, else 4096).
        self.paged, self.kv_blocks, self.block_size = paged, int(kv_blocks), int(block_size)
        self.max_row_tokens = int(max_row_tokens or episode_slots or 4096)
        self.paged_impl = paged_impl
        # Prompt buckets that never shrink, per kind of call (a first turn or a continuation;
        # shared by every batch size, so that a run's first validation, which plays many
        # levels, sets the training's first-turn bucket too): ``ragen_jax.shapes.HighWater``;
        # None: each call's own bucket.
        self.marks: HighWater | None = None

    @classmethod
    def for_rollout(cls, model: Qwen2ForCausalLM, rollout, *, pad_id: int = 0) -> Sampler:
        """The sampler a ``RolloutConfig`` asks for (prompt buckets, cache growth, group
        prefix): the trainer's and evaluation's, built in one place."""
        s = rollout.sampler
        return cls(model, pad_id=pad_id, bucket_multiple=s.prompt_pad_multiple,
                   cache_multiple=s.cache_multiple or None, group_prefix=s.share_prompt_cache,
                   episode_slots=episode_slots(rollout), paged=s.paged, kv_blocks=s.kv_blocks,
                   block_size=s.kv_block_size)

    def update(self, model: Qwen2ForCausalLM) -> None:
        """Uses ``model``'s current parameters from now on."""
        graphdef, self.state = nnx.split(self._prepare(model))
        self.graph = HashedGraph(graphdef)

    @property
    def graphdef(self):
        """The graph definition of the model this sampler runs (``nnx.merge(graphdef, state)``)."""
        return self.graph.graphdef

    def _prepare(self, model: Qwen2ForCausalLM) -> Qwen2ForCausalLM:
        """``model`` as this sampler runs it: ``per_layer``, and in ``decode_layout`` with
        ``layout`` (a copy only where it is not already: ``compute_copy`` makes both)."""
        model = per_layer(model)
        if self.layout and not in_decode_layout(model):
            model = decode_layout(model)
        return model

    def __call__(
        self,
        prompts,
        *,
        key: jax.Array,
        params: SamplingParams = SamplingParams(),
        mask=None,
        stop_tokens: Sequence[int] | np.ndarray = (),
        stop_strings: StopAutomaton | None = None,
        max_new: Sequence[int] | np.ndarray | None = None,
        active: Sequence[bool] | np.ndarray | None = None,
        cache: KVCache | None = None,
        bucket: int | None = None,
        env_states=None,
    ) -> SampleOutput:
        """Samples up to ``params.max_new_tokens`` tokens after each prompt.

        Args:
          prompts: list of token lists, or a ``[B, T]`` array with ``mask`` (the new chunk
            only, when continuing a cache). Every active row needs at least one real token.
          key: PRNG key, or ``[B]`` keys (one per row: a row's tokens then depend only on its
            own key, prompt and cache); the same keys, inputs and params give the same output.
          stop_tokens: ids that end a sequence (the stop token is emitted and counted), shared
            ``[K]`` or per sequence ``[B, K]`` (pad with -1).
          stop_strings: compiled stop strings (``stop_strings.stop_automaton``): a sequence
            ends with the token that completes one of them (that token emitted and counted).
          max_new: optional per-sequence token budgets ``[B]`` (<= ``params.max_new_tokens``).
          active: optional ``[B]`` bool; inactive rows generate nothing (finished episodes).
          cache: continue this cache (it is donated: do not reuse the passed object). It grows
            to the next power of two (``cache_multiple``: the next multiple of it) when the
            chunk and the new tokens do not fit.
          bucket: force the prompt bucket length (default: power of two >= longest prompt).
          env_states: ignored (the rollout passes every policy this turn's env states; a
            model reads only the prompt).

        Without a ``cache`` (a first turn), identical prompts are prefilled once (a group's
        envs start from one state, hence one prompt) and their cache rows copied to every
        row that has them (``share_prompts``, on by default). With ``group_prefix``, when the
        rows are groups of equal size with one prompt each (a rollout's groups), the prompts'
        slots are not copied: the cache holds them once as a shared prefix that every later
        turn's rows attend to in place (``KVCache.with_group_prefix``).
        """
        del env_states
        tokens, valid = self._bucketed(prompts, mask, bucket, first=cache is None)
        b, n = tokens.shape[0], params.max_new_tokens
        act = np.ones((b,), bool) if active is None else np.asarray(active, bool)
        if np.any(act & ~valid.any(axis=1)):
            raise ValueError("every active sequence needs at least one real prompt token")
        expand, grouped = None, False
        if self.paged:
            pass  # its own prompt sharing and cache (``_paged``)
        elif cache is None:
            tokens, valid, expand, grouped = self._shared_prompts(tokens, valid, act)
            # A group prefix: its rows' own slots hold the rest.
            size = tokens.shape[1] + (0 if grouped else n)
            cache = _empty_cache(self.config, tokens.shape[0], size)
        else:
            cache = self._with_room(cache, b, tokens.shape[1] + n)
        budget = np.full((b,), n, np.int32) if max_new is None else np.minimum(
            np.asarray(max_new, np.int32), n)
        table = None if stop_strings is None else stop_strings.device_table(self.config.vocab_size)
        if self.paged:
            return self._paged(tokens, valid, act, budget, cache, key, params,
                               stop_rows(stop_tokens, b), table)
        run = generate_jit(expand is not None, self.options)
        # Host arrays go to the jitted call as they are (its C++ path moves them).
        return run(self.graph, self.state, cache, tokens, valid, stop_rows(stop_tokens, b),
                   budget, act, key, expand, table, sp=params, pad_id=self.pad_id,
                   group_prefix=bool(grouped), prefill_tokens=self.prefill_tokens)

    def _paged(self, tokens: np.ndarray, valid: np.ndarray, active: np.ndarray,
               budget: np.ndarray, cache: PagedState | None, key: jax.Array,
               params: SamplingParams, stop: np.ndarray, stop_table) -> SampleOutput:
        """``__call__`` on the paged cache (``paged_sampling``): the host plans the blocks,
        one jitted program prefills and decodes; the output's ``cache`` is a ``PagedState``."""
        b = tokens.shape[0]
        if cache is None:
            rows, rows_valid, expand, _ = self._shared_prompts(tokens, valid, active)
            per_row = -(-self.max_row_tokens // self.block_size)
            blocks = self.kv_blocks or b * per_row
            allocator = BlockAllocator(blocks, self.block_size, b, per_row)
            state = PagedState(empty_pages(self.config, b, blocks, per_row, self.block_size),
                               allocator, np.zeros(b, bool))
            plan = first_turn_plan(allocator, rows, rows_valid, expand, budget, active)
        else:
            if not isinstance(cache, PagedState) or cache.allocator.table.shape[0] != b:
                raise ValueError(f"a paged sampler continues its own PagedState of {b} rows")
            state = cache
            plan = next_turn_plan(state, tokens, valid, budget, active)
        run = generate_paged_jit(self.options)
        out = run(self.graph, self.state, state.cache, dataclasses.asdict(plan), stop, budget,
                  active, key, stop_table, sp=params, pad_id=self.pad_id, impl=self.paged_impl)
        return out.replace(cache=PagedState(out.cache, state.allocator, state.released))

    def _bucketed(self, prompts, mask, bucket: int | None, *, first: bool
                  ) -> tuple[np.ndarray, np.ndarray]:
        """The prompts left-padded to their bucket (``pad_prompts``), and to the widest bucket
        this kind of call (``first`` turn or continuation) has had, with ``marks``."""
        tokens, valid = pad_prompts(prompts, mask, bucket=bucket, pad_id=self.pad_id,
                                    min_bucket=self.min_bucket, multiple=self.bucket_multiple)
        if self.marks is not None and bucket is None:
            site = "prompt/first" if first else "prompt/next"
            extra = self.marks.fit(site, tokens.shape[1]) - tokens.shape[1]
            if extra:  # left padding, like the rest of the bucket
                tokens = np.pad(tokens, ((0, 0), (extra, 0)), constant_values=self.pad_id)
                valid = np.pad(valid, ((0, 0), (extra, 0)))
        return tokens, valid

    def _shared_prompts(self, tokens: np.ndarray, valid: np.ndarray, active: np.ndarray
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, bool]:
        """A first turn's prompts to prefill, each once (``share_prompts``): ``(tokens,
        valid, expand, grouped)``, ``expand [B]`` the prefilled prompt of each row (None:
        every row its own), ``grouped`` whether the rows are groups of equal size with one
        prompt each, held once as a group prefix (``group_prefix``)."""
        b, expand = tokens.shape[0], None
        block = prompt_blocks(tokens, valid) if self.share_prompts and active.all() else 1
        if block > 1:
            # Groups of ``block`` rows that share a prompt (a rollout's first turn): one
            # prompt per group, even where two groups drew the same one, so the program
            # does not depend on which levels a batch happened to repeat.
            expand = np.repeat(np.arange(b // block, dtype=np.int32), block)
            tokens, valid = tokens[::block], valid[::block]
        elif self.share_prompts:
            tokens, valid, expand = distinct_rows(tokens, valid)
        grouped = self.group_prefix and expand is not None and np.array_equal(
            expand, np.repeat(np.arange(tokens.shape[0]), b // tokens.shape[0]))
        if expand is not None and not grouped:
            # How many prompts are distinct varies from call to call (a window's fresh
            # prompts, envs that moved alike): prefill a power-of-two count of them, so
            # that each count does not compile a program of its own.
            rows = min(b, bucket_length(tokens.shape[0], minimum=1))
            tokens, valid = pad_rows(tokens, rows), pad_rows(valid, rows)
        return tokens, valid, expand, bool(grouped)

    def _with_room(self, cache: KVCache, batch: int, tokens: int) -> KVCache:
        """``cache``, grown when its free slots cannot hold ``tokens`` more (the chunk and
        the new tokens): to ``episode_slots`` at least, else the next power of two (or
        multiple of ``cache_multiple``)."""
        if cache.batch != batch:
            raise ValueError(f"cache batch {cache.batch} != prompt batch {batch}")
        need = int(cache.index) + tokens  # one host read, outside the decode loop
        if need > cache.size:
            cache = _grown(cache, max(bucket_length(need, multiple=self.cache_multiple),
                                      self.episode_slots or 0))
        return cache


def stop_rows(stop_tokens: Sequence[int] | np.ndarray, batch: int) -> np.ndarray:
    """The stop ids as ``[batch, K]`` rows (a shared list repeated; -1, which never matches a
    token, when there are none)."""
    stop = np.asarray(stop_tokens, np.int32)
    if stop.ndim <= 1:  # shared stop list -> one row per sequence
        stop = np.broadcast_to(stop.reshape(1, -1), (batch, stop.size))
    if stop.shape[1] == 0:
        stop = np.full((batch, 1), -1, np.int32)
    return stop


def episode_slots(rollout) -> int:
    """Cache slots that hold a whole episode of ``rollout`` (a ``RolloutConfig``): its
    ``max_model_len`` real tokens, plus each turn's prompt padding (under ``sampler.prompt_pad_multiple``)
    and a full answer's slots a turn (the batch decodes to its longest answer), rounded up to
    64. The cache grows to this once, at the second turn; a batch whose turns still need more
    (rows whose longest prompts and answers fall in different turns) grows again."""
    multiple = rollout.sampler.prompt_pad_multiple
    return round_up(rollout.max_model_len + rollout.max_turn * (multiple + rollout.response_length),
                    64)


def pad_rows(x: np.ndarray, rows: int) -> np.ndarray:
    """``x [D, ...]`` with copies of its row 0 appended up to ``rows`` rows (rows that
    ``expand`` never points to: real tokens, so nothing in them is fully masked)."""
    return np.concatenate([x, np.repeat(x[:1], rows - x.shape[0], axis=0)]) if rows > x.shape[0] else x


def prompt_blocks(tokens: np.ndarray, valid: np.ndarray) -> int:
    """The size ``k`` of the blocks of consecutive rows with one prompt each when
    ``tokens``/``valid [B, P]`` are such blocks of equal size (the greatest common divisor of
    the runs of equal rows: two neighbouring groups with one prompt make a run of ``2k``,
    still ``k`` a block), else 1."""
    rows = np.where(valid, tokens, -1)
    if rows.shape[0] < 2:
        return 1
    same = (rows[1:] == rows[:-1]).all(axis=1)  # [B - 1]: row i + 1 repeats row i
    starts = np.flatnonzero(np.concatenate([[True], ~same]))
    runs = np.diff(np.append(starts, rows.shape[0]))
    return int(np.gcd.reduce(runs))


def distinct_rows(tokens: np.ndarray, valid: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """The distinct prompts of ``tokens``/``valid [B, P]`` in order of first appearance and
    ``expand [B]`` (row b is distinct prompt ``expand[b]``), or the inputs and None when
    every row is distinct."""
    if tokens.shape[0] < 2:
        return tokens, valid, None
    rows = np.where(valid, tokens, -1)
    _, first, inverse = np.unique(rows, axis=0, return_index=True, return_inverse=True)
    if first.size == rows.shape[0]:
        return tokens, valid, None
    order = np.argsort(first)  # distinct prompts in order of first appearance
    rank = np.empty_like(order)
    rank[order] = np.arange(order.size)
    keep = first[order]
    return tokens[keep], valid[keep], rank[inverse.reshape(-1)].astype(np.int32)
