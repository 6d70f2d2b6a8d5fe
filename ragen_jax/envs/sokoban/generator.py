"""Sokoban's level generator: a solvable, unsolved level from a PRNG key, on device.

A random-walk room topology, the player and the boxes placed on floor with every box on its
own target, then reverse play (the player *pulls* boxes) away from the solved position, as
gym-sokoban (and RAGEN, which adapts it) does. Reverse play makes every level solvable by
construction. The choices that differ from RAGEN's are listed on ``sokoban.env.Sokoban``.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from ragen_jax.envs.grid import reachable
from ragen_jax.envs.sokoban.types import DELTAS, FLOOR, TARGET, WALL, EnvState

# (walks, pulls per walk) of the reverse search for 1, 2, 3 and more boxes (see ``Sokoban``).
SEARCH_EFFORT = ((2, 8), (16, 16), (64, 72))

# gym-sokoban's five 3x3 floor stamps for the topology random walk.
_STAMPS = np.array([
    [[0, 0, 0], [1, 1, 1], [0, 0, 0]],
    [[0, 1, 0], [0, 1, 0], [0, 1, 0]],
    [[0, 0, 0], [1, 1, 0], [0, 1, 0]],
    [[0, 0, 0], [1, 1, 0], [1, 1, 0]],
    [[0, 0, 0], [0, 1, 1], [0, 1, 0]],
], bool)


def _room_topology(key: jax.Array, dim_room: tuple[int, int], num_steps: int,
                   p_change_direction: float = 0.35) -> jax.Array:
    """gym-sokoban's random walk of 3x3 floor stamps; the border is wall.  # [H, W] bool"""
    height, width = dim_room
    bits = jax.random.bits(key, (num_steps + 1,))  # one 32-bit word per step (+1 for the start)
    first = bits[0]
    step_bits = bits[1:]
    return topology_from_draws(
        dim_room,
        start=1 + jnp.stack([_below(first, height - 1, 0), _below(first, width - 1, 8)]),
        first_direction=_below(first, 4, 16),
        change=_unit16(step_bits, 0) < p_change_direction,
        new_direction=_below(step_bits, 4, 16),
        stamp=_below(step_bits, len(_STAMPS), 24))


# Level generation draws raw 32-bit words and cuts them into small uniform numbers: on CPU,
# threefry costs about 10 ns per word, which dominated generation when every coin flip and
# every noise value took a word of its own. Resolution: 8 bits for small choices (bias below
# 1/256 of a cell), 16 bits for probabilities and tie-breaking noise.
def _below(bits: jax.Array, n: int, shift: int) -> jax.Array:
    """A nearly uniform integer in [0, n) from the 8 bits at ``shift``."""
    return (((bits >> shift) & 0xFF) * n >> 8).astype(jnp.int32)


def _unit16(bits: jax.Array, shift: int) -> jax.Array:
    """A uniform float in [0, 1) on a 2**-16 grid, from the 16 bits at ``shift``."""
    return ((bits >> shift) & 0xFFFF).astype(jnp.float32) / 65536.0


def _noise16(key: jax.Array, n: int) -> jax.Array:
    """``n`` uniform floats on a 2**-16 grid from ``ceil(n / 2)`` words (argmax tie-breaking)."""
    words = jax.random.bits(key, ((n + 1) // 2,))
    return jnp.stack([_unit16(words, 0), _unit16(words, 16)], -1).reshape(-1)[:n]


# Walk directions (row, col), in gym-sokoban's order; the stamps as 9-bit masks (bit 3r + c).
WALK_DIRECTIONS = np.array([[1, 0], [0, 1], [-1, 0], [0, -1]], np.int32)
_STAMP_BITS = np.array([sum(1 << i for i, v in enumerate(s.reshape(-1)) if v) for s in _STAMPS], np.int32)


def topology_from_draws(dim_room: tuple[int, int], start: jax.Array, first_direction: jax.Array,
                        change: jax.Array, new_direction: jax.Array, stamp: jax.Array) -> jax.Array:
    """The random walk given its random draws: ``start`` [2], ``first_direction`` (),
    per step ``change`` [T] bool, ``new_direction`` [T], ``stamp`` [T].  # [H, W] bool

    The walk itself is a scan over positions; the stamps are OR-ed as per-row bit masks
    (a scatter per step is several times slower under ``vmap``). Rooms up to 31 wide."""
    height, width = dim_room
    directions = jnp.asarray(WALK_DIRECTIONS)
    low, high = jnp.array([1, 1]), jnp.array([height - 2, width - 2])

    def walk(carry, xs):
        pos, direction = carry
        change_t, new_dir_t = xs
        direction = jnp.where(change_t, new_dir_t, direction)
        pos = jnp.clip(pos + directions[direction], low, high)
        return (pos, direction), pos

    _, centres = jax.lax.scan(walk, (start, first_direction), (change, new_direction))  # [T, 2]
    # Row r of the level as a bit mask over columns: OR over steps of the stamp's row
    # (r - centre_row + 1), a 3-bit pattern, shifted to start at column centre_col - 1.
    dr = jnp.arange(height)[None, :] - centres[:, 0, None] + 1  # [T, H]
    pattern = (jnp.asarray(_STAMP_BITS)[stamp][:, None] >> (3 * jnp.clip(dr, 0, 2))) & 7
    pattern = jnp.where((dr >= 0) & (dr < 3), pattern << (centres[:, 1, None] - 1), 0)
    row_bits = jax.lax.reduce(pattern, np.int32(0), jax.lax.bitwise_or, (0,))  # [H]
    level = ((row_bits[:, None] >> jnp.arange(width)[None, :]) & 1).astype(bool)
    rows = jnp.arange(height)[:, None]
    cols = jnp.arange(width)[None, :]
    interior = (rows > 0) & (rows < height - 1) & (cols > 0) & (cols < width - 1)
    return level & interior


_UNREACHED = 1 << 20
# A batched generate_level retries failed levels in chunks of batch size / _RETRY_CHUNKS.
_RETRY_CHUNKS = 16


def _row_bits(mask: jax.Array) -> jax.Array:
    """A [..., H, W] bool grid as per-row bit masks (bit c = column c).  # [..., H] int32"""
    width = mask.shape[-1]
    return jnp.sum(mask.astype(jnp.int32) << jnp.arange(width, dtype=jnp.int32), -1)


def _bit(rows: jax.Array, cells: jax.Array) -> jax.Array:
    """The bits of ``cells`` [..., 2] in the row masks ``rows`` [H].  # [...] int32 (0 or 1)"""
    return (rows[cells[..., 0]] >> cells[..., 1]) & 1


def _distances(passable: jax.Array, start: jax.Array, cells: jax.Array, max_dist: int) -> jax.Array:
    """Walking distance from ``start`` [2] to each of ``cells`` [C, 2] through the ``passable``
    row masks [H] (breadth-first, a layer per iteration, on bit masks); ``_UNREACHED`` beyond
    ``max_dist`` or where no path exists.  # [C] int32"""
    height = passable.shape[0]
    zero = jnp.zeros(1, jnp.int32)
    reach = jnp.zeros(height, jnp.int32).at[start[0]].set(1 << start[1])
    dist = jnp.where(_bit(reach, cells) == 1, 0, _UNREACHED)

    def layer(carry):
        reach, dist, i, _ = carry
        grown = reach | (reach << 1) | (reach >> 1)
        grown = grown | jnp.concatenate([reach[1:], zero]) | jnp.concatenate([zero, reach[:-1]])
        grown = (grown & passable) | reach
        dist = jnp.where((dist == _UNREACHED) & (_bit(grown, cells) == 1), i + 1, dist)
        return grown, dist, i + 1, jnp.any(grown != reach)

    _, dist, _, _ = jax.lax.while_loop(lambda c: c[3] & (c[2] < max_dist), layer,
                                       (reach, dist, jnp.int32(0), jnp.bool_(True)))
    return dist


def _reverse_search(key, floor, player, targets, num_walks, num_pulls, budget, greedy, lookahead):
    """Reverse play from the solved position, emulating the outcome of RAGEN's depth-first
    search: ``num_walks`` independent walks of at most ``num_pulls`` pulls each, in parallel.

    A step of a walk is one *pull*: the player walks (shortest path, pulling nothing) to a cell
    next to a box and steps away from it, dragging the box one cell. Walking plus pulling costs
    moves; a walk stops when no pull fits in ``budget`` moves (RAGEN's DFS reaches states at most
    ``search_depth - 2`` moves deep). The pull is random among those available, restricted with
    probability ``greedy`` to those taking the box further from its target. Every state a pull
    leads to (with ``lookahead``, also the pulls not followed) is scored like RAGEN's room score: ``box_swaps * sum |box - its
    target|_1`` (zero while a box or the player covers a target; a swap is a pull of another box
    than the previous pull). Returns the best over all walks: (score, player [2], boxes [N, 2]).
    """
    height, width = floor.shape
    n = targets.shape[0]
    deltas = jnp.asarray(DELTAS)
    floor_rows = _row_bits(floor)
    target_rows = _row_bits(jnp.zeros((height, width), bool).at[targets[:, 0], targets[:, 1]].set(True))
    max_dist = min(budget, (height - 2) * (width - 2))
    # Per walk step: 16-bit tie-breaking noise per candidate pull; bits 16-23 of the first word
    # are the greedy coin.
    bits = jax.random.bits(key, (num_pulls, num_walks, 4 * n))
    noise = (bits & 0xFFFF).astype(jnp.int32)
    greedy_coin = ((bits[..., 0] >> 16) & 0xFF) < int(round(greedy * 256))
    which = jnp.arange(4 * n) // 4  # candidate pull c moves box c // 4 in direction c % 4
    tgt = targets[which]
    limit = jnp.array([height - 1, width - 1])

    def pull(carry, xs):
        pos, boxes, moves, last, swaps, best = carry
        noise, coin = xs
        on_target = _bit(target_rows, boxes) == 1  # [N]
        passable = floor_rows & ~_row_bits(jnp.zeros((height, width), bool).at[boxes[:, 0], boxes[:, 1]].set(True))
        old = boxes[which]  # [4N, 2]
        stand = old + deltas[jnp.arange(4 * n) % 4]  # the box's new cell; the player walks here
        dest = jnp.clip(stand + deltas[jnp.arange(4 * n) % 4], 0, limit)  # where the player ends
        dist = _distances(passable, pos, stand, max_dist)
        ok = ((_bit(passable, stand) == 1) & (_bit(passable, dest) == 1)
              & (moves + dist + 1 <= budget))
        # Score every reachable next state.
        old_d = jnp.abs(old - tgt).sum(-1)
        new_d = jnp.abs(stand - tgt).sum(-1)
        others_cover = jnp.stack([jnp.any(on_target & (jnp.arange(n) != i)) for i in range(n)])
        covered = others_cover[which] | (_bit(target_rows, stand) == 1) | (_bit(target_rows, dest) == 1)
        cand_score = (swaps + (which != last)) * (jnp.abs(boxes - targets).sum() - old_d + new_d)
        cand_score = jnp.where(ok & ~covered, cand_score, 0)
        top = jnp.argmax(cand_score)
        # Follow one of them.
        c = jnp.argmax(jnp.where(ok, noise + jnp.where(coin & (new_d > old_d), 1 << 16, 0), -1))
        top = top if lookahead else c
        better = cand_score[top] > best[0]
        top_boxes = jnp.where((jnp.arange(n) == which[top])[:, None], stand[top], boxes)
        best = (jnp.where(better, cand_score[top], best[0]), jnp.where(better, dest[top], best[1]),
                jnp.where(better, top_boxes, best[2]))
        go = ok[c]
        boxes = jnp.where(go & (jnp.arange(n) == which[c])[:, None], stand[c], boxes)
        pos = jnp.where(go, dest[c], pos)
        moves = moves + jnp.where(go, dist[c] + 1, budget)  # a walk with no pull left stops
        swaps = swaps + (go & (which[c] != last))
        last = jnp.where(go, which[c], last)
        return (pos, boxes, moves, last, swaps, best), None

    def walk(noise, coin):
        zero = jnp.int32(0)
        carry = (player, targets, zero, jnp.int32(-1), zero, (zero, player, targets))
        (_, _, _, _, _, best), _ = jax.lax.scan(pull, carry, (noise, coin))
        return best

    scores, pos, boxes = jax.vmap(walk, in_axes=(1, 1))(noise, greedy_coin)
    top = jnp.argmax(scores)
    return scores[top], pos[top], boxes[top]


def _wander(key, floor, boxes_grid, player, displacement, max_moves=3):
    """RAGEN's finishing touch: the player, who ends reverse play next to a box, walks 1-3
    non-revisiting steps with probability 0.8 (total displacement 1) or 0.5, each further step
    with probability 0.5."""
    k_move, k_steps = jax.random.split(key)
    p_move = jnp.where(displacement == 1, 0.8, 0.5)
    active = jax.random.uniform(k_move) < p_move
    deltas = jnp.asarray(DELTAS)
    height, width = floor.shape
    visited = jnp.zeros((height, width), bool).at[player[0], player[1]].set(True)

    def step(i, carry):
        pos, visited, active = carry
        k_choice, k_go_on = jax.random.split(jax.random.fold_in(k_steps, i))
        nxt = jnp.clip(pos[None] + deltas, 0, jnp.array([height - 1, width - 1]))  # [4, 2]
        ok = floor[nxt[:, 0], nxt[:, 1]] & ~boxes_grid[nxt[:, 0], nxt[:, 1]] & ~visited[nxt[:, 0], nxt[:, 1]]
        choice = jnp.argmax(jnp.where(ok, jax.random.uniform(k_choice, (4,)), -1.0))
        go = active & ok.any()
        pos = jnp.where(go, nxt[choice], pos)
        visited = visited.at[pos[0], pos[1]].set(True)
        active = go & (jax.random.uniform(k_go_on) < 0.5)
        return pos, visited, active

    pos, _, _ = jax.lax.fori_loop(0, max_moves, step, (player, visited, active))
    return pos


def _layout(key, dim_room, num_boxes, num_gen_steps):
    """Topology plus player and targets (boxes start on them). Cheap; returns
    (floor [H, W] bool, player [2], targets [N, 2], plausible) where ``plausible`` says the room
    has enough floor and the player can reach a cell from which some box can be pulled (without
    which reverse play cannot move any box)."""
    height, width = dim_room
    k_topo, k_place = jax.random.split(key)
    floor = _room_topology(k_topo, dim_room, num_gen_steps)
    # Player, then targets on distinct floor cells, each uniform (argmax of iid noise).
    noise = _noise16(k_place, height * width)
    flat_floor = floor.reshape(-1)
    player_flat = jnp.argmax(jnp.where(flat_floor, noise, -1.0))
    free = flat_floor.at[player_flat].set(False)
    _, target_flat = jax.lax.top_k(jnp.where(free, noise, -1.0), num_boxes)
    player = jnp.stack(jnp.divmod(player_flat, width)).astype(jnp.int32)
    targets = jnp.stack(jnp.divmod(target_flat, width), axis=-1).astype(jnp.int32)  # [N, 2]

    boxes = jnp.zeros(dim_room, bool).at[targets[:, 0], targets[:, 1]].set(True)
    passable = floor & ~boxes
    reach = reachable(passable, player)
    # A pull from direction d: player on box + d (reachable), stepping to box + 2d (passable).
    # A pull from direction d: the player on box + d (reachable), stepping to box + 2d
    # (passable). Some box must have one (not every box: a box freed by moving another makes
    # a harder level, and RAGEN's search finds those too).
    limit = jnp.array([height - 1, width - 1])
    stand = targets[:, None, :] + jnp.asarray(DELTAS)[None]  # [N, 4, 2]
    dest = jnp.clip(stand + jnp.asarray(DELTAS)[None], 0, limit)
    can_pull = (reach[stand[..., 0], stand[..., 1]] & passable[stand[..., 0], stand[..., 1]]
                & passable[dest[..., 0], dest[..., 1]])
    enough_floor = jnp.sum(flat_floor) > num_boxes + 1
    return floor, player, targets, enough_floor & jnp.any(can_pull)


def _finish(key, dim_room, layout, num_walks, num_pulls, budget, greedy, lookahead):
    """Reverse play and the player's wander on a layout. Returns (ok, EnvState)."""
    floor, player, targets, plausible = layout
    k_walks, k_wander = jax.random.split(key)
    score, player, boxes = _reverse_search(k_walks, floor, player, targets, num_walks, num_pulls,
                                           budget, greedy, lookahead)
    boxes_grid = jnp.zeros(dim_room, bool).at[boxes[:, 0], boxes[:, 1]].set(True)
    displacement = jnp.abs(boxes - targets).sum()
    player = _wander(k_wander, floor, boxes_grid, player, displacement)
    room_fixed = jnp.where(floor, FLOOR, WALL).astype(jnp.int8)
    room_fixed = room_fixed.at[targets[:, 0], targets[:, 1]].set(TARGET)
    state = EnvState(room_fixed, boxes_grid, player, jnp.int32(0), jnp.int32(0))
    return plausible & (score > 0), state


def fallback_level(dim_room: tuple[int, int], num_boxes: int) -> EnvState:
    """The level ``generate_level`` returns when every try failed: an open room, the targets
    along the bottom row of the interior from the left, each box one push above its target,
    the player in the top-right interior corner. Solvable and not solved (needs
    ``num_boxes <= width - 2`` and a room of at least 5x5)."""
    height, width = dim_room
    room_fixed = np.full(dim_room, WALL, np.int8)
    room_fixed[1:-1, 1:-1] = FLOOR
    room_fixed[height - 2, 1:1 + num_boxes] = TARGET
    boxes = np.zeros(dim_room, bool)
    boxes[height - 3, 1:1 + num_boxes] = True
    return EnvState(jnp.asarray(room_fixed), jnp.asarray(boxes), jnp.array([1, width - 2], jnp.int32),
                    jnp.int32(0), jnp.int32(0))


@partial(jax.jit, static_argnums=tuple(range(1, 12)))
def generate_level(key: jax.Array, dim_room: tuple[int, int], num_boxes: int, num_gen_steps: int,
                   budget: int, num_walks: int, num_pulls: int, greedy: float,
                   lookahead: bool, num_layouts: int, searches_per_try: int, max_tries: int
                   ) -> tuple[jax.Array, EnvState]:
    """A solvable, unsolved level from ``key``. Returns (ok, state).

    A try draws ``num_layouts`` cheap layouts at once and runs reverse play (``_reverse_search``
    with ``budget`` moves) on the first ``searches_per_try`` plausible
    ones in parallel, keeping the first that uncovers every target. A failed try repeats from
    ``fold_in(key, try)``, at most ``max_tries`` times. If every try failed, ``ok`` is False and
    the level is ``fallback_level`` (never a solved one). ``boxes_on_target`` is counted, so a
    level can never pay a reward for a box it did not move.

    Under ``vmap`` (a custom batching rule, ``_batched_tries``) the first try runs on the whole
    batch and later tries only on the levels still failing, in chunks of
    ``batch / _RETRY_CHUNKS``, instead of the whole batch repeating tries until its unluckiest
    level is done; every key still gets the level it gets unbatched.
    """
    attempt = partial(_attempt, dim_room=dim_room, num_boxes=num_boxes,
                      num_gen_steps=num_gen_steps, budget=budget, num_walks=num_walks,
                      num_pulls=num_pulls, greedy=greedy, lookahead=lookahead,
                      num_layouts=num_layouts, searches_per_try=searches_per_try)
    finalize = partial(_finalize, dim_room=dim_room, num_boxes=num_boxes)

    @jax.custom_batching.custom_vmap
    def tries(key):
        def retry(carry):
            tries, _, _ = carry
            ok, state = attempt(jax.random.fold_in(key, tries))
            return tries + 1, ok, state

        fallback = fallback_level(dim_room, num_boxes)
        _, ok, state = jax.lax.while_loop(
            lambda c: ~c[1] & (c[0] < max_tries), retry, (jnp.int32(0), jnp.bool_(False), fallback))
        return finalize(ok, state)

    tries.def_vmap(partial(_batched_tries, tries, attempt, finalize, dim_room, num_boxes, max_tries))
    return tries(key)


def _attempt(attempt_key, *, dim_room, num_boxes, num_gen_steps, budget, num_walks, num_pulls,
             greedy, lookahead, num_layouts, searches_per_try):
    """One try: ``num_layouts`` layouts, reverse play on the first ``searches_per_try``
    plausible ones; (ok, state) of the first that uncovered every target."""
    k_layouts, k_finish = jax.random.split(attempt_key)
    layouts = jax.vmap(lambda k: _layout(k, dim_room, num_boxes, num_gen_steps))(
        jax.random.split(k_layouts, num_layouts))
    order = jnp.argsort(~layouts[3], stable=True)[:searches_per_try]  # plausible ones first
    oks, states = jax.vmap(
        lambda i, k: _finish(k, dim_room, jax.tree.map(lambda x: x[i], layouts), num_walks,
                             num_pulls, budget, greedy, lookahead)
    )(order, jax.random.split(k_finish, searches_per_try))
    first = jnp.argmax(oks)
    return oks[first], jax.tree.map(lambda x: x[first], states)


def _finalize(ok, state, *, dim_room, num_boxes):
    """The level, or ``fallback_level`` where every try failed, with its boxes on target
    counted."""
    # (fallback_level is built inside each traced function: custom_vmap takes no closed-over
    # tracers.)
    fallback = fallback_level(dim_room, num_boxes)
    state = jax.tree.map(lambda new, old: jnp.where(ok, new, old), state, fallback)
    on_target = jnp.sum(state.boxes & (state.room_fixed == TARGET), dtype=jnp.int32)
    return ok, state.replace(boxes_on_target=on_target)


def _batched_tries(tries, attempt, finalize, dim_room, num_boxes, max_tries,
                   axis_size, in_batched, keys):
    """``generate_level``'s batching rule.

    Under ``vmap`` a while loop runs its body on the whole batch until the last level is done,
    so a batch would pay for the most tries any of its levels needs (3 of ~1.05 at 10x10 with
    3 boxes). Instead: the first try on the whole batch, then the retries on the failed levels
    only, gathered into chunks of ``axis_size // _RETRY_CHUNKS``. Each level still sees tries
    ``fold_in(key, 0), fold_in(key, 1), ...`` in order: the same levels.
    """
    out_batched = jax.tree.map(lambda _: True, jax.eval_shape(finalize, jnp.bool_(False),
                                                                 fallback_level(dim_room, num_boxes)))
    if not in_batched[0] or max_tries < 1:
        one = tries(keys if not in_batched[0] else keys[0])
        return jax.tree.map(lambda x: jnp.broadcast_to(x, (axis_size, *x.shape)), one), \
            out_batched
    ok, state = jax.vmap(lambda k: attempt(jax.random.fold_in(k, 0)))(keys)
    chunk = max(1, min(axis_size, -(-axis_size // _RETRY_CHUNKS)))

    def retry(carry):
        count, ok, state = carry
        pending = ~ok & (count < max_tries)
        (idx,) = jnp.nonzero(pending, size=chunk, fill_value=axis_size)
        safe = jnp.minimum(idx, axis_size - 1)
        ok_c, state_c = jax.vmap(lambda k, t: attempt(jax.random.fold_in(k, t)))(
            keys[safe], count[safe])
        count = count.at[idx].add(1, mode="drop")
        ok = ok.at[idx].set(ok_c, mode="drop")
        state = jax.tree.map(lambda s, c: s.at[idx].set(c, mode="drop"), state, state_c)
        return count, ok, state

    count = jnp.ones(axis_size, jnp.int32)
    _, ok, state = jax.lax.while_loop(
        lambda c: jnp.any(~c[1] & (c[0] < max_tries)), retry, (count, ok, state))
    return jax.vmap(finalize)(ok, state), out_batched
