"""Actor train-step throughput, and how the step fits on a pod (compile-only memory).

Part 1 (runs): tokens/s of the jitted actor update (forward, backward, AdamW) for the tiny
preset and a Qwen2.5-0.5B-shaped random model over a batch x length grid, with the compiled
step's memory from XLA's memory analysis.

Part 2 (compile only, in a subprocess with 64 simulated CPU devices): per-device memory of
the compiled step for Qwen2.5-0.5B, 3B and 7B shapes on meshes of 8 and 64 devices, with
parameters sharded by their partition specs and the batch over ("data", "fsdp"). Nothing is
allocated: parameters are abstract (``jax.ShapeDtypeStruct`` with shardings).

    PYTHONPATH=. python experiments/bench_update.py [--quick] [--skip-pod]

Writes ``experiments/results/bench_update.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SHAPES = {  # Hugging Face Qwen2.5-*-Instruct config.json values (0.5B: QwenConfig's preset)
    "3b": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
               num_key_value_heads=2, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, head_dim=128, vocab_size=152064, tie_word_embeddings=False),
}
GiB = 2**30


def model_config(name: str, **kw):
    """The QwenConfig of a benchmark model: ``tiny``, ``0.5b``, ``3b`` or ``7b`` shapes."""
    from ragen_jax.models import QwenConfig

    if name == "tiny":
        return QwenConfig.tiny(**kw)
    if name == "0.5b":
        return QwenConfig.qwen2_5_0_5b(**kw)
    return QwenConfig.tiny(**SHAPES[name], rope_theta=1e6, **kw)


def _batch(batch: int, length: int, vocab: int, sharding=None):
    import jax
    import jax.numpy as jnp

    from ragen_jax.starpo.update import TrainBatch

    def arr(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    if sharding is not None:  # abstract, for compile-only runs
        f = jnp.float32
        return TrainBatch(arr((batch, length), jnp.int32), arr((batch, length), bool),
                          arr((batch, length), jnp.int32), arr((batch, length), f),
                          arr((batch, length), f), arr((batch, length), f), arr((batch, length), f))
    key = jax.random.key(0)
    ids = jax.random.randint(key, (batch, length), 0, vocab)
    ones = jnp.ones((batch, length), jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    adv = jax.random.normal(key, (batch, length))
    return TrainBatch(ids, jnp.ones((batch, length), bool), pos, ones, -ones, adv, -ones)


def run_throughput(quick: bool) -> list[str]:
    import jax
    from flax import nnx

    from ragen_jax.models import Qwen2ForCausalLM
    from ragen_jax.starpo.update import UpdateConfig, make_optimizer, make_train_step

    grid = {"tiny": [(8, 256), (32, 256), (8, 1024)], "0.5b": [(1, 256), (2, 256)]}
    if quick:
        grid = {"tiny": [(8, 128)]}
    rows = ["| model | batch x length | tokens/s | step s | compile s | XLA temp GiB | args GiB |",
            "|---|---|---|---|---|---|---|"]
    for name, cells in grid.items():
        cfg = model_config(name)
        model = Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(0))
        ucfg = UpdateConfig(lr=1e-6)
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        opt = make_optimizer(ucfg)
        opt_state = opt.init(params)
        step = make_train_step(graphdef, ucfg, opt)
        for batch, length in cells:
            data = _batch(batch, length, cfg.vocab_size)
            start = time.perf_counter()
            compiled = step.lower(params, rest, opt_state, data).compile()
            compile_s = time.perf_counter() - start
            mem = compiled.memory_analysis()
            out = compiled(params, rest, opt_state, data)
            jax.block_until_ready(out)
            start = time.perf_counter()
            jax.block_until_ready(compiled(params, rest, opt_state, data))
            step_s = time.perf_counter() - start
            rows.append(f"| {name} | {batch} x {length} | {batch * length / step_s:,.0f} | {step_s:.2f} | "
                        f"{compile_s:.1f} | {mem.temp_size_in_bytes / GiB:.2f} | "
                        f"{mem.argument_size_in_bytes / GiB:.2f} |")
            print(rows[-1], flush=True)
    return rows


_POD = r"""
import json, sys, time
import jax
jax.config.update("jax_num_cpu_devices", 64)
import jax.numpy as jnp
from flax import nnx
sys.path.insert(0, ROOT)
sys.path.insert(0, ROOT + "/experiments")
from bench_update import _batch, model_config
from ragen_jax.models import Qwen2ForCausalLM
from ragen_jax.models.qwen import param_shardings
from ragen_jax.sharding import batch_sharding, make_mesh
from ragen_jax.starpo.update import UpdateConfig, make_optimizer, make_train_step

for name, mesh_shape, batch, length in CASES:
    cfg = model_config(name, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16)
    mesh = make_mesh(mesh_shape, jax.devices()[: mesh_shape[0] * mesh_shape[1] * mesh_shape[2]])
    abstract = nnx.eval_shape(lambda: Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(0)))
    abstract.model.activation_sharding = batch_sharding(mesh)  # as shard_model sets it
    graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
    shardings = param_shardings(params, mesh)
    params = jax.tree.map(lambda v, s: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s), params, shardings,
                          is_leaf=lambda x: isinstance(x, nnx.Variable))
    ucfg = UpdateConfig(micro_batches=1)
    opt = make_optimizer(ucfg)
    opt_state = jax.eval_shape(opt.init, params)
    opt_state = jax.tree.map(lambda x: x, opt_state)
    data = _batch(batch, length, cfg.vocab_size, batch_sharding(mesh))
    start = time.perf_counter()
    try:
        compiled = make_train_step(graphdef, ucfg, opt).lower(params, rest, opt_state, data).compile()
        mem = compiled.memory_analysis()
        res = dict(args=mem.argument_size_in_bytes, temp=mem.temp_size_in_bytes, out=mem.output_size_in_bytes)
    except Exception as e:  # report, do not hide
        res = dict(error=f"{type(e).__name__}: {str(e)[:200]}")
    res.update(name=name, mesh=list(mesh_shape), batch=batch, length=length, compile_s=time.perf_counter() - start)
    print("RESULT " + json.dumps(res), flush=True)
"""


def subprocess_results(code: str, env: dict[str, str], timeout: float) -> tuple[list[dict], str | None]:
    """Runs ``code`` in a fresh Python (its own ``XLA_FLAGS``/device count) and returns the
    JSON of its ``RESULT {...}`` stdout lines, plus a one-line note of its exit status and
    stderr tail when it failed (the results printed before the failure are kept)."""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=timeout)
    results = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    error = None if proc.returncode == 0 else (
        f"(subprocess exited {proc.returncode}: {proc.stderr[-500:]!r})")
    return results, error


def run_pod(quick: bool) -> list[str]:
    cases = [("0.5b", (1, 8, 1), 8, 512), ("0.5b", (1, 64, 1), 64, 512),
             ("3b", (1, 8, 1), 8, 512), ("3b", (2, 8, 4), 64, 512),
             ("7b", (1, 8, 1), 8, 512), ("7b", (2, 8, 4), 64, 512)]
    if quick:
        cases = cases[:1]
    code = f"ROOT = {str(ROOT)!r}\nCASES = {cases!r}\n" + _POD
    results, error = subprocess_results(code, {**os.environ, "XLA_FLAGS": ""}, timeout=3000)
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
    args = ap.parse_args()
    import jax

    lines = [f"# bench_update (jax {jax.__version__}, {os.cpu_count()} CPU cores)", "",
             "## Actor train step on this CPU (float32, AdamW, one micro-batch)", ""]
    lines += ["(skipped)"] if args.skip_throughput else run_throughput(args.quick)
    if not args.skip_pod:
        lines += ["", "## Compile-only memory per device on simulated meshes (bf16 params and compute)", "",
                  "Per-device bytes of the compiled step's arguments (parameters, AdamW state, batch) "
                  "and XLA temporaries; XLA:CPU's estimate, a guide for TPU/GPU sizing.", ""]
        lines += run_pod(args.quick)
    out = ROOT / "experiments" / "results" / ("bench_update_pod.md" if args.skip_throughput else "bench_update.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
