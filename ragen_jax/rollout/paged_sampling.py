"""Sampling over a paged KV cache (``models/paged_cache.py``): each row writes at its own length
and decode attention reads only the blocks rows hold (``models/paged_attention.py``), so a
turn's cost follows the tokens held, not a dense cache's capacity, and a short answer or a
finished row leaves no empty slots behind for the others to read.

``Sampler(paged=True)`` takes this path; its calls, outputs and tokens are the dense path's
(``SampleOutput``: the turn's left-padded prompt slots and generated tokens, which the trainer
reads), except that ``SampleOutput.cache`` is a ``PagedState``: the device cache and the host
``BlockAllocator`` that says which blocks each row holds, handed back on the next turn.

Per call, everything the host decides is decided before the one jitted program runs:

1. First turn: every distinct prompt is prefilled once, into the blocks of the first row that
   has it; the other rows with that prompt ``fork`` it (its full blocks shared, its partial
   last block copied once per row: ``copy_blocks`` inside the program). A group's common
   first prompt is so held once, as ``KVCache.with_group_prefix`` holds it in the dense path.
2. A later turn: each row's blocks are first cut to what it holds (the blocks kept free for
   the previous answer's budget that it did not use go back) and rows that take no part any
   more (a finished episode) give all theirs back; then the new chunk is prefilled at each
   row's own length.
3. Every answering row gets room for its budget before decoding; decode writes a token only
   for the rows still answering (no padding slot for finished rows).

What is not here yet: rows that take the next waiting episode when theirs ends (continuous
batching), prefill in blocks of rows (``sampler.prefill_block_rows``), and a model with
stacked layers (the sampler runs ``per_layer`` copies).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ragen_jax.models.paged_cache import BlockAllocator, OutOfBlocks, PagedKVCache
from ragen_jax.rollout.sampling import Draws, SampleOutput, draw_step


@dataclasses.dataclass(eq=False)
class PagedState:
    """A rollout's paged cache between turns: the device ``cache`` (pools, block table, each
    row's length) and the host ``allocator`` that owns its blocks. Continue it by passing it
    back as the next call's ``cache`` (its device buffers are donated then)."""

    cache: PagedKVCache
    allocator: BlockAllocator
    released: np.ndarray  # [B] bool: rows whose episode ended (their blocks given back)


@dataclasses.dataclass(frozen=True)
class Plan:
    """One call's host decisions (numpy), the jitted program's inputs."""

    tokens: np.ndarray  # [R, P] int32 prompt chunks, right-padded (real tokens first)
    counts: np.ndarray  # [R] int32 real tokens per prefilled row
    prefill_table: np.ndarray  # [R, M] int32 the prefilled rows' block tables
    prefill_lengths: np.ndarray  # [R] int32 tokens they hold before the chunk
    expand: np.ndarray  # [B] int32 each decode row's prefilled row
    copy_src: np.ndarray  # [B] int32 blocks copied after the prefill (forks' partial blocks)
    copy_dst: np.ndarray  # [B] int32 their copies (the pool size: no copy)
    table: np.ndarray  # [B, M] int32 the decode rows' block tables
    lengths: np.ndarray  # [B] int32 tokens each decode row holds after the prefill


def right_padded(tokens: np.ndarray, valid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Left-padded ``tokens``/``valid [R, P]`` (the sampler's buckets) as right-padded tokens,
    each row's real tokens first in their order, and their counts ``[R]``."""
    counts = valid.sum(1).astype(np.int32)
    p = tokens.shape[1]
    index = (np.arange(p)[None, :] + (p - counts)[:, None]) % p  # real ones, then the padding
    return np.take_along_axis(tokens, index, 1).astype(np.int32), counts


def first_turn_plan(allocator: BlockAllocator, tokens: np.ndarray, valid: np.ndarray,
                    expand: np.ndarray | None, budget: np.ndarray, active: np.ndarray) -> Plan:
    """A first turn's plan: ``tokens``/``valid [R, P]`` the distinct prompts (left-padded;
    rows past the last one ``expand`` names are padding, prefilled with nothing written),
    ``expand [B]`` each row's prompt (None: row b has prompt b), ``budget [B]`` its new
    tokens."""
    b = allocator.table.shape[0]
    expand = np.arange(b, dtype=np.int32) if expand is None else np.asarray(expand, np.int32)
    prefill_rows = tokens.shape[0]
    d = int(expand.max()) + 1
    ids, counts = right_padded(tokens[:d], valid[:d])
    source = np.array([int(np.flatnonzero(expand == i)[0]) for i in range(d)], np.int64)
    copies = []
    for i, row in enumerate(source):
        allocator.reserve(int(row), int(counts[i]))
    prefill_table = allocator.table[source].copy()
    for i, row in enumerate(source):
        others = [int(r) for r in np.flatnonzero(expand == i) if r != row]
        if others:
            copies += allocator.fork(int(row), others)
    lengths = counts[expand]
    _reserve_answers(allocator, lengths, budget, active)
    pad = prefill_rows - d
    return Plan(
        tokens=np.concatenate([ids, np.zeros((pad, ids.shape[1]), np.int32)]),
        counts=np.concatenate([counts, np.zeros(pad, np.int32)]),
        prefill_table=np.concatenate([prefill_table, np.repeat(prefill_table[:1], pad, 0)]),
        prefill_lengths=np.zeros(prefill_rows, np.int32), expand=expand,
        **_copies(copies, b, allocator.num_blocks), table=allocator.table.copy(),
        lengths=lengths.astype(np.int32))


def next_turn_plan(state: PagedState, tokens: np.ndarray, valid: np.ndarray,
                   budget: np.ndarray, active: np.ndarray) -> Plan:
    """A later turn's plan: each row's blocks cut to what it holds (the device lengths the
    last call left), rows that do not answer released, the chunk ``tokens``/``valid [B, P]``
    (left-padded) prefilled at each row's length."""
    allocator = state.allocator
    held = np.asarray(jax.device_get(state.cache.lengths), np.int32)
    ids, counts = right_padded(tokens, valid)
    for row in range(held.size):
        if active[row] and state.released[row]:
            raise ValueError(f"row {row} answers again after its episode ended (its cache was "
                             "released): start a new rollout with cache=None")
        if not active[row] and counts[row]:
            raise ValueError(f"row {row} is inactive but has a prompt chunk")
        if active[row]:
            allocator.trim(row, int(held[row]))
        elif not state.released[row]:
            allocator.release(row)
            state.released[row] = True
    held = np.where(state.released, 0, held).astype(np.int32)
    lengths = held + counts
    _reserve_answers(allocator, lengths, budget, active)
    b = held.size
    return Plan(tokens=ids, counts=counts, prefill_table=allocator.table.copy(),
                prefill_lengths=held, expand=np.arange(b, dtype=np.int32),
                **_copies([], b, allocator.num_blocks), table=allocator.table.copy(),
                lengths=lengths.astype(np.int32))


def _reserve_answers(allocator: BlockAllocator, lengths: np.ndarray, budget: np.ndarray,
                     active: np.ndarray) -> None:
    """Room for each answering row's ``budget`` new tokens after its ``lengths``."""
    for row in np.flatnonzero(active):
        allocator.reserve(int(row), int(lengths[row] + budget[row]))


def _copies(copies: list[tuple[int, int]], rows: int, num_blocks: int) -> dict[str, np.ndarray]:
    """The forks' block copies as ``copy_src``/``copy_dst [rows]`` (unused entries copy onto
    block ``num_blocks``, out of range: dropped)."""
    if len(copies) > rows:
        raise OutOfBlocks(f"{len(copies)} block copies for {rows} rows")
    src = np.zeros(rows, np.int32)
    dst = np.full(rows, num_blocks, np.int32)
    if copies:
        src[:len(copies)], dst[:len(copies)] = np.asarray(copies, np.int32).T
    return {"copy_src": src, "copy_dst": dst}


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4))
def empty_pages(config, batch: int, num_blocks: int, max_blocks_per_row: int,
                block_size: int) -> PagedKVCache:
    """An empty per-layer ``PagedKVCache`` as one program."""
    return PagedKVCache.init(config, batch, num_blocks, max_blocks_per_row, block_size,
                             stacked=False)


def generate_paged(graph, state, cache: PagedKVCache, plan: dict, stop, budget, active, key,
                   stop_table=None, *, sp, pad_id: int, impl: str = "auto"):
    """The paged ``sampler._generate``: prefill ``plan``'s chunks (``Plan`` fields as arrays),
    copy the forks' blocks, then decode up to ``sp.max_new_tokens`` tokens per row, each
    sampled token fed back into its row's blocks. Returns a ``SampleOutput`` whose
    ``prompt_tokens``/``prompt_mask`` are the decode rows' chunks left-padded again (the
    slots the trainer reads, as the dense path returns them) and whose ``cache`` is the
    ``PagedKVCache``."""
    model = nnx.merge(graph.graphdef, state)
    n = sp.max_new_tokens
    tokens, counts = plan["tokens"], plan["counts"]
    r, p = tokens.shape
    positions = plan["prefill_lengths"][:, None] + jnp.arange(p, dtype=jnp.int32)[None, :]
    cache = cache.replace(block_table=plan["prefill_table"], lengths=plan["prefill_lengths"])
    last = jnp.maximum(counts - 1, 0)  # [R] each row's last real token
    logits, cache = model.decode_paged(tokens, positions, counts, cache, logits_at=last, impl=impl)
    cache = cache.copy_blocks(plan["copy_src"], plan["copy_dst"])
    expand = plan["expand"]
    cache = cache.replace(block_table=plan["table"], lengths=plan["lengths"])
    logits = logits[expand, 0]  # [B, V]

    def cond(s):
        step, _, _, draws = s
        return (step < n) & ~jnp.all(draws.done)

    def body(s):
        step, cache, logits, draws = s
        tok, emit, draws = draw_step(draws, step, logits, key, stop, budget, stop_table, sp,
                                     pad_id)
        # The token goes into its row's blocks; a finished row writes nothing.
        new_logits, cache = model.decode_paged(tok[:, None], cache.lengths[:, None],
                                               emit.astype(jnp.int32), cache, impl=impl)
        return step + 1, cache, new_logits[:, 0], draws

    init = (jnp.zeros((), jnp.int32), cache, logits,
            Draws.start(~active | (budget <= 0), n, pad_id))
    step, cache, _, draws = jax.lax.while_loop(cond, body, init)
    out_mask = jnp.arange(n)[None, :] < draws.lengths[:, None]
    # The chunks left-padded again, as the dense path's slots: real tokens last.
    rows_counts = counts[expand]
    index = (jnp.arange(p)[None, :] - (p - rows_counts)[:, None]) % p
    prompt_tokens = jnp.take_along_axis(tokens[expand], index, 1)
    prompt_mask = jnp.arange(p)[None, :] >= (p - rows_counts)[:, None]
    prompt_tokens = jnp.where(prompt_mask, prompt_tokens, pad_id)
    return SampleOutput(tokens=draws.tokens, mask=out_mask, logprobs=draws.logprobs,
                        model_logprobs=draws.model_logprobs, lengths=draws.lengths, steps=step,
                        prompt_tokens=prompt_tokens, prompt_mask=prompt_mask, cache=cache)


@functools.cache
def generate_paged_jit(options: tuple[tuple[str, str], ...] = ()):
    """The jitted ``generate_paged``, the cache argument donated."""
    return jax.jit(generate_paged, static_argnames=("graph", "sp", "pad_id", "impl"),
                   donate_argnames=("cache",), compiler_options=dict(options) or None)
