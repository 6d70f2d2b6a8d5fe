"""Greedy decode against the memory-bandwidth bound, under several XLA flag sets.

Random Qwen2.5-shaped weights (real 151,936-token vocabulary, ``--sizes``), the sampler on
the bf16 ``compute_copy``, ``--prompt`` random prompt tokens and exactly ``--new`` new tokens
(no stop token), batch ``--batches``. What each number means:

1. **Bandwidth ceiling** (GB/s): a jitted sum over a ``--bandwidth-gib`` GiB float32 array
   (``roofline.memory_bandwidth``), measured once, in the first flag set's process. It is
   the rate at which a decode step can at best read its bytes.
2. **Decode ms per token-step**: the best of ``--repeats`` warm ``Sampler`` calls that decode
   ``--new`` steps, minus the best of the same calls cut to one step (per-row ``max_new`` of
   1: the same compiled program, prefill included in both), over ``--new - 1``. **Bound ms**
   is the time to read every bf16 weight once plus the keys and values of all
   ``prompt + new`` cache slots of every row at the measured bandwidth (as
   ``bench_accelerator``); **bound / measured** is the fraction of that ceiling the decode
   reaches (1.0 = bandwidth-bound). **Prefill TFLOP/s**: ``bench_sampler.work_gflop`` of the
   prompts over the 1-step call's seconds (prefill plus one step and the call's overhead: a
   slight underestimate).
3. **Flag sets**: each set of ``XLA_FLAGS`` (``FLAGSETS``: by default ``default``;
   ``cmdbuf_while``, command buffers extended to the decode while-loop; ``cublas_gemm``,
   every GEMM on cuBLAS) runs the same measurements in its own process (flags are read when
   JAX starts), one after another on the same chip, so the ratios between sets are fair. A
   process that fails (an unknown flag aborts XLA at start) or runs past its timeout is a
   row saying so; the rest still run, and sets that no longer fit ``--budget-s`` are rows
   saying skipped. **vs default** is the default set's decode ms over this set's; **tokens**
   the greedy tokens' digest, whether it equals the default set's, and how many rows are
   identical to its (another accumulation order can flip a near-tie of random weights'
   logits, and that row differs from there on).
   ``--other-batches`` runs fewer batches in the sets after the first (compilation, ~15-25 s
   a batch on an H200, is most of a set's time).
4. **Kernels per token-step**: the optimized HLO of the sampler's compiled program
   (``generate_jit(...).lower(...).compile().as_text()``, the program the calls above ran).
   The decode loop is its largest ``while``; counted are the instructions of that loop's
   body that run as work on the device: fusions, library calls (cuBLAS gemms, other custom
   calls), copies, sorts and the like; parameters, tuples, get-tuple-elements, constants and
   bitcasts are free. On a GPU each counted instruction is one kernel launch, unless it sits
   in a command buffer (a ``call`` to a ``command_buffer`` computation: one CUDA graph
   launch for all of it). **Host launches** counts a command buffer as one launch; **while
   in graph** says that the whole loop is one command buffer (loop on the device, no host
   round trip per step). The loop condition (its own kernels, then a copy of the predicate
   to the host each step unless the loop is in a graph) is counted apart.
5. **Trace** (``--trace-flagsets``, batch ``--trace-batch``): ``jax.profiler.trace`` of
   ``--trace-calls`` warm calls of ``--trace-steps`` decode steps and one 1-step call, each
   inside a ``TraceAnnotation``; the Perfetto JSON is read back with ``json``/``gzip``. Per
   token-step (full calls minus the 1-step call): kernels, traced ms, and the GPU-busy time
   (union of kernel and memcpy intervals); **GPU idle** is one minus busy over traced time.
   Top kernels by total time over the full calls. XLA turns command buffers off while a
   profiler runs (``xla_enable_command_buffers_during_profiling``), so the trace shows
   every kernel launched on its own: traced ms per step can exceed the untraced one.

Run from the repository root (the parent never imports JAX: each flag set is this script
again with ``--worker``). Prints the markdown report, writes it to ``--out`` and copies the
children's logs, JSON, the traced batch's optimized HLO and the Perfetto trace to
``bench_decode_files/`` next to it:

    python -m experiments.benchmarks.bench_decode --out /tmp/bench_decode.md
    python -m experiments.benchmarks.bench_decode --sizes smoke --batches 1,2 --new 8 \\
        --prompt 32 --flagsets default --bandwidth-gib 0.25 --trace-batch 2 --trace-steps 4
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from experiments.benchmarks.profiles import (
    ANNOTATION,
    decode_loop_kernels,
    load_trace,
    md_cell,
    trace_summary,
)
from experiments.common import ROOT, child_env

FLAGSETS = {
    "default": "",
    # Command buffers (CUDA graphs) for the default command types plus loops and branches:
    # the decode while-loop becomes one graph with a conditional node (needs CUDA >= 12.3).
    "cmdbuf_while": "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL "
                    "--xla_gpu_graph_min_graph_size=1",
    # The same with every command type named (no defaults relied on).
    "cmdbuf_all": "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,"
                  "DYNAMIC_SLICE_FUSION,CONDITIONAL,WHILE --xla_gpu_graph_min_graph_size=1",
    # Every GEMM to cuBLAS instead of Triton GEMM fusions (as NVIDIA's JAX-Toolbox images set
    # it): a decode step's matmuls have M = batch rows, where the two libraries differ most.
    "cublas_gemm": "--xla_gpu_enable_triton_gemm=false",
    # No command buffers at all: what the default ones buy.
    "no_cmdbuf": "--xla_gpu_enable_command_buffer=",
    # The same flags as default in a second process: the run-to-run noise between processes.
    "default_again": "",
    # Fewer, larger kernels: elementwise ops fused into Triton fusions without a reduction hero.
    "triton_heroless": "--xla_gpu_experimental_enable_triton_heroless_priority_fusion=true",
    # Every fusion through the Triton emitter.
    "triton_all": "--xla_gpu_experimental_all_fusions_with_triton=true",
    # Triton fusions with several outputs (e.g. a GEMM's result and a residual sum at once).
    "triton_multi_output": "--xla_gpu_unsupported_enable_triton_multi_output_fusion=true",
    # No autotuning: XLA's default GEMM configs, whose split-K choices differ from the tuned.
    "autotune_0": "--xla_gpu_autotune_level=0",
    # No split-K: every Triton GEMM forced to one pass over K (the profile's decode GEMMs were
    # split 4-16 ways into float32 partials plus a reduction kernel). The flag exists in
    # jaxlib 0.10.2's XLA (``xla_gpu_enable_split_k_autotuning`` is a reserved, removed name).
    "no_split_k": "--xla_gpu_experimental_force_split_k=1",
}

# ----------------------------------------------------------------------------------------------
# worker: one flag set, in its own process (imports JAX)
# ----------------------------------------------------------------------------------------------


def _save(out: dict, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(out, indent=1, default=str))
    tmp.replace(path)


def _sampler_hlo(sampler, prompts: list, sp) -> str:
    """Optimized HLO of the program ``sampler(prompts, params=sp)`` runs (a fresh cache, no
    shared prompts): the lowering and compilation caches make this free after a call."""
    import jax
    import numpy as np

    from ragen_jax.rollout.sampler import _empty_cache, generate_jit, pad_prompts

    tokens, valid = pad_prompts(prompts, pad_id=sampler.pad_id, min_bucket=sampler.min_bucket,
                                multiple=sampler.bucket_multiple)
    b, p = tokens.shape
    n = sp.max_new_tokens
    cache = _empty_cache(sampler.config, b, p + n)
    stop = np.full((b, 1), -1, np.int32)
    budget = np.full((b,), n, np.int32)
    lowered = generate_jit(False, sampler.options).lower(
        sampler.graph, sampler.state, cache, tokens, valid, stop, budget, np.ones((b,), bool),
        jax.random.key(0), None, sp=sp, pad_id=sampler.pad_id, group_prefix=False,
        prefill_tokens=sampler.prefill_tokens)
    return lowered.compile().as_text()


def decode_timing(policy, cfg, batch: int, args, rng,
                  keep_hlo: Path | None) -> tuple[dict, Callable[[int], int]]:
    """One batch size: compile (first call), warm ``--new``-step and 1-step calls of the same
    program, the decode loop's kernels; returns the row and the call (for the trace)."""
    import jax
    import numpy as np

    from experiments.benchmarks.roofline import work_gflop
    from experiments.common import timed
    from ragen_jax.rollout import Sampler, SamplingParams

    prompts = rng.randint(10, cfg.vocab_size, (batch, args.prompt)).tolist()
    sampler = Sampler(policy)
    sp = SamplingParams(max_new_tokens=args.new, temperature=0.0)

    last = {}

    def call(steps: int) -> int:
        out = sampler(prompts, key=jax.random.key(0), params=sp,
                      max_new=np.full((batch,), steps, np.int32))
        jax.block_until_ready(out.tokens)
        last["tokens"] = out.tokens
        return int(out.steps)

    t0 = time.perf_counter()
    steps = call(args.new)
    first = time.perf_counter() - t0
    # The greedy tokens' digest: a flag set must not change what is decoded.
    ids = np.asarray(jax.device_get(last["tokens"]))
    digest = hashlib.sha256(ids.tobytes()).hexdigest()[:12]
    full = timed(lambda: call(args.new), args.repeats)
    short = timed(lambda: call(1), args.repeats)
    row = {"first_s": first, "full_s": full, "short_s": short, "steps": steps, "tokens": digest,
           "token_ids": ids.tolist(),  # the rows that differ from another set's, in the report
           "compile_s": first - full, "decode_ms": 1e3 * (full - short) / max(args.new - 1, 1),
           # the 1-step call is the prefill plus one step: a slight underestimate of its rate
           "prefill_tflops": work_gflop(cfg, batch, args.prompt, 1) / short / 1e3}
    try:
        text = _sampler_hlo(sampler, prompts, sp)
        row["kernels"] = decode_loop_kernels(text)
        if keep_hlo is not None:
            with gzip.open(keep_hlo, "wt") as f:
                f.write(text)
    except Exception as e:  # the library's internals moved: timings still stand
        row["kernels"] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    return row, call


def trace_decode(call: Callable[[int], int], trace_dir: Path, steps: int, calls: int) -> dict:
    """``calls`` annotated warm calls of ``steps`` decode steps and one 1-step call under
    ``jax.profiler.trace`` (Perfetto JSON written next to the profile)."""
    import jax

    call(steps)
    t0 = time.perf_counter()
    with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
        for i in range(calls):
            with jax.profiler.TraceAnnotation(f"{ANNOTATION}full_{i}"):
                call(steps)
        with jax.profiler.TraceAnnotation(f"{ANNOTATION}short"):
            call(1)
    return {"dir": str(trace_dir), "steps": steps, "calls": calls,
            "wall_s": time.perf_counter() - t0}


def worker(args) -> None:
    """Runs every measurement for the flag set in ``XLA_FLAGS`` and writes ``--json`` after
    each step (a timeout or crash keeps what was done)."""
    import jax
    import numpy as np
    from flax import nnx

    from experiments.benchmarks.roofline import decode_step_bytes, memory_bandwidth
    from experiments.benchmarks.shapes import accelerator_config
    from ragen_jax.models import Qwen2ForCausalLM, compute_copy

    path = Path(args.json)
    dev = jax.devices()[0]
    out = {"device": dev.device_kind, "platform": dev.platform, "jax": jax.__version__,
           "xla_flags": os.environ.get("XLA_FLAGS", ""), "rows": []}
    _save(out, path)
    if args.bandwidth_gib > 0:
        out["bandwidth_gbs"] = memory_bandwidth(args.bandwidth_gib, 10)
        print(f"bandwidth {out['bandwidth_gbs']:.0f} GB/s", flush=True)
        _save(out, path)
    for size in args.sizes.split(","):
        cfg = accelerator_config(size, "dots")
        policy = compute_copy(Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(0)))
        for b in [int(x) for x in args.batches.split(",") if x]:
            slots = args.prompt + args.new
            base = {"size": size, "batch": b, "slots": slots,
                    "step_bytes": decode_step_bytes(policy, cfg, b, slots)}
            keep = None
            if args.hlo_dir and b == args.trace_batch:
                keep = Path(args.hlo_dir) / f"hlo_{args.worker}_{size}_b{b}.txt.gz"
            try:
                # prompts seeded by the batch alone: a flag set that runs fewer batches
                # (--other-batches) decodes the same prompts as the first set
                row, call = decode_timing(policy, cfg, b, args, np.random.RandomState(b), keep)
            except Exception as e:  # out of memory, say: a row that says so
                row, call = {"error": f"{type(e).__name__}: {str(e)[:300]}"}, None
            if call is not None and args.trace_dir and b == args.trace_batch:
                try:
                    row["trace"] = trace_decode(call, Path(args.trace_dir),
                                                min(args.trace_steps, args.new),
                                                args.trace_calls)
                except Exception as e:  # no profiler here: the timings still stand
                    row["trace_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            out["rows"].append({**base, **row})
            _save(out, path)
            print(f"{size} batch {b}: " + ", ".join(
                f"{k} {v:.3f}" for k, v in row.items() if isinstance(v, float)), flush=True)
        del policy


# ----------------------------------------------------------------------------------------------
# parent: one child process per flag set, then the report
# ----------------------------------------------------------------------------------------------


def _tail(path: Path, lines: int) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def batches_after(args) -> str:
    """The batches of every flag set after the first (``--other-batches``, else ``--batches``)."""
    return args.batches if args.other_batches is None else args.other_batches


def run_flagset(name: str, flags: str, args, timeout: float, work: Path,
                first: bool) -> dict:
    """Runs this script as a ``--worker`` child with ``flags`` in ``XLA_FLAGS``; returns what
    it wrote plus ``status`` (ok, exit code, or timed out) and its wall seconds."""
    js, log = work / f"{name}.json", work / f"{name}.log"
    trace_dir = work / f"trace_{name}" if name in args.trace_flagsets.split(",") else None
    cmd = [sys.executable, "-m", "experiments.benchmarks.bench_decode", "--worker", name, "--json", str(js),
           "--sizes", args.sizes, "--batches", args.batches if first else batches_after(args),
           "--prompt", str(args.prompt),
           "--new", str(args.new), "--repeats", str(args.repeats),
           "--bandwidth-gib", str(args.bandwidth_gib if first else 0),
           "--trace-batch", str(args.trace_batch), "--trace-steps", str(args.trace_steps),
           "--trace-calls", str(args.trace_calls), "--hlo-dir", str(work)]
    if trace_dir:
        trace_dir.mkdir(parents=True, exist_ok=True)
        cmd += ["--trace-dir", str(trace_dir)]
    env = child_env(ROOT, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip())
    print(f"[bench_decode] {name}: XLA_FLAGS={env['XLA_FLAGS']!r}, timeout {timeout:.0f} s",
          flush=True)
    t0 = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
            status = "ok" if rc == 0 else f"failed (exit {rc})"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            status = f"timed out after {timeout:.0f} s"
    wall = time.monotonic() - t0
    try:
        res = json.loads(js.read_text())
    except (OSError, ValueError):
        res = {"rows": []}
    tail = _tail(log, 25)
    print(f"[bench_decode] {name}: {status} in {wall:.0f} s; log tail:\n{tail}\n", flush=True)
    return {**res, "name": name, "flags": flags, "status": status, "wall_s": wall,
            "log_tail": _tail(log, 4), "trace_dir": str(trace_dir) if trace_dir else None}


def _bound_ms(row: dict, bw: float | None) -> float | None:
    if not bw:
        return None
    return 1e3 * row["step_bytes"] / (bw * 1e9)


def same_rows(mine: list | None, ref: list | None) -> str:
    """``, k/n rows`` identical to the reference's greedy tokens (where both were kept)."""
    if not mine or not ref or len(mine) != len(ref):
        return ""
    return f", {sum(a == b for a, b in zip(mine, ref, strict=True))}/{len(ref)} rows"


def timing_lines(results: list[dict], bw: float | None, args) -> list[str]:
    """The decode table: one row per flag set, shape and batch (or one saying it failed)."""
    base = {(r["size"], r["batch"]): r.get("decode_ms") for res in results
            if res["name"] == "default" for r in res["rows"]}
    digests = {(r["size"], r["batch"]): r.get("tokens") for res in results
               if res["name"] == "default" for r in res["rows"]}
    ids = {(r["size"], r["batch"]): r.get("token_ids") for res in results
           if res["name"] == "default" for r in res["rows"]}
    lines = ["| flag set | shape | batch | compile s | decode ms/token-step | decode tok/s | "
             "bound ms | bound / measured | vs default | tokens (= default's; rows identical) | 1-step call ms "
             "| prefill TFLOP/s |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
    for res in results:
        for r in res["rows"]:
            head = f"| {res['name']} | {r['size']} | {r['batch']} |"
            if "error" in r:
                lines.append(f"{head} failed: {md_cell(r['error'], 160)} | | | | | | | |")
                continue
            bound = _bound_ms(r, bw)
            ms = r["decode_ms"]
            ref = base.get((r["size"], r["batch"]))
            ran = "" if r["steps"] == r["slots"] - args.prompt else f" (ran {r['steps']} steps)"
            lines.append(
                f"{head} {r['compile_s']:.1f} | {ms:.3f}{ran} | {r['batch'] * 1e3 / ms:.0f} | "
                + (f"{bound:.3f} | {bound / ms:.2f} |" if bound else "n/a | n/a |")
                + (f" {ref / ms:.2f}x |" if ref else " |")
                + f" {r.get('tokens')} ({r.get('tokens') == digests.get((r['size'], r['batch']))}"
                + f"{same_rows(r.get('token_ids'), ids.get((r['size'], r['batch'])))}) |"
                + f" {1e3 * r['short_s']:.1f} | "
                + (f"{r['prefill_tflops']:.1f} |" if "prefill_tflops" in r else "n/a |"))
        if res["status"] != "ok":
            why = md_cell(res["log_tail"].replace("\n", " / "), 200)
            lines.append(f"| {res['name']} | {res['status']} ({len(res['rows'])} rows done): "
                         f"{why} | | | | | | | | | |")
    return lines


def kernel_lines(results: list[dict]) -> list[str]:
    """The kernel-count table from each row's optimized HLO."""
    lines = ["| flag set | shape | batch | kernels / step | host launches / step | in graphs | "
             "while in graph | cond kernels | by kind |",
             "|---|---|---:|---:|---:|---:|---|---:|---|"]
    for res in results:
        for r in res["rows"]:
            k = r.get("kernels")
            head = f"| {res['name']} | {r['size']} | {r['batch']} |"
            if not k:
                continue
            if "error" in k:
                lines.append(f"{head} n/a: {md_cell(k['error'], 120)} | | | | | |")
                continue
            kinds = ", ".join(f"{n} {c}" for c, n in k["by_kind"].items())
            lines.append(f"{head} {k['kernels']} | {k['host_launches']} | {k['in_graph']} | "
                         f"{'yes' if k['while_in_graph'] else 'no'} | {k['cond_kernels']} | "
                         f"{md_cell(kinds, 200)} |")
    return lines


def summarise_traces(res: dict) -> None:
    """Adds ``trace_md`` (markdown lines) to each of a flag set's rows that was traced, or
    that failed to be: read once, when the child is done."""
    for r in res["rows"]:
        t = r.get("trace")
        if r.get("trace_error"):
            r["trace_md"] = ["", f"## Trace: {res['name']}, {r['size']} batch {r['batch']}",
                             "", f"Not traced: {md_cell(r['trace_error'], 300)}"]
        if not t:
            continue
        lines = ["", f"## Trace: {res['name']}, {r['size']} batch {r['batch']}, "
                 f"{t['calls']} calls of {t['steps']} steps + one 1-step call", ""]
        try:
            lines += trace_summary(load_trace(Path(t["dir"])), t["steps"])
        except Exception as e:  # a trace we cannot read: say so, keep the rest
            lines.append(f"Trace not summarised: {type(e).__name__}: {md_cell(str(e), 200)}")
        r["trace_md"] = lines


def trace_lines(results: list[dict]) -> list[str]:
    """Every traced row's summary (``summarise_traces``), in order."""
    return [line for res in results for r in res["rows"] for line in r.get("trace_md", [])]


def report(results: list[dict], args) -> str:
    """The markdown report of every flag set's results."""
    bw = next((r["bandwidth_gbs"] for r in results if r.get("bandwidth_gbs")), None)
    dev = next((r for r in results if r.get("device")), {})
    lines = [f"# Decode against the bandwidth bound: {dev.get('device', '?')} "
             f"({dev.get('platform', '?')}), jax {dev.get('jax', '?')}", "",
             "Bandwidth ceiling: " + (f"{bw:.0f} GB/s (jitted float32 sum over "
                                      f"{args.bandwidth_gib:g} GiB)" if bw else "n/a") + ".",
             f"Greedy, {args.prompt}-token random prompts, {args.new} new tokens, bf16 "
             f"compute copy of random weights; best of {args.repeats} warm calls.", "",
             "## Decode ms per token-step", "", *timing_lines(results, bw, args), "",
             "## Kernels per decode token-step (optimized HLO of the decode while-loop body)",
             "", *kernel_lines(results), "", "## Flag sets", "",
             "| flag set | XLA_FLAGS added | status | wall s |", "|---|---|---|---:|"]
    lines += [f"| {r['name']} | `{r['flags'] or '(none)'}` | {r['status']} | {r['wall_s']:.0f} |"
              for r in results]
    traced = trace_lines(results)
    if not traced and args.trace_flagsets:
        traced = ["", f"No trace: batch {args.trace_batch} (--trace-batch) did not run in "
                  f"a traced flag set ({args.trace_flagsets})."]
    lines += traced
    return "\n".join(lines) + "\n"


def keep_files(work: Path, dest: Path, largest_mib: float = 20) -> None:
    """Copies the children's logs, JSON, kept HLO and Perfetto traces (each under
    ``largest_mib``) to ``dest``; the profiler's raw ``.xplane.pb`` stays behind."""
    dest.mkdir(parents=True, exist_ok=True)
    for pattern in ("*.log", "*.json", "hlo_*.txt.gz", "**/perfetto_trace.json.gz"):
        for f in work.glob(pattern):
            if f.stat().st_size <= largest_mib * 2**20:
                name = f.name if f.parent == work else f"{f.relative_to(work).parts[0]}_{f.name}"
                shutil.copyfile(f, dest / name)


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="0.5b", help="0.5b, 1.5b, 3b, 7b or smoke")
    ap.add_argument("--batches", default="1,32,128")
    ap.add_argument("--other-batches", default=None,
                    help="batches of the flag sets after the first (default: --batches); the "
                         "first set's rows are the reference of every 'vs default' ratio")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--flagsets", default="default,cmdbuf_while,cublas_gemm",
                    help=f"comma-separated names of {sorted(FLAGSETS)}")
    ap.add_argument("--extra-flagset", action="append", default=[], metavar="NAME=FLAGS",
                    help="another flag set, e.g. 'graphs_traced=--xla_enable_command_buffers_"
                         "during_profiling=true' (with --trace-flagsets default,graphs_traced)")
    ap.add_argument("--bandwidth-gib", type=float, default=4.0)
    ap.add_argument("--trace-flagsets", default="default")
    ap.add_argument("--trace-batch", type=int, default=32)
    ap.add_argument("--trace-steps", type=int, default=32)
    ap.add_argument("--trace-calls", type=int, default=2)
    ap.add_argument("--budget-s", type=float, default=330,
                    help="wall seconds for all flag sets together; later sets are skipped")
    ap.add_argument("--worker-timeout-s", type=float, default=170)
    ap.add_argument("--min-worker-s", type=float, default=45,
                    help="skip a flag set when less than this is left of the budget")
    ap.add_argument("--work-dir", default=None,
                    help="children's JSON, logs, traces and HLO (default: a temporary folder; "
                         "with --out the small ones are copied to bench_decode_files/ next to it)")
    ap.add_argument("--out", default=None, help="also write the markdown report here")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--json", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--trace-dir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--hlo-dir", default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main() -> None:
    args = parse()
    if args.worker:
        worker(args)
        return
    sets = dict(FLAGSETS)
    sets.update(e.split("=", 1) for e in args.extra_flagset)
    names = [n for n in args.flagsets.split(",") if n] + [e.split("=", 1)[0]
                                                          for e in args.extra_flagset]
    unknown = [n for n in names if n not in sets]
    if unknown:
        raise SystemExit(f"unknown flag sets {unknown}; known: {sorted(sets)}")
    if args.work_dir:
        work = Path(args.work_dir)
    else:
        work = Path(tempfile.mkdtemp(prefix="bench_decode_"))
    work.mkdir(parents=True, exist_ok=True)
    if args.out:
        Path(args.out).resolve().parent.mkdir(parents=True, exist_ok=True)
    print(f"[bench_decode] children's JSON, logs, traces and HLO under {work}", flush=True)
    start = time.monotonic()
    results = []
    for i, name in enumerate(names):
        left = args.budget_s - (time.monotonic() - start)
        if left < args.min_worker_s:
            results.append({"name": name, "flags": sets[name], "rows": [], "wall_s": 0.0,
                            "status": f"skipped ({max(left, 0):.0f} s of the budget left)",
                            "log_tail": ""})
            continue
        res = run_flagset(name, sets[name], args, min(args.worker_timeout_s, left), work,
                          first=i == 0)
        summarise_traces(res)
        results.append(res)
        if args.out:  # so far: a run stopped from outside still leaves a report
            Path(args.out).write_text(report(results, args))
            keep_files(work, Path(args.out).resolve().parent / "bench_decode_files")
    text = report(results, args)
    print(text, flush=True)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
