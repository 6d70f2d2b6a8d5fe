"""Memory and time of token scoring under autodiff: full-vocabulary logits vs chunked.

The jitted gradient of a policy-gradient-like loss, the mean over the loss mask of
``ratio * adv + entropy`` with ``ratio = exp(logp - stop_gradient(logp))`` (PPO's surrogate at
its first step: the gradient of ``logp * adv``, but, as PPO's, it needs the log-probs' values,
so the forward pass is not optimised away), with the log-probs from

* ``full``: the model's logits ``[B, L, V]`` at once and ``log_softmax`` (the update's
  scoring before ``starpo.token_scores``, copied here);
* ``chunked``: ``token_scores.token_logprobs`` (the head on ``--chunk`` positions at a time,
  rematerialised in the backward pass);
* ``chunked+mask``: the same with ``loss_mask``, so chunks of prompt are skipped.

Shapes: (a) 2 layers, width 128, Qwen2.5's vocabulary (151,936), 4 rows of 896 slots with the
last 200 of each in the loss mask, run on this machine: XLA's compiled temporaries, the median
time per call, and the peak RSS of a process that builds, compiles and runs only that variant;
(b) Qwen2.5-0.5B shapes, 4 rows of 1024 slots, compile only (abstract weights), XLA's
temporaries; (c) the same with ``remat="dots"`` (``configs/base.py``'s), where the decoder's
activations take less and the logits' share shows.

    python -m experiments.benchmarks.bench_token_scores [--repeats 3] [--chunk 256]

Writes ``experiments/results/token_scores.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

from experiments.common import RESULTS, ROOT, child_env

VARIANTS = ("full", "chunked", "chunked+mask")
SHAPES = {  # name: (model, batch, length, masked slots at the end of each row, run?)
    "a": ("2 layers, width 128, V 151936", 4, 896, 200, True),
    "b": ("Qwen2.5-0.5B", 4, 1024, 200, False),
    "c": ("Qwen2.5-0.5B, remat dots", 4, 1024, 200, False),
}
GiB = 2**30


def model_config(shape: str):
    from ragen_jax.models import QwenConfig

    if shape == "a":
        return QwenConfig.tiny(vocab_size=151936, hidden_size=128, intermediate_size=384,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=32)
    return QwenConfig.qwen2_5_0_5b(remat="dots" if shape == "c" else "none")


def full_logprobs(model, input_ids, attention_mask, positions):
    """The scoring ``update.token_logprobs`` did before ``token_scores``.  # [B, L], [B, L]"""
    import jax
    import jax.numpy as jnp

    logits, _ = model(input_ids, positions, attention_mask)  # [B, L, V]
    logp_all = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    logp = jnp.take_along_axis(logp_all, input_ids[:, 1:, None], axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
    pad = jnp.zeros((input_ids.shape[0], 1), jnp.float32)
    return jnp.concatenate([pad, logp], 1), jnp.concatenate([pad, entropy], 1)


def worker(shape: str, variant: str, chunk: int, repeats: int) -> dict:
    """Builds, compiles and (for runnable shapes, ``repeats > 0``) times one variant;
    returns its numbers."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from ragen_jax.models import Qwen2ForCausalLM
    from ragen_jax.starpo.token_scores import token_logprobs

    _, batch, length, masked, run = SHAPES[shape]
    run = run and repeats > 0
    cfg = model_config(shape)
    if run:
        model = Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(0))
    else:
        model = nnx.eval_shape(lambda: Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(0)))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params, ids, attn, pos, mask, adv):
        model = nnx.merge(graphdef, params, rest)
        if variant == "full":
            logp, entropy = full_logprobs(model, ids, attn, pos)
        else:
            logp, entropy = token_logprobs(model, ids, attn, pos, chunk=chunk,
                                           loss_mask=mask if variant == "chunked+mask" else None)
        ratio = jnp.exp(logp - jax.lax.stop_gradient(logp))  # 1, as at PPO's first step
        return jnp.sum((ratio * adv + entropy) * mask) / jnp.maximum(jnp.sum(mask), 1.0)

    rng = np.random.default_rng(0)
    mask = np.zeros((batch, length), np.float32)
    mask[:, -masked:] = 1.0
    data = (jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, length)), jnp.int32),
            jnp.ones((batch, length), bool),
            jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length)),
            jnp.asarray(mask), jnp.asarray(rng.normal(size=(batch, length)), jnp.float32))
    start = time.perf_counter()
    compiled = jax.jit(jax.grad(loss)).lower(params, *data).compile()
    out = {"compile_s": time.perf_counter() - start,
           "temp": compiled.memory_analysis().temp_size_in_bytes}
    if run:
        jax.block_until_ready(compiled(params, *data))
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(compiled(params, *data))
            times.append(time.perf_counter() - start)
        out["step_s"] = float(np.median(times))
    out["maxrss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return out


def measure(shape: str, variant: str, chunk: int, repeats: int) -> dict:
    """``worker`` in a fresh process, so that its peak RSS is this variant's alone."""
    cmd = [sys.executable, "-m", "experiments.benchmarks.bench_token_scores", "--worker", shape, variant, "--chunk", str(chunk),
           "--repeats", str(repeats)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=child_env(ROOT))
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    return {"error": f"exit {proc.returncode}: {proc.stderr.strip()[-300:]!r}"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--shapes", default="abc")
    ap.add_argument("--worker", nargs=2, metavar=("SHAPE", "VARIANT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(*args.worker, args.chunk, args.repeats)), flush=True)
        return
    import jax

    load = os.getloadavg()[0]
    rows = ["| shape | batch x length (loss slots) | scoring | XLA temp GiB | step s | "
            "peak RSS GiB | compile s |", "|---|---|---|---|---|---|---|"]
    sweep = ["| chunk | positions per chunk | XLA temp GiB | step s | peak RSS GiB |",
             "|---|---|---|---|---|"]
    for shape in args.shapes:
        name, batch, length, masked, run = SHAPES[shape]
        for variant in VARIANTS:
            r = measure(shape, variant, args.chunk, args.repeats)
            cells = [f"({shape}) {name}", f"{batch} x {length} ({masked} per row)", variant]
            if "error" in r:
                cells += [r["error"], "", "", ""]
            else:
                step = f"{r['step_s']:.2f}" if run else "(compile only)"
                rss = f"{r['maxrss'] / GiB:.2f}" if run else f"({r['maxrss'] / GiB:.2f} compiling)"
                cells += [f"{r['temp'] / GiB:.2f}", step, rss, f"{r['compile_s']:.1f}"]
            rows.append("| " + " | ".join(cells) + " |")
            print(rows[-1], flush=True)
    if "a" in args.shapes:
        scored = SHAPES["a"][2] - 1
        for chunk in (32, 64, 128, 256, 512):
            r = measure("a", "chunked", chunk, args.repeats)
            n = -(-scored // chunk)
            cells = [str(chunk), str(-(-scored // n))]
            if "error" in r:
                cells += [r["error"], "", ""]
            else:
                cells += [f"{r['temp'] / GiB:.2f}", f"{r['step_s']:.2f}", f"{r['maxrss'] / GiB:.2f}"]
            sweep.append("| " + " | ".join(cells) + " |")
            print(sweep[-1], flush=True)
    lines = [f"# bench_token_scores (jax {jax.__version__}, {os.cpu_count()} CPU cores, "
             f"float32, chunk {args.chunk})", "",
             f"Load average {load:.1f} when it started (times are rough on shared cores).", "",
             "Jitted gradient of the mean over the loss mask of `ratio * adv + entropy`, "
             "`ratio = exp(logp - stop_gradient(logp))`. "
             "`full`: logits [B, L, V] and log_softmax; `chunked`: `token_scores.token_logprobs`; "
             "`chunked+mask`: the same given the loss mask (chunks without a loss slot skipped). "
             f"Step: median of {args.repeats} calls after a warm-up; peak RSS: the whole process "
             "(model, data, compile, runs) running that variant alone.", "", *rows, "",
             "`chunked` on shape (a) by `chunk` (chunks are evened out over the 895 scored "
             "positions):", "", *sweep]
    out = RESULTS / "token_scores.md"
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
