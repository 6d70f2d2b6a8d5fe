"""Every test session caches warm-starts in its own folder, never in the user's cache, shares
compiled XLA programs between its workers and the processes they start, compiles them fast,
and keeps each worker's memory mappings under the kernel's limit.

Many tests build the same micro model and trainer, so the same programs are compiled again and
again; JAX's persistent compilation cache, in a folder that belongs to this test session only
(made fresh and removed at the end, shared by its xdist workers and the processes they start),
makes a repeat a file read. It changes no result: an entry is keyed by the program, its
compile options and the jax/XLA version.

XLA:CPU keeps each compiled program's machine code in its own small memory mappings (about six
per program), and JAX keeps every program a live jitted function compiled. A worker runs
hundreds of tests in one process and compiles thousands of programs: at the kernel's
``vm.max_map_count`` (65,530 by default) the next compile, executable load or serialization
fails to map memory ("LLVM compilation error: Cannot allocate memory") and the worker dies of
a segfault or an abort. So after a test that leaves the worker above half the limit, JAX's
caches are cleared (the programs are unmapped; later tests read them back from the persistent
cache).
"""

import gc
import os
import shutil
import subprocess
import sys
import tempfile

import jax
import pytest

# The process that starts the session (xdist's controller, or the only one) makes the folder
# before any worker exists; workers and the processes tests start inherit it in the environment.
_OWN_JIT_CACHE = None
if "RAGEN_JAX_TESTS_JIT_CACHE" not in os.environ:
    _OWN_JIT_CACHE = tempfile.mkdtemp(prefix="ragen_jax-tests-jit-cache-")
    os.environ["RAGEN_JAX_TESTS_JIT_CACHE"] = _OWN_JIT_CACHE
_JIT_CACHE_SETTINGS = {
    "jax_compilation_cache_dir": os.environ["RAGEN_JAX_TESTS_JIT_CACHE"],
    # Every program, however quick to compile: most of a session's thousands of compiles are
    # small programs that each worker and each started process compiles again, and reading
    # one back costs less than compiling it.
    "jax_persistent_cache_min_compile_time_secs": 0.0,
    # A size limit turns on the cache's file lock: no process reads an entry another is writing.
    "jax_compilation_cache_max_size": 4 << 30,
}
# XLA:CPU compiling fast rather than well: compiling is most of a test's time (a micro run's
# steps take under a second once compiled). LLVM at its lowest optimisation level and XLA's
# older loop emitters instead of its MLIR fusion emitters: together a cold micro Bandit run
# takes 17-18 CPU-s instead of 28-33 (either alone saves little: the emitters cost most at
# level 0). Each program's code generated in one piece, not split for parallel compilation
# (the workers already fill the cores): ~14% off that run again. Floats can differ in their
# last bits from the default build (instruction choices such as fused multiply-adds), so a
# seed's run can take another path; every comparison the tests make is between programs
# compiled alike, or within tolerances. Set before jax starts its backend, unless XLA_FLAGS
# names a level; the processes tests start inherit it. XLA aborts on a flag it does not know,
# so the flags are tried once, in a child process: a jax other than .ci/constraints.txt's may
# have dropped the last two (then the level alone is set).
_FAST_COMPILE = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false",
                 "--xla_cpu_parallel_codegen_split_count=1")


def _xla_knows(flags: str) -> bool:
    probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"],
                           env=dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu"),
                           capture_output=True)
    return probe.returncode == 0


if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    _flags = f"{os.environ.get('XLA_FLAGS', '')} {' '.join(_FAST_COMPILE)}".strip()
    if not _xla_knows(_flags):
        _flags = f"{os.environ.get('XLA_FLAGS', '')} {_FAST_COMPILE[0]}".strip()
    os.environ["XLA_FLAGS"] = _flags
for _name, _value in _JIT_CACHE_SETTINGS.items():
    os.environ[_name.upper()] = str(_value)  # for the processes tests start
    jax.config.update(_name, _value)  # for this one (jax is imported already)


def _skip_eviction_scans() -> None:
    """With a size limit, JAX's cache lists the folder and reads every entry's access time on
    each write, to choose what to evict: a write costs time in proportion to the entries, the
    session's writes together in proportion to their square (a full run writes some 2,000
    entries: minutes of CPU). The limit is there for the lock that comes with it; this
    session's folder stays far below it and is removed at the end, so the scan is skipped in
    the workers (where nearly all writes happen). A jax whose cache has no such method is left
    as it is."""
    from jax._src import lru_cache

    if callable(getattr(lru_cache.LRUCache, "_evict_if_needed", None)):
        lru_cache.LRUCache._evict_if_needed = lambda self, *, additional_size=0: None


_skip_eviction_scans()


def pytest_unconfigure(config):
    if _OWN_JIT_CACHE is not None:
        shutil.rmtree(_OWN_JIT_CACHE, ignore_errors=True)


@pytest.fixture(autouse=True, scope="session")
def _private_warmstart_cache(tmp_path_factory):
    old = os.environ.get("RAGEN_JAX_CACHE")
    os.environ["RAGEN_JAX_CACHE"] = str(tmp_path_factory.mktemp("ragen_jax_cache"))
    yield
    if old is None:
        os.environ.pop("RAGEN_JAX_CACHE", None)
    else:
        os.environ["RAGEN_JAX_CACHE"] = old


def child_xla_flags() -> str:
    """This session's ``XLA_FLAGS`` (its compile settings) without a device count, for a child
    process that sets its own devices."""
    return " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f)


def _mappings() -> int | None:
    """This process's memory mappings, or None where /proc does not tell."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return None


def _map_limit() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 65530


_MAPPINGS_CLEARED_ABOVE = _map_limit() // 2


@pytest.fixture(autouse=True)
def _release_compiled_programs():
    """Clears JAX's caches after a test that left this worker above half the kernel's limit on
    memory mappings (the module docstring says why)."""
    yield
    n = _mappings()
    if n is not None and n > _MAPPINGS_CLEARED_ABOVE:
        jax.clear_caches()
        gc.collect()


# Files whose tests train end to end or start processes that do (a minute or more each), in
# this order before the rest: the workers then finish together instead of one working through
# a long last test while the others wait.
_LONG_FIRST = ("test_distributed.py", "test_train.py", "test_hf_folder.py",
               "test_checkpoint_recovery.py", "test_held_out.py", "test_compilation.py",
               "test_remote_train.py", "test_eval.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(_LONG_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable within a file
