"""Actor train-step throughput, and how the step fits on a pod (compile-only memory).

Part 1 (runs): tokens/s of the jitted actor update (forward, backward, AdamW) for the tiny
preset and a Qwen2.5-0.5B-shaped random model over a batch x length grid, with the compiled
step's memory from XLA's memory analysis.

Part 2 (compile only, in a subprocess with 64 simulated CPU devices): per-device memory of
the compiled step for Qwen2.5-0.5B, 3B and 7B shapes on meshes of 8 and 64 devices, with
parameters sharded by their partition specs and the batch over ("data", "fsdp"). Nothing is
allocated: parameters are abstract (``jax.ShapeDtypeStruct`` with shardings).

    python -m experiments.benchmarks.bench_update [--quick] [--skip-pod] [--only-compile-depth]

Writes ``experiments/results/bench_update.md``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time
from pathlib import Path

from experiments.benchmarks.shapes import GiB, model_config, train_batch
from experiments.common import RESULTS, ROOT, child_env, subprocess_results


def run_throughput(quick: bool) -> list[str]:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from ragen_jax.config.resolve import update_settings
    from ragen_jax.models import Qwen2ForCausalLM
    from ragen_jax.starpo.optimizer_step import jit_optimizer_step, make_optimizer

    grid = {"tiny": [(8, 256), (32, 256), (8, 1024)], "0.5b": [(1, 256), (2, 256)]}
    if quick:
        grid = {"tiny": [(8, 128)]}
    rows = ["| model | batch x length | tokens/s | step s | compile s | XLA temp GiB | args GiB |",
            "|---|---|---|---|---|---|---|"]
    for name, cells in grid.items():
        cfg = model_config(name)
        model = Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(0))
        ucfg = update_settings(lr=1e-6)
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        opt = make_optimizer(ucfg)
        opt_state = opt.init(params)
        step = jit_optimizer_step(graphdef, ucfg, opt)
        for batch, length in cells:
            data = train_batch(batch, length, cfg.vocab_size)
            start = time.perf_counter()
            compiled = step.lower(params, rest, opt_state, data).compile()
            compile_s = time.perf_counter() - start
            mem = compiled.memory_analysis()
            lr = jnp.float32(ucfg.lr)
            params, opt_state, _ = compiled(params, rest, opt_state, data, lr, None)  # donated: rebind
            jax.block_until_ready(params)
            start = time.perf_counter()
            params, opt_state, _ = compiled(params, rest, opt_state, data, lr, None)
            jax.block_until_ready(params)
            step_s = time.perf_counter() - start
            rows.append(f"| {name} | {batch} x {length} | {batch * length / step_s:,.0f} | {step_s:.2f} | "
                        f"{compile_s:.1f} | {mem.temp_size_in_bytes / GiB:.2f} | "
                        f"{mem.argument_size_in_bytes / GiB:.2f} |")
            print(rows[-1], flush=True)
    return rows


_POD = r"""
import json, time
import jax
jax.config.update("jax_num_cpu_devices", 64)
import jax.numpy as jnp
from flax import nnx
from experiments.benchmarks.shapes import model_config, train_batch
from ragen_jax.models import Qwen2ForCausalLM
from ragen_jax.models.placement import param_shardings
from ragen_jax.sharding import batch_sharding, make_mesh
from ragen_jax.config.resolve import update_settings
from ragen_jax.starpo.optimizer_step import make_optimizer, jit_optimizer_step

for name, mesh_shape, batch, length in CASES:
    cfg = model_config(name, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16)
    mesh = make_mesh(mesh_shape, jax.devices()[: mesh_shape[0] * mesh_shape[1] * mesh_shape[2]])
    abstract = nnx.eval_shape(lambda: Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(0)))
    abstract.model.activation_sharding = batch_sharding(mesh)  # as shard_model sets it
    graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
    shardings = param_shardings(params, mesh)
    params = jax.tree.map(lambda v, s: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s), params, shardings,
                          is_leaf=lambda x: isinstance(x, nnx.Variable))
    ucfg = update_settings(micro_batches=1)
    opt = make_optimizer(ucfg)
    opt_state = jax.eval_shape(opt.init, params)
    opt_state = jax.tree.map(lambda x: x, opt_state)
    data = train_batch(batch, length, cfg.vocab_size, batch_sharding(mesh))
    start = time.perf_counter()
    try:
        compiled = jit_optimizer_step(graphdef, ucfg, opt).lower(params, rest, opt_state, data).compile()
        mem = compiled.memory_analysis()
        res = dict(args=mem.argument_size_in_bytes, temp=mem.temp_size_in_bytes, out=mem.output_size_in_bytes)
    except Exception as e:  # report, do not hide
        res = dict(error=f"{type(e).__name__}: {str(e)[:200]}")
    res.update(name=name, mesh=list(mesh_shape), batch=batch, length=length, compile_s=time.perf_counter() - start)
    print("RESULT " + json.dumps(res), flush=True)
"""


_STEP = r"""
import json, sys, time
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from ragen_jax.models import Qwen2ForCausalLM, QwenConfig
try:
    from ragen_jax.starpo.optimizer_step import TrainBatch, UpdateConfig, jit_optimizer_step, make_optimizer
except ImportError:  # a commit from before the optimizer step had its module
    from ragen_jax.starpo.update import TrainBatch, UpdateConfig, make_optimizer
    from ragen_jax.starpo.update import make_train_step as jit_optimizer_step
try:
    from ragen_jax.config.resolve import update_settings
except ImportError:  # a commit from before the config package: UpdateConfig had defaults
    update_settings = UpdateConfig

def roofline(n=2048, repeats=5):
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    f = jax.jit(lambda x, y: x @ y)
    jax.block_until_ready(f(a, a))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(f(a, a))
        times.append(time.perf_counter() - t0)
    return 2 * n ** 3 / min(times) / 1e9

def batch_of(b, t, vocab):
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, vocab, (b, t)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    mask = jnp.asarray(np.arange(t)[None] >= t // 2, jnp.float32) * jnp.ones((b, 1))
    adv = jnp.asarray(rng.normal(size=(b, 1)), jnp.float32) * mask
    return TrainBatch(ids, jnp.ones((b, t), bool), pos, mask, -jnp.ones((b, t)), adv, -jnp.ones((b, t)))

for kind, layers, b, t, options in CASES:
    cfg = QwenConfig.qwen2_5_0_5b(**({"num_hidden_layers": layers} if layers else {}), **options)
    ucfg = update_settings(lr=1e-6)
    opt = make_optimizer(ucfg)
    res = dict(kind=kind, layers=cfg.num_hidden_layers, batch=b, length=t, options=options)
    try:
        if kind == "compile":
            abstract = nnx.eval_shape(lambda: Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(0)))
            graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
            opt_state = jax.eval_shape(opt.init, params)
            data = jax.eval_shape(lambda: batch_of(b, t, cfg.vocab_size))
            t0 = time.perf_counter()
            jit_optimizer_step(graphdef, ucfg, opt).lower(params, rest, opt_state, data).compile()
            res["compile_s"] = time.perf_counter() - t0
        else:
            res["roofline_gflops"] = roofline()
            graphdef, params, rest = nnx.split(Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)
            opt_state = opt.init(params)
            data = batch_of(b, t, cfg.vocab_size)
            step = jit_optimizer_step(graphdef, ucfg, opt)
            t0 = time.perf_counter()
            compiled = step.lower(params, rest, opt_state, data).compile()
            res["compile_s"] = time.perf_counter() - t0
            res["temp"] = compiled.memory_analysis().temp_size_in_bytes
            times = []
            for _ in range(REPEATS):
                t0 = time.perf_counter()
                params, opt_state, m = compiled(params, rest, opt_state, data, jnp.float32(1e-6), None)
                jax.block_until_ready(params)
                times.append(time.perf_counter() - t0)
            res["step_s"] = float(np.median(times))
            res["loss"] = float(m["actor/pg_loss"])
    except Exception as e:  # report, do not hide
        res["error"] = f"{type(e).__name__}: {str(e)[:200]}"
    print("RESULT " + json.dumps(res), flush=True)
"""


def train_flops(cfg, tokens: int, length: int) -> float:
    """Model FLOPs of a train step (forward + backward = 3 x forward; rematerialisation not
    counted), as in PaLM's MFU: 6 x (layer weights + the output head) per token plus the
    attention products, 12 x layers x heads x head_dim x length per token."""
    c = cfg
    per_layer = (c.hidden_size * c.num_attention_heads * c.head_dim * 2
                 + 2 * c.hidden_size * c.num_key_value_heads * c.head_dim
                 + 3 * c.hidden_size * c.intermediate_size)
    weights = c.num_hidden_layers * per_layer + c.hidden_size * c.vocab_size
    attention = 12 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * length
    return tokens * (6 * weights + attention)


def _checkout(ref: str | None) -> tuple[Path, Path | None]:
    """This checkout, or a temporary git worktree of ``ref`` (returned also to be removed)."""
    if ref is None:
        return ROOT, None
    import tempfile

    tree = Path(tempfile.mkdtemp(prefix="bench_update_")) / "tree"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), ref],
                   check=True, capture_output=True)
    return tree, tree


def _step_at(ref: str | None, cases: list, repeats: int) -> tuple[list[dict], str | None]:
    """Runs ``_STEP`` on ``cases`` in a fresh process, with the code of commit ``ref`` (None:
    this checkout)."""
    root, tree = _checkout(ref)
    code = f"CASES = {cases!r}\nREPEATS = {repeats}\n" + _STEP
    try:
        return subprocess_results(code, child_env(root, XLA_FLAGS=""), timeout=3000)
    finally:
        if tree is not None:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)],
                           capture_output=True)


def run_roofline(quick: bool, before: str = "e966477") -> list[str]:
    """The 0.5B-shaped float32 train step against this CPU's float32 matmul roofline, this
    checkout against commit ``before``, and the step's compile time against depth."""
    from ragen_jax.models import QwenConfig

    cells = [(1, 256)] if quick else [(2, 256)]  # 2 x 512 ran out of 24 GiB here
    rows = ["| code | batch x length | step s | tokens/s | model GFLOP/s | matmul roofline GFLOP/s | "
            "% of roofline | compile s | XLA temp GiB |", "|---|---|---|---|---|---|---|---|---|"]
    variants = (("before (" + before + ")", before, {}), ("now, scanned layers", None, {}),
                ("now, unrolled layers", None, {"scan_layers": False}))
    for label, ref, options in variants:
        results, error = _step_at(ref, [("run", 0, b, t, options) for b, t in cells], repeats=2)
        for r in results:
            head = f"| {label} | {r['batch']} x {r['length']} |"
            if "error" in r:
                rows.append(f"{head} {r['error']} | | | | | | |")
                continue
            tokens = r["batch"] * r["length"]
            gflops = train_flops(QwenConfig.qwen2_5_0_5b(), tokens, r["length"]) / r["step_s"] / 1e9
            rows.append(f"{head} {r['step_s']:.2f} | {tokens / r['step_s']:,.0f} | {gflops:.1f} | "
                        f"{r['roofline_gflops']:.1f} | {100 * gflops / r['roofline_gflops']:.0f}% | "
                        f"{r['compile_s']:.1f} | {r['temp'] / GiB:.2f} |")
            print(rows[-1], flush=True)
        if error:
            rows.append(f"\n{label}: {error}\n")
    return rows


def run_compile_depth(quick: bool, before: str = "b4fe845") -> list[str]:
    """Compile time of the 0.5B-width train step at several depths: layers stored one module
    each (commit ``before``, stacked only inside the forward) against stacked storage (now),
    scanned and unrolled."""
    rows = ["", "Compile time of the 0.5B-width train step (batch 1 x 256, compile only) against "
             f"depth; \"per-layer\": layers stored one module each ({before}), \"stacked\": one "
             "[L, ...] variable per weight (now):", "",
             "| layers | per-layer, scanned s | stacked, scanned s | stacked, unrolled s | "
             "per-layer scanned / 4-layer | stacked scanned / 4-layer | "
             "stacked unrolled / 4-layer |", "|---|---|---|---|---|---|---|"]
    depths = [4, 28] if quick else [4, 24, 28]
    nan = float("nan")
    by, errors = {}, []
    for label, ref, scans in (("per-layer", before, (True,)), ("stacked", None, (True, False))):
        cases = [("compile", n, 1, 256, {"scan_layers": scan}) for n in depths for scan in scans]
        results, error = _step_at(ref, cases, repeats=1)
        by.update({(label, r["layers"], r["options"]["scan_layers"]): r.get("compile_s", nan)
                   for r in results})
        if error:
            errors.append(f"{label}: {error}")
    columns = [("per-layer", True), ("stacked", True), ("stacked", False)]
    for n in depths:
        cells = [by.get((lab, n, scan), nan) for lab, scan in columns]
        ratios = [c / by.get((lab, depths[0], scan), nan) for c, (lab, scan) in zip(cells, columns, strict=True)]
        rows.append(f"| {n} | " + " | ".join(f"{c:.1f}" for c in cells) + " | "
                    + " | ".join(f"{r:.2f}" for r in ratios) + " |")
        print(rows[-1], flush=True)
    rows += ["\n" + e for e in errors]
    return rows


def run_pod(quick: bool) -> list[str]:
    cases = [("0.5b", (1, 8, 1), 8, 512), ("0.5b", (1, 64, 1), 64, 512),
             ("3b", (1, 8, 1), 8, 512), ("3b", (2, 8, 4), 64, 512),
             ("7b", (1, 8, 1), 8, 512), ("7b", (2, 8, 4), 64, 512)]
    if quick:
        cases = cases[:1]
    code = f"CASES = {cases!r}\n" + _POD
    results, error = subprocess_results(code, child_env(ROOT, XLA_FLAGS=""), timeout=3000)
    rows = ["| model (bf16) | mesh (data, fsdp, tensor) | global batch x length | per-device params+opt GiB | "
            "per-device temp GiB | compile s |", "|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            rows.append(f"| {r['name']} | {tuple(r['mesh'])} | {r['batch']} x {r['length']} | {r['error']} | | |")
        else:
            rows.append(f"| {r['name']} | {tuple(r['mesh'])} | {r['batch']} x {r['length']} | "
                        f"{r['args'] / GiB:.2f} | {r['temp'] / GiB:.2f} | {r['compile_s']:.0f} |")
        print(rows[-1], flush=True)
    if error:
        rows.append("\n" + error)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--skip-pod", action="store_true")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--skip-roofline", action="store_true")
    ap.add_argument("--only-compile-depth", action="store_true",
                    help="only the compile-time-against-depth table, to bench_update_compile_depth.md")
    args = ap.parse_args()
    import jax

    if args.only_compile_depth:
        out = RESULTS / "bench_update_compile_depth.md"
        lines = [f"# bench_update --only-compile-depth (jax {jax.__version__}, {os.cpu_count()} "
                 "CPU cores)"] + run_compile_depth(args.quick)
        out.write_text("\n".join(lines) + "\n")
        print(f"wrote {out}")
        return

    lines = [f"# bench_update (jax {jax.__version__}, {os.cpu_count()} CPU cores)", "",
             "## Actor train step on this CPU (float32, AdamW, one micro-batch)", ""]
    lines += ["(skipped)"] if args.skip_throughput else run_throughput(args.quick)
    if not args.skip_roofline:
        lines += ["", "## The 0.5B-shaped step against the float32 matmul roofline, before and now", "",
                  "Model FLOPs (PaLM's MFU count: 6 x weights per token + attention; "
                  "rematerialisation not counted) per second of a float32 train step (AdamW, one "
                  "micro-batch, remat none), against the best of five float32 2048^3 matmuls "
                  "measured in the same process. Each code version runs in its own process.", ""]
        lines += run_roofline(args.quick) + run_compile_depth(args.quick)
    if not args.skip_pod:
        lines += ["", "## Compile-only memory per device on simulated meshes (bf16 params and compute)", "",
                  "Per-device bytes of the compiled step's arguments (parameters, AdamW state, batch) "
                  "and XLA temporaries; XLA:CPU's estimate, a guide for TPU/GPU sizing.", ""]
        lines += run_pod(args.quick)
    out = RESULTS / ("bench_update_pod.md" if args.skip_throughput else "bench_update.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
