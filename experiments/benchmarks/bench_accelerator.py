"""Our sampler and train step on an accelerator (GPU or TPU), in the precision a user runs there.

Random Qwen2.5-shaped models with the real 151,936-token vocabulary (``--sizes``: 0.5b, 1.5b,
3b, 7b),
bfloat16 compute on float32 master weights as the trainer keeps them, the sampler on the bf16
``compute_copy``:

1. the chip's ceilings, measured: a jitted ``n^3`` bf16 matmul (TFLOP/s) and a jitted sum over
   a large float32 array (GB/s);
2. greedy sampling, ``--prompt`` random tokens then exactly ``--new`` new tokens (no stop
   token), batch ``--batches``: tokens/s of a warm call, prefill seconds (a 1-token call on
   the same prompts), decode ms per token-step against the time to read every bf16 weight and
   the attended cache once per step at the measured bandwidth;
3. one policy-gradient train step (``starpo.optimizer_step.jit_optimizer_step``: AdamW,
   ``--micro-batches``, ``--remat`` as the Qwen2.5 presets set it, ``--train-rows`` rows of
   ``--train-length`` tokens, the second half trained): tokens/s and model FLOP utilisation
   (``6 x parameters x tokens`` plus causal attention, over the measured peak) and the
   process's peak device memory so far (where the backend reports it; the sampling before it
   counts too: ``--batches ''`` skips sampling) beside XLA's own analysis of the compiled
   step (its temporary buffers); a step that fails (out of memory, a kernel the backend
   lacks) is a row saying so. ``--attention-impls xla,cudnn`` runs the step once per
   ``QwenConfig.attention_impl`` in this process, on the same initial weights and batch
   (``--pad-middle N``: up to N padding tokens in the middle of each row, so the fused path's
   padding handling is exercised), and compares each with the first that ran: the first
   step's loss and gradient norm, and teacher-forced log-probs (``token_logprobs``) at the
   trained tokens, max and mean absolute difference;
4. with ``--trace-update DIR``, one more warm train step (of ``--trace-impl``, default the
   last of ``--attention-impls``) under ``jax.profiler.trace``, summarised from its Perfetto
   JSON (``profiles.update_trace_lines``): wall and GPU-busy ms, kernels launched, the kernels by
   kind (name without its numeric suffix) and the top kernels by time.

Runs anywhere JAX runs (on the CPU it is slow: use ``--sizes 0.5b --batches 1 --new 8``;
there ``cudnn`` is a failed row).

    python -m experiments.benchmarks.bench_accelerator --out experiments/results/bench_accelerator.md
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments.benchmarks.profiles import UPDATE_ANNOTATION, update_trace_lines
from experiments.benchmarks.roofline import (
    decode_step_bytes,
    matmul_peak,
    memory_bandwidth,
    work_gflop,
)
from experiments.benchmarks.shapes import accelerator_config
from experiments.common import timed
from ragen_jax.config.resolve import update_settings
from ragen_jax.metrics import device_memory
from ragen_jax.models import Qwen2ForCausalLM, QwenConfig, compute_copy
from ragen_jax.models.kv_cache import positions_from_mask
from ragen_jax.rollout import Sampler, SamplingParams
from ragen_jax.starpo.optimizer_step import (
    TrainBatch,
    jit_optimizer_step,
    make_optimizer,
)
from ragen_jax.starpo.token_scores import token_logprobs


def sampling(policy, cfg: QwenConfig, batch: int, args, rng) -> dict:
    prompts = rng.randint(10, cfg.vocab_size, (batch, args.prompt)).tolist()
    sampler = Sampler(policy)

    def call(new: int):
        sp = SamplingParams(max_new_tokens=new, temperature=0.0)
        out = sampler(prompts, key=jax.random.key(0), params=sp)
        jax.block_until_ready(out.tokens)

    t0 = time.perf_counter()
    call(args.new)
    first = time.perf_counter() - t0
    full = timed(lambda: call(args.new), args.repeats)
    call(1)
    prefill = timed(lambda: call(1), args.repeats)
    return {"first_s": first, "full_s": full, "prefill_s": prefill,
            "decode_ms": 1e3 * (full - prefill) / max(args.new - 1, 1)}


def scores(actor, batch: TrainBatch, rows: int) -> np.ndarray:
    """Teacher-forced log-probs [B, L] of ``batch`` under ``actor``, jitted, ``rows`` rows a
    call (as the update's passes: the whole batch at once would hold every row's scores)."""
    fn = nnx.jit(lambda m, ids, mask, pos: token_logprobs(m, ids, mask, pos, 1.0)[0])
    return np.concatenate([np.asarray(fn(actor, batch.input_ids[i:i + rows],
                                         batch.attention_mask[i:i + rows],
                                         batch.positions[i:i + rows]))
                           for i in range(0, batch.input_ids.shape[0], rows)])


def train_batch(actor, cfg: QwenConfig, args, rng) -> TrainBatch:
    """``--train-rows`` random rows of ``--train-length`` tokens, the second half trained,
    up to ``--pad-middle`` padding tokens from a third of each row on; old log-probs from
    ``actor`` (on-policy)."""
    b, length = args.train_rows, args.train_length
    ids = jnp.asarray(rng.randint(10, cfg.vocab_size, (b, length)), jnp.int32)
    mask = np.ones((b, length), bool)
    for i, n in enumerate(rng.randint(0, args.pad_middle + 1, b) if args.pad_middle else []):
        mask[i, length // 3:length // 3 + n] = False
    mask = jnp.asarray(mask)
    positions = positions_from_mask(mask)
    # trained: real tokens of the second half whose slot before is real too (a slot's
    # log-prob is read from the slot before it, and a padding slot's output is nobody's)
    after_real = jnp.concatenate([jnp.ones((b, 1), bool), mask[:, :-1]], axis=1)
    loss_mask = jnp.zeros((b, length), jnp.float32).at[:, length // 2:].set(1.0) * mask * after_real
    adv = jnp.broadcast_to(jnp.asarray(rng.randn(b), jnp.float32)[:, None], (b, length))
    batch = TrainBatch(ids, mask, positions, loss_mask, jnp.zeros((b, length), jnp.float32), adv)
    old_logp = scores(actor, batch, max(b // args.micro_batches, 1))
    return batch.replace(old_logp=jnp.asarray(old_logp))


def train_step(actor, args, batch: TrainBatch, trace: bool = False) -> dict:
    ucfg = update_settings(lr=1e-6, micro_batches=args.micro_batches, loss_agg_mode="token-mean")
    graphdef, params, rest = nnx.split(actor, nnx.Param, ...)
    opt = make_optimizer(ucfg)
    holder = {"p": params, "o": opt.init(params)}
    t0 = time.perf_counter()
    compiled = jit_optimizer_step(graphdef, ucfg, opt).lower(params, rest, holder["o"], batch).compile()
    compile_s = time.perf_counter() - t0
    temp_gib = float("nan")
    try:
        temp_gib = compiled.memory_analysis().temp_size_in_bytes / 2**30
    except Exception:  # a backend without the analysis
        pass
    lr = jnp.float32(ucfg.lr)

    def one():
        holder["p"], holder["o"], m = compiled(holder["p"], rest, holder["o"], batch, lr, None)
        jax.block_until_ready(m)
        holder.setdefault("first", {k: float(v) for k, v in m.items()})  # on the initial weights
        holder["loss"] = float(m["actor/pg_loss"])

    one()
    first = holder["first"]
    res = {"step_s": timed(one, args.repeats), "compile_s": compile_s, "temp_gib": temp_gib,
           "loss_finite": bool(np.isfinite(holder["loss"])),
           "loss": first["actor/pg_loss"], "grad_norm": first.get("actor/grad_norm", float("nan"))}
    if trace and args.trace_update:
        trace_dir = Path(args.trace_update)
        trace_dir.mkdir(parents=True, exist_ok=True)
        with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
            with jax.profiler.TraceAnnotation(UPDATE_ANNOTATION):
                one()
        res["trace_dir"] = str(trace_dir)
    return res


def _one_line(text: str) -> str:
    return " ".join(text.split()).replace("|", "/")


def _rel(a: float, b: float) -> str:
    return f"{abs(a - b) / max(abs(b), 1e-30):.1e}"


def peak_gib() -> str:
    m = device_memory()
    return f"{m['perf/max_memory_allocated_gib']:.1f}" if m else "n/a"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="0.5b,1.5b")
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--train-rows", type=int, default=16)
    ap.add_argument("--train-length", type=int, default=1024)
    ap.add_argument("--micro-batches", type=int, default=1)
    ap.add_argument("--remat", default="dots",
                    help="QwenConfig.remat of the train step (the Qwen2.5 presets' 'dots')")
    ap.add_argument("--attention-impls", default="xla",
                    help="QwenConfig.attention_impl values of the train step, each its own row "
                         "(xla, cudnn, auto, dpa_xla), compared with the first that ran")
    ap.add_argument("--pad-middle", type=int, default=0,
                    help="up to this many padding tokens in the middle of each trained row")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--matmul-n", type=int, default=8192)
    ap.add_argument("--bandwidth-gib", type=float, default=4.0)
    ap.add_argument("--trace-update", default=None, metavar="DIR",
                    help="trace one more warm train step into DIR and summarise its kernels")
    ap.add_argument("--trace-impl", default=None,
                    help="the attention_impl whose step is traced (default: the last)")
    ap.add_argument("--out", default=None, help="also write the markdown table here")
    return ap.parse_args(argv)


def sampling_rows(size: str, cfg: QwenConfig, actor, args, rng, bw: float) -> list[str]:
    """The sampling table's rows of one shape, one per ``--batches`` entry."""
    lines = []
    batches = [int(x) for x in args.batches.split(",") if x]
    policy = compute_copy(actor) if batches else None
    for b in batches:
        r = sampling(policy, cfg, b, args, rng)
        bound_ms = 1e3 * decode_step_bytes(policy, cfg, b, args.prompt + args.new) / (bw * 1e9)
        pre_tf = work_gflop(cfg, b, args.prompt, 1) / r["prefill_s"] / 1e3
        lines.append(f"| {size} | {b} | {b * args.new / r['full_s']:.0f} | {r['first_s']:.1f} | "
                     f"{r['prefill_s']:.3f} | {pre_tf:.1f} | {r['decode_ms']:.2f} | "
                     f"{bound_ms:.2f} | {bound_ms / r['decode_ms']:.2f} |")
        print(lines[-1], flush=True)
    return lines


def bf16_error_note(size: str, cfg: QwenConfig, batch: TrainBatch, args) -> str:
    """The scale of bf16 error: the xla path's log-probs in bf16 against float32 compute."""
    trained = np.asarray(batch.loss_mask) > 0
    try:
        lp32 = scores(Qwen2ForCausalLM(cfg.replace(attention_impl="xla", dtype=jnp.float32),
                                       rngs=nnx.Rngs(0)), batch,
                      max(args.train_rows // args.micro_batches, 1))
        d = np.abs(np.asarray(batch.old_logp) - lp32)[trained]
        return (f"- {size}: bf16 error scale, log-probs of the xla path in bf16 "
                f"vs float32 compute at the trained tokens: max {d.max():.2e}, "
                f"mean {d.mean():.2e}.")
    except Exception as e:
        return f"- {size}: float32 reference failed: {type(e).__name__}: {_one_line(str(e))[:160]}"


def train_row(head: str, t: dict, ref: dict, diff: np.ndarray, n_params: int, cfg: QwenConfig,
              args, peak: float) -> str:
    """One train-step row: time, tokens/s, MFU, and the differences from the first row."""
    tokens = args.train_rows * args.train_length
    attn = 6 * cfg.num_hidden_layers * cfg.hidden_size * args.train_length * tokens
    flop = 6 * n_params * tokens + attn
    return (f"{head} {t['step_s']:.3f} | {tokens / t['step_s']:.0f} | "
            f"{100 * flop / t['step_s'] / (peak * 1e12):.0f}% | {t['compile_s']:.0f} | "
            f"{t['loss']:.6g} ({_rel(t['loss'], ref['loss'])}) | "
            f"{t['grad_norm']:.6g} ({_rel(t['grad_norm'], ref['grad_norm'])}) | "
            f"{diff.max():.2e} / {diff.mean():.2e} | {t['temp_gib']:.1f} | {peak_gib()} |")


def train_rows(size: str, cfg: QwenConfig, n_params: int, args, rng, peak: float
               ) -> tuple[list[str], list[str], list[str]]:
    """(table rows, trace lines, notes) of one shape's train step, one row per attention
    implementation, each compared with the first that ran."""
    rows, trace_lines, notes = [], [], []
    impls = [x for x in args.attention_impls.split(",") if x]
    traced = args.trace_impl or impls[-1]
    try:  # the batch and its reference log-probs, from the materialised-scores path
        batch = train_batch(Qwen2ForCausalLM(cfg.replace(attention_impl="xla"),
                                             rngs=nnx.Rngs(0)), cfg, args, rng)
    except Exception as e:  # out of memory, say
        rows.append(f"| {size} | | | | failed to build the batch: "
                    f"{type(e).__name__}: {_one_line(str(e))[:160]} |" + " |" * 8)
        print(rows[-1], flush=True)
        return rows, trace_lines, notes
    ref = None
    ref_logp = np.asarray(batch.old_logp)  # the xla path's, in bf16
    trained = np.asarray(batch.loss_mask) > 0
    if len(impls) > 1:
        notes.append(bf16_error_note(size, cfg, batch, args))
        print(notes[-1], flush=True)
    for impl in impls:
        head = f"| {size} | {impl} | {n_params / 1e6:.0f}M | {args.train_rows} x {args.train_length} |"
        try:
            actor = Qwen2ForCausalLM(cfg.replace(attention_impl=impl), rngs=nnx.Rngs(0))
            logp = scores(actor, batch, max(args.train_rows // args.micro_batches, 1))
            t = train_step(actor, args, batch, trace=impl == traced)
        except Exception as e:  # out of memory, a kernel the backend lacks: a row says so
            rows.append(f"{head} failed: {type(e).__name__}: {_one_line(str(e))[:300]} |" + " |" * 8)
            print(rows[-1], flush=True)
            continue
        finally:
            actor = None
        if ref is None:
            ref = t
        rows.append(train_row(head, t, ref, np.abs(logp - ref_logp)[trained], n_params, cfg,
                              args, peak))
        print(rows[-1], flush=True)
        if t.get("trace_dir"):
            try:
                trace_lines += ["", f"### {size}, attention {impl}: one traced train step",
                                *update_trace_lines(Path(t["trace_dir"]))]
            except Exception as e:  # a trace we cannot read: the timings still stand
                trace_lines.append(f"Trace not summarised: {type(e).__name__}: {e}")
            print("\n".join(trace_lines), flush=True)
    return rows, trace_lines, notes


def main() -> None:
    args = parse()
    dev = jax.devices()[0]
    peak = matmul_peak(args.matmul_n, 10, "bfloat16") / 1e3  # TFLOP/s
    bw = memory_bandwidth(args.bandwidth_gib, 10)
    lines = [f"# Our sampler and train step on {dev.device_kind} ({dev.platform}), jax "
             f"{jax.__version__}", "",
             f"Measured ceilings: bf16 {args.matmul_n}^3 matmul {peak:.0f} TFLOP/s; a float32 "
             f"sum over {args.bandwidth_gib:g} GiB {bw:.0f} GB/s. Random weights, bf16 compute "
             f"(sampler: bf16 weights; train step: float32 master weights). Best of "
             f"{args.repeats} warm calls.", "",
             f"## Greedy sampling: {args.prompt}-token prompts, {args.new} new tokens", "",
             "| shape | batch | tok/s | first call s | prefill s | prefill TFLOP/s | decode "
             "ms/token-step | bandwidth bound ms | bound / measured |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    print("\n".join(lines), flush=True)
    train_lines, trace_lines, notes = [], [], []
    rng = np.random.RandomState(0)
    for size in args.sizes.split(","):
        cfg = accelerator_config(size, args.remat)
        actor = Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(0))
        n_params = sum(x.size for x in jax.tree.leaves(nnx.state(actor, nnx.Param)))
        lines += sampling_rows(size, cfg, actor, args, rng, bw)
        del actor
        rows, traces, size_notes = train_rows(size, cfg, n_params, args, rng, peak)
        train_lines += rows
        trace_lines += traces
        notes += size_notes
    lines += ["", f"## Policy-gradient train step (AdamW, {args.micro_batches} micro-batch(es), "
              f"remat {args.remat!r}, half of each row trained, up to {args.pad_middle} padding "
              "tokens mid-row)", "",
              "| shape | attention | parameters | rows x tokens | step s | tokens/s | MFU "
              "(6N + attention) | compile s | first loss (rel. diff vs first row) | first grad "
              "norm (rel. diff) | log-prob abs diff vs xla (bf16), max / mean | XLA temp GiB "
              "| peak GiB (process, so far) |",
              "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
              *train_lines, "", *notes, *trace_lines, ""]
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
