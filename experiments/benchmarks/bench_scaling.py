"""Scaling: weak scaling of the update over simulated devices, and per-device memory for 0.5B-7B.

Part 1 (runs; one subprocess per device count, ``--xla_force_host_platform_device_count``):
the tiny actor's jitted train step with the same per-device batch on 1, 2, 4 and 8 simulated
CPU devices (data-parallel mesh). These devices share this machine's cores, so the ideal is
*constant total tokens/s* (the work grows with the device count, the cores do not); a host
bottleneck that grows with the device count (dispatch, batch placement) would show as falling
tokens/s. The host time to place the global batch (``ragen_jax.distributed.global_rows``) and
to dispatch the step are reported apart.

Part 2 (compile only, 8 simulated devices, nothing allocated): per-device memory from XLA's
memory analysis for Qwen2.5-0.5B/1.5B/3B/7B shapes: the actor train step (AdamW, batch over
("data", "fsdp")) and the sampler (prefill + 64 decode steps with the KV cache) on a one-host
mesh, as each process samples with its local replica; for the code of an earlier commit
(``VARIANTS``: run from a temporary git worktree) and for this checkout's numerics options.

    python -m experiments.benchmarks.bench_scaling [--quick] [--skip-memory]

Writes ``experiments/results/bench_scaling.md``.
"""

from __future__ import annotations

import argparse
import ast
import os
import subprocess
import tempfile
import time
from pathlib import Path

from experiments.benchmarks.shapes import GiB
from experiments.common import RESULTS, ROOT, child_env, subprocess_results


def weak_scaling_child(devices: int, per_device: int, length: int, repeats: int) -> dict:
    """Runs in a process with ``devices`` simulated devices."""
    import jax
    import numpy as np
    from flax import nnx

    from experiments.benchmarks.shapes import model_config
    from ragen_jax import distributed as dist
    from ragen_jax.config.resolve import update_settings
    from ragen_jax.models import Qwen2ForCausalLM
    from ragen_jax.models.placement import shard_model
    from ragen_jax.sharding import make_mesh
    from ragen_jax.starpo.optimizer_step import (
        TrainBatch,
        jit_optimizer_step,
        make_optimizer,
    )

    assert jax.device_count() == devices, jax.devices()
    mesh = make_mesh((devices, 1, 1))
    cfg = model_config("tiny")
    model = shard_model(Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(0)), mesh)
    ucfg = update_settings(lr=1e-5)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    opt = make_optimizer(ucfg)
    opt_state = dist.on_mesh(opt.init(params), mesh)
    step = jit_optimizer_step(graphdef, ucfg, opt, mesh=mesh)
    rng = np.random.default_rng(0)
    b = per_device * devices
    host = dict(ids=rng.integers(0, cfg.vocab_size, (b, length), dtype=np.int32),
                attn=np.ones((b, length), bool),
                pos=np.broadcast_to(np.arange(length, dtype=np.int32), (b, length)).copy(),
                mask=np.ones((b, length), np.float32), lp=-np.ones((b, length), np.float32),
                adv=rng.standard_normal((b, length)).astype(np.float32))

    def place():
        g = {k: dist.global_rows(v, mesh) for k, v in host.items()}
        return TrainBatch(g["ids"], g["attn"], g["pos"], g["mask"], g["lp"], g["adv"], g["lp"])

    batch = place()
    t0 = time.perf_counter()
    params, opt_state, m = step(params, rest, opt_state, batch)
    jax.block_until_ready(params)
    compile_s = time.perf_counter() - t0
    place_s, dispatch_s, step_s = [], [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        batch = place()
        jax.block_until_ready(batch)
        t1 = time.perf_counter()
        params, opt_state, m = step(params, rest, opt_state, batch)
        t2 = time.perf_counter()
        jax.block_until_ready((params, m))
        t3 = time.perf_counter()
        place_s.append(t1 - t0)
        dispatch_s.append(t2 - t1)
        step_s.append(t3 - t1)
    med = lambda xs: float(np.median(xs))  # noqa: E731
    return dict(devices=devices, batch=b, length=length, compile_s=compile_s, place_s=med(place_s),
                dispatch_s=med(dispatch_s), step_s=med(step_s),
                tokens_per_s=b * length / med(step_s), loss=float(m["actor/pg_loss"]))


def run_weak_scaling(quick: bool) -> list[str]:
    counts = [1, 2] if quick else [1, 2, 4, 8]
    per_device, length, repeats = (2, 128, 2) if quick else (4, 256, 5)
    rows = ["| devices | global batch x length | step s | tokens/s | tokens/s vs 1 device | "
            "batch placement s | step dispatch s | compile s |", "|---|---|---|---|---|---|---|---|"]
    base = None
    for n in counts:
        code = ("import json\nfrom experiments.benchmarks.bench_scaling import weak_scaling_child\n"
                f"print('RESULT ' + json.dumps(weak_scaling_child({n}, {per_device}, {length}, {repeats})))")
        env = child_env(ROOT, XLA_FLAGS=f"--xla_force_host_platform_device_count={n}",
                        JAX_PLATFORMS="cpu")
        results, error = subprocess_results(code, env, timeout=1800)
        if not results:
            rows.append(f"| {n} | failed: {error} | | | | | | |")
            continue
        r = results[0]
        base = base or r["tokens_per_s"]
        rows.append(f"| {n} | {r['batch']} x {r['length']} | {r['step_s']:.3f} | "
                    f"{r['tokens_per_s']:,.0f} | {r['tokens_per_s'] / base:.2f} | "
                    f"{r['place_s']:.4f} | {r['dispatch_s']:.4f} | {r['compile_s']:.1f} |")
        print(rows[-1], flush=True)
    return rows


_MEMORY = r"""
import json, time
import jax
import jax.numpy as jnp
from flax import nnx
from experiments.benchmarks.shapes import model_config, train_batch
from ragen_jax.models import KVCache, Qwen2ForCausalLM
from ragen_jax.models.placement import param_shardings
from ragen_jax.rollout.sampler import SamplingParams
from ragen_jax.rollout.sampler import HashedGraph, generate_jit
_generate = generate_jit(False)
from ragen_jax.sharding import batch_sharding, make_mesh
from ragen_jax.config.resolve import update_settings
from ragen_jax.starpo.optimizer_step import make_optimizer, jit_optimizer_step
from jax.sharding import NamedSharding, PartitionSpec as P

def config(name):
    kw = dict(param_dtype=jnp.bfloat16, dtype=jnp.bfloat16)
    kw.update({k: getattr(jnp, v) if k.endswith("dtype") else v for k, v in OPTIONS.items()})
    return model_config(name, **kw)

def abstract_model(cfg, mesh, trainable=nnx.Param):
    abstract = nnx.eval_shape(lambda: Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(0)))
    abstract.model.activation_sharding = batch_sharding(mesh)
    graphdef, params, rest = nnx.split(abstract, trainable, ...)
    shard = lambda s: jax.tree.map(lambda v, sh: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sh), s,
                                   param_shardings(s, mesh), is_leaf=lambda x: isinstance(x, nnx.Variable))
    return graphdef, shard(params), rest

for kind, name, mesh_shape, batch, length in CASES:
    cfg = config(name)
    mesh = make_mesh(mesh_shape, jax.devices()[: mesh_shape[0] * mesh_shape[1] * mesh_shape[2]])
    start = time.perf_counter()
    try:
        if kind == "train":
            graphdef, params, rest = abstract_model(cfg, mesh)
            ucfg = update_settings(micro_batches=1)
            opt = make_optimizer(ucfg)
            opt_state = jax.eval_shape(opt.init, params)
            data = train_batch(batch, length, cfg.vocab_size, batch_sharding(mesh))
            compiled = jit_optimizer_step(graphdef, ucfg, opt).lower(params, rest, opt_state, data).compile()
        else:
            cfg = cfg.replace(param_dtype=cfg.dtype)  # the sampler's copy is in the compute dtype
            graphdef, state = nnx.split(nnx.eval_shape(lambda: Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(0))))
            state = jax.tree.map(lambda v, sh: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sh), state,
                                 param_shardings(state, mesh), is_leaf=lambda x: isinstance(x, nnx.Variable))
            new = 64
            rows = NamedSharding(mesh, P(("data", "fsdp")))
            cache = jax.eval_shape(lambda: KVCache.init(cfg, batch, length + new))
            cache = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                 sharding=rows if x.ndim else NamedSharding(mesh, P())), cache)
            arr = lambda shape, dt, sh=rows: jax.ShapeDtypeStruct(shape, dt, sharding=sh)
            key = jax.eval_shape(lambda: jax.random.key(0))
            compiled = _generate.lower(HashedGraph(graphdef), state, cache, arr((batch, length), jnp.int32),
                                       arr((batch, length), bool), arr((batch, 1), jnp.int32),
                                       arr((batch,), jnp.int32), arr((batch,), bool), key,
                                       sp=SamplingParams(max_new_tokens=new, temperature=1.0),
                                       pad_id=0).compile()
        mem = compiled.memory_analysis()
        res = dict(args=mem.argument_size_in_bytes, temp=mem.temp_size_in_bytes,
                   out=mem.output_size_in_bytes, alias=mem.alias_size_in_bytes)
    except Exception as e:  # report, do not hide
        res = dict(error=f"{type(e).__name__}: {str(e)[:200]}")
    res.update(kind=kind, name=name, mesh=list(mesh_shape), batch=batch, length=length,
               compile_s=time.perf_counter() - start)
    print("RESULT " + json.dumps(res), flush=True)
"""

# (kind, model, mesh (data, fsdp, tensor), global batch, length): one 8-device host.
MEMORY_CASES = [
    ("train", "0.5b", (1, 8, 1), 16, 1024), ("sample", "0.5b", (8, 1, 1), 128, 1024),
    ("train", "1.5b", (1, 8, 1), 16, 1024), ("sample", "1.5b", (8, 1, 1), 128, 1024),
    ("train", "3b", (1, 8, 1), 16, 1024), ("sample", "3b", (4, 1, 2), 128, 1024),
    ("train", "7b", (1, 8, 1), 16, 1024), ("sample", "7b", (2, 1, 4), 128, 1024),
]


# The memory variants: (label, git ref or None for this checkout, QwenConfig options).
# "before" is the commit before float32 master weights, chunked log-probs, scanned layers,
# remat and donation (its bench code, run from a temporary worktree); the others are now.
MIXED = dict(param_dtype="float32", dtype="bfloat16")
VARIANTS = [
    ("before: bf16 storage, full logits, unrolled, no remat, no donation", "e966477", {}),
    ("now: f32 master + bf16 compute, remat none", None, MIXED | dict(remat="none")),
    ("now: f32 master + bf16 compute, remat dots", None, MIXED | dict(remat="dots")),
    ("now: f32 master + bf16 compute, remat full", None, MIXED | dict(remat="full")),
]


def _memory_code(ref: str | None) -> tuple[str, Path | None]:
    """The ``_MEMORY`` child program of this checkout, or of commit ``ref`` (then run against
    a temporary worktree of it, whose path is returned to be removed)."""
    if ref is None:
        return _MEMORY, None
    tree = Path(tempfile.mkdtemp(prefix="bench_scaling_")) / "tree"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), ref],
                   check=True, capture_output=True)
    path = tree / "experiments" / "benchmarks" / "bench_scaling.py"
    if not path.exists():  # a commit before experiments/ had subfolders
        path = tree / "experiments" / "bench_scaling.py"
    source = path.read_text()
    node = next(n for n in ast.parse(source).body if isinstance(n, ast.Assign)
                and getattr(n.targets[0], "id", "") == "_MEMORY")
    return ast.literal_eval(node.value), tree


def run_memory(quick: bool, variants=VARIANTS) -> list[str]:
    cases = MEMORY_CASES[:2] if quick else MEMORY_CASES
    rows = ["| variant | what | model | mesh (data, fsdp, tensor) | global batch x length | "
            "per-device arguments GiB | per-device temp GiB | per-device total GiB | compile s |",
            "|---|---|---|---|---|---|---|---|---|"]
    for label, ref, options in variants:
        program, tree = _memory_code(ref)
        root = tree or ROOT
        # ROOT: an earlier commit's program imports its helpers by that path
        code = f"ROOT = {str(root)!r}\nCASES = {cases!r}\nOPTIONS = {options!r}\n" + program
        try:
            results, error = subprocess_results(code, timeout=3000, env=child_env(
                root, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu"))
        finally:
            if tree is not None:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)],
                               capture_output=True)
        for r in results:
            head = (f"| {label} | {r['kind']} | {r['name']} | {tuple(r['mesh'])} | "
                    f"{r['batch']} x {r['length']} |")
            if "error" in r:
                rows.append(f"{head} {r['error']} | | | |")
            else:  # outputs that reuse donated arguments are not counted twice
                total = r["args"] + r["temp"] + r["out"] - r.get("alias", 0)
                rows.append(f"{head} {r['args'] / GiB:.2f} | {r['temp'] / GiB:.2f} | "
                            f"{total / GiB:.2f} | {r['compile_s']:.0f} |")
            print(rows[-1], flush=True)
        if error:
            rows.append(f"\n{label}: {error}\n")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--skip-memory", action="store_true")
    args = ap.parse_args()
    import jax

    lines = [f"# bench_scaling (jax {jax.__version__}, {os.cpu_count()} CPU cores)", "",
             "## Weak scaling of the actor update (tiny, float32, same batch per device)", "",
             "Simulated devices share this machine's cores: the ideal is constant total tokens/s. "
             "Placement = building the global batch from host rows; dispatch = returning from the "
             "jitted call (host work per step).", ""]
    lines += run_weak_scaling(args.quick)
    if not args.skip_memory:
        lines += ["", "## Per-device memory, compile only (8 simulated devices = one host)", "",
                  "XLA:CPU's memory analysis of the compiled programs: arguments (parameters, AdamW "
                  "state and batch for train; parameters and KV cache for sample), temporaries, and "
                  "total = arguments + temporaries + outputs not aliased to donated arguments. Train: "
                  "one micro-batch. \"before\": commit e966477 (bf16 storage and moments, "
                  "full-vocabulary logits, unrolled layers, no donation); \"now\": float32 master "
                  "weights and moments, bf16 compute, chunked token scoring, scanned layers, "
                  "donation, by `model.remat`. Sample: bf16 weights, prefill of 1024 tokens + 64 "
                  "decode steps.", ""]
        lines += run_memory(args.quick)
    out = RESULTS / "bench_scaling.md"
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
