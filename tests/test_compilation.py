"""XLA compilation: the per-step compile counts a run reports, the persistent cache shared by
processes, and a multi-turn run with a real-model preset's settings that compiles nothing
after its first validation and diagnostics cycle."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ragen_jax import compilation
from ragen_jax.compilation import CompileWatch, progress_note
from ragen_jax.metrics import read_jsonl

ROOT = Path(__file__).resolve().parent.parent


def test_a_watch_counts_each_compile_once():
    @jax.jit
    def f(x):
        return jnp.sin(x) * 3 + 1

    seven, other_seven, nine = np.ones(7, np.float32), np.full(7, 2, np.float32), np.ones(9, np.float32)
    watch = CompileWatch()
    f(seven)
    first = watch.take()
    assert first["compile/count"] >= 1 and first["compile/seconds"] > 0
    assert any("f" in name for name in watch.names), watch.names
    f(other_seven)  # same shape: no compile
    assert watch.take()["compile/count"] == 0
    f(nine)  # a new shape compiles again
    again = watch.take()
    assert again["compile/count"] >= 1
    assert "compiled" in progress_note(again) and progress_note({"compile/count": 0.0}) == ""
    assert watch.totals()["compile/count"] >= first["compile/count"] + again["compile/count"]


def test_the_cache_folder_and_its_settings(monkeypatch, tmp_path):
    monkeypatch.setenv("RAGEN_JAX_CACHE", str(tmp_path))
    monkeypatch.delenv("RAGEN_JAX_XLA_CACHE", raising=False)
    assert compilation.cache_dir() == tmp_path / "xla"  # on by default, the CPU included
    for off in ("0", "off", "false"):
        monkeypatch.setenv("RAGEN_JAX_XLA_CACHE", off)
        assert compilation.cache_dir() is None
    # A cache the process already has (here: the test suite's) is left as it is.
    assert compilation.enable_persistent_cache() == Path(jax.config.jax_compilation_cache_dir)


_WRITER = """
import os, sys
import jax, jax.numpy as jnp
from ragen_jax.compilation import CompileWatch, enable_persistent_cache
jax.config.update("jax_compilation_cache_dir", None)
os.environ["RAGEN_JAX_CACHE"] = sys.argv[1]
enable_persistent_cache()
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
watch = CompileWatch()
total = 0.0
for n in range(8):  # eight programs, one per shape, each a few matmuls deep
    x = jnp.arange(16 * (n + 1), dtype=jnp.float32).reshape(-1, 16) / 100
    f = jax.jit(lambda x: jnp.tanh(jnp.tanh(x @ x.T) @ x).sum())
    total += float(f(x))
print(total, watch.totals()["compile/cache_hits"])
"""


def test_one_cache_written_and_read_by_two_processes_at_once(tmp_path):
    """Two processes compile the same programs into one empty cache at the same time, then a
    third reads them back: no crash, the same results, and the third's programs come from
    the cache."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")
           and k != "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"}

    def start():
        return subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path)], cwd=ROOT, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    writers = [start(), start()]
    outs = [w.communicate(timeout=240) for w in writers]
    assert [w.returncode for w in writers] == [0, 0], [o[1][-2000:] for o in outs]
    reader = start()
    out, err = reader.communicate(timeout=240)
    assert reader.returncode == 0, err[-2000:]
    results = [o[0].split()[0] for o in outs] + [out.split()[0]]
    assert len(set(results)) == 1, results
    assert float(out.split()[1]) >= 8  # every program read back
    assert any((tmp_path / "xla").iterdir())


def test_a_multi_turn_run_compiles_nothing_after_its_first_cycle(tmp_path):
    """Tiny FrozenLake with a real-model preset's stop strings and a short format-only warm
    start (answers of varying length; first prompts near a 64-token bucket's edge), on a
    one-layer micro random model: validation every 2 steps (0, 2, 4), diagnostics every 2
    (steps 1 and 3), 4 steps. Every program compiles by the end of the first step (after the first
    validation); no later step compiles. Without the shape marks (ragen_jax.shapes) the
    sampler's first-turn bucket, the update's width and the diagnostics' inputs compiled
    again at later steps (at steps 3 and 4 of this run with 16 episodes a step; at 12 steps
    with both every 5, at steps 4 and 11). The rollout filter keeps half the groups' length
    (``top_p`` 0.5 of the ``length`` metric), in mini-batches of 2 rows: a step trains on
    fewer rows than the batch, in the update compiled once for the whole batch (the row
    count's mark, ``rows.arrange_rows``)."""
    from ragen_jax.config.loading import load_config
    from ragen_jax.train import run

    config = load_config([
        "--config", str(ROOT / "configs/frozenlake.py"),
        f"--config.trainer.output_dir={tmp_path}", "--config.trainer.total_steps=4",
        "--config.trainer.progress=False", "--config.trainer.test_freq=2",
        "--config.trainer.save_freq=100", "--config.diagnostics.compute_freq=2",
        # One narrow layer: which shapes a step compiles for depends on neither depth nor width.
        "--config.model.hidden_size=32", "--config.model.intermediate_size=64",
        "--config.model.num_hidden_layers=1",
        "--config.warmstart.steps=2", "--config.warmstart.turns.steps=0",
        "--config.warmstart.episodes=16", "--config.warmstart.batch_size=8",
        "--config.warmstart.cache=False", "--config.warmstart.solver_share=0",
        "--config.rollout.sampling.stop_strings=('</answer>',)", "--config.rollout.env_groups=4",
        "--config.rollout.group_size=2", "--config.rollout.val.env_groups=8",
        "--config.actor.ppo_mini_batch_size=2", "--config.actor.micro_batches=2",
        "--config.filter.value=0.5",
        "--config.filter.metric=length",
        "--config.diagnostics.num_samples=8", "--config.diagnostics.trajectory_samples=8"])
    summary = run(config)
    metrics = read_jsonl(tmp_path / "metrics.jsonl")
    counts = {s: metrics[s]["compile/count"] for s in sorted(metrics)}
    assert counts[1] > 0  # the first step compiles
    assert all(counts[s] == 0 for s in range(2, 5)), counts
    assert summary["compile_count"] >= counts[1] and summary["compiled_after_step_1"] == []
    # the answers' lengths did vary
    lengths = [metrics[s]["train/FrozenLake/response_length"] for s in range(1, 5)]
    assert len(set(np.round(lengths, 3))) > 1, lengths
    # the filter left fewer rows than the batch's 8: every update trained on padding rows
    # too, in the program compiled for 8 (that another count shares it:
    # tests/starpo/test_static_rows.py)
    rows = [metrics[s]["train/batch_size"] for s in range(1, 5)]
    assert max(rows) < 8, rows
    json.dumps(summary)  # the summary stays plain data


def test_clearing_jaxs_caches_unmaps_compiled_programs():
    """The premise of tests/conftest.py's guard against the kernel's cap on a process's memory
    mappings: XLA:CPU maps each compiled program's code, and ``jax.clear_caches()`` unmaps
    the programs nothing else holds."""
    import gc

    from tests.conftest import _mappings

    if _mappings() is None:
        pytest.skip("no /proc/self/maps here")
    f = jax.jit(lambda x: jnp.tanh(x * 3.0 + 2.0).sum())
    # What earlier tests of this worker left unreferenced is unmapped first: else a collection
    # during the loop below can unmap more than the loop maps.
    jax.clear_caches()
    gc.collect()
    before = _mappings()
    for n in range(1, 17):  # sixteen programs, one per shape, all kept by ``f``
        f(jnp.ones(n, jnp.float32))
    grown = _mappings()
    assert grown - before >= 16  # at least one mapping a program
    jax.clear_caches()
    gc.collect()
    assert _mappings() - before < (grown - before) / 4
