"""One layer's decode attention: today's dense ``attend`` over the whole cache capacity under a
validity mask vs the paged path (``paged_decode_attention``) over the blocks rows hold.

For each model shape (Qwen2.5-0.5B: 14 query / 2 key-value heads x 64; 7B: 28 / 4 x 128) it
prints, per layer and scaled by the layer count: the K/V bytes each path must read (analytic:
dense reads B x capacity slots, paged B x the longest row's chunks), XLA's own
``cost_analysis()`` "bytes accessed" of the compiled programs (lowered from shapes only, so the
RAGEN shapes cost no memory), and the wall time of both at the shape given by ``--rows`` /
``--capacity`` on this backend (small by default, for a CPU). ``cost_analysis`` counts a
``while`` loop's body once, whatever its trip count, so for the paged path it reports one chunk:
the analytic figure is the one that follows the lengths (and its figure includes the gather's
whole-pool operand, so it exceeds the dense one). The portable path runs every row to the
longest row's chunks: with a near-full row in flight (the default mix has B/16 of them) it
reads as much as dense; "paged with lengths <= S/8" times the same program on shorter rows.

    python -m experiments.benchmarks.bench_paged_decode [--rows 128 --capacity 5952 --impl auto]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from ragen_jax.models.attention import attend
from ragen_jax.models.paged_attention import DEFAULT_CHUNK_BLOCKS, paged_decode_attention

SHAPES = {"0.5B": dict(layers=24, heads=14, kv=2, d=64), "7B": dict(layers=28, heads=28, kv=4, d=128)}


def _lengths(rows: int, capacity: int, seed: int = 0) -> np.ndarray:
    """Mixed lengths: most rows a quarter to half of capacity, a few near full, some empty."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(capacity // 4, capacity // 2, size=rows)
    lengths[: max(1, rows // 16)] = capacity - 1
    lengths[-max(1, rows // 16):] = 0
    return lengths.astype(np.int32)


def _fns(kv: int, g: int, chunk_blocks: int, impl: str):
    def dense(q, k, v, valid):  # q [B, H, D], k [B, K, D, S], v [B, K, S, D], valid [B, S]
        b, _, d = q.shape
        out = attend(q.reshape(b, kv, g, 1, d), k, v, valid[:, None, :])
        return out.reshape(b, kv * g, d)

    def paged(q, k_pages, v_pages, table, lengths):
        return paged_decode_attention(q, k_pages, v_pages, table, lengths, impl=impl,
                                      chunk_blocks=chunk_blocks)

    return jax.jit(dense), jax.jit(paged)


def _specs(rows, capacity, block, kv, heads, d, dtype):
    m = -(-capacity // block)
    n = rows * m
    s = jax.ShapeDtypeStruct
    dense = (s((rows, heads, d), dtype), s((rows, kv, d, m * block), dtype),
             s((rows, kv, m * block, d), dtype), s((rows, m * block), bool))
    paged = (s((rows, heads, d), dtype), s((kv, n, block, d), dtype), s((kv, n, block, d), dtype),
             s((rows, m), jnp.int32), s((rows,), jnp.int32))
    return dense, paged


def _bytes(fn, specs) -> float:
    cost = fn.lower(*specs).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return float(cost.get("bytes accessed", float("nan")))


def _time(fn, args, reps: int) -> float:
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(reps):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / reps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=16, help="rows timed (RAGEN: 128)")
    parser.add_argument("--capacity", type=int, default=1024, help="slots timed (RAGEN ~5952)")
    parser.add_argument("--ragen-rows", type=int, default=128)
    parser.add_argument("--ragen-capacity", type=int, default=5952)
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--chunk-blocks", type=int, default=DEFAULT_CHUNK_BLOCKS)
    parser.add_argument("--impl", default="auto", help="paged impl: auto, xla, pallas_gpu, ...")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--shapes", default="0.5B,7B")
    args = parser.parse_args()
    dtype = jnp.bfloat16
    print(f"backend {jax.default_backend()}, bf16, block {args.block}, chunk "
          f"{args.chunk_blocks} blocks, paged impl {args.impl}")
    for name in args.shapes.split(","):
        sh = SHAPES[name]
        kv, heads, d, layers = sh["kv"], sh["heads"], sh["d"], sh["layers"]
        dense_fn, paged_fn = _fns(kv, heads // kv, args.chunk_blocks, args.impl)
        for label, rows, cap in (("ragen", args.ragen_rows, args.ragen_capacity),
                                 ("timed", args.rows, args.capacity)):
            lengths = _lengths(rows, cap)
            span = args.block * args.chunk_blocks
            chunks = -(-int(lengths.max()) // span)
            row_kv = 2 * kv * d * 2  # K and V bytes per slot, bf16
            dense_an = rows * (-(-cap // args.block) * args.block) * row_kv
            paged_an = rows * chunks * span * row_kv
            held = int(lengths.sum()) * row_kv
            d_specs, p_specs = _specs(rows, cap, args.block, kv, heads, d, dtype)
            line = (f"{name} {label} B={rows} S={cap} max_len={lengths.max()} "
                    f"mean_len={lengths.mean():.0f}: K/V read per layer dense "
                    f"{dense_an / 1e9:.3f} GB, paged {paged_an / 1e9:.3f} GB (held "
                    f"{held / 1e9:.3f} GB); x{layers} layers: dense {dense_an * layers / 1e9:.2f}"
                    f" GB, paged {paged_an * layers / 1e9:.2f} GB; cost_analysis bytes dense "
                    f"{_bytes(dense_fn, d_specs) / 1e9:.3f} GB, paged (one loop body) "
                    f"{_bytes(paged_fn, p_specs) / 1e9:.4f} GB")
            if label == "timed":
                rng = np.random.default_rng(1)
                m = -(-cap // args.block)
                s = m * args.block
                q = jnp.asarray(rng.normal(size=(rows, heads, d)), dtype)
                k = jnp.asarray(rng.normal(size=(rows, kv, d, s)), dtype)
                v = jnp.asarray(rng.normal(size=(rows, kv, s, d)), dtype)
                valid = jnp.asarray(np.arange(s)[None] < lengths[:, None])
                pages = jnp.asarray(rng.normal(size=(kv, rows * m, args.block, d)), dtype)
                table = jnp.asarray(rng.permutation(rows * m).reshape(rows, m), jnp.int32)
                t_dense = _time(dense_fn, (q, k, v, valid), args.reps)
                t_paged = _time(paged_fn, (q, pages, pages, table, jnp.asarray(lengths)),
                                args.reps)
                short = np.minimum(lengths, cap // 8).astype(np.int32)
                t_short = _time(paged_fn, (q, pages, pages, table, jnp.asarray(short)), args.reps)
                line += (f"; wall per layer dense {t_dense * 1e3:.2f} ms, paged "
                         f"{t_paged * 1e3:.2f} ms, paged with lengths <= S/8 "
                         f"{t_short * 1e3:.2f} ms")
            print(line, flush=True)


if __name__ == "__main__":
    main()
