"""Every test session caches warm-starts in its own folder, never in the user's cache, and
shares compiled XLA programs between its workers and the processes they start.

Many tests build the same micro model and trainer, so the same programs are compiled again and
again; JAX's persistent compilation cache, in a folder that belongs to this test session only
(made fresh and removed at the end, shared by its xdist workers and the processes they start),
makes a repeat a file read. It changes no result: an entry is keyed by the program, its
compile options and the jax/XLA version. (XLA:CPU's occasional segfaults under the tests, about
two a session, are not the cache's: a session without it had as many, in plain compiles, and
took 39 minutes against 31; pyproject.toml reruns a test whose worker crashed.)
"""

import os
import shutil
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
    "jax_persistent_cache_min_compile_time_secs": 0.1,
    # A size limit turns on the cache's file lock: no process reads an entry another is writing.
    "jax_compilation_cache_max_size": 4 << 30,
}
for _name, _value in _JIT_CACHE_SETTINGS.items():
    os.environ[_name.upper()] = str(_value)  # for the processes tests start
    jax.config.update(_name, _value)  # for this one (jax is imported already)


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
