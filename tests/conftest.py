"""Every test session caches warm-starts in its own folder, never in the user's cache.

JAX's persistent compilation cache is deliberately not used: shared by the xdist workers and
the processes they start, XLA:CPU crashed (a segfault) about twice a session while reading or
writing an entry, in a different test each time.
"""

import os

import pytest


@pytest.fixture(autouse=True, scope="session")
def _private_warmstart_cache(tmp_path_factory):
    old = os.environ.get("RAGEN_JAX_CACHE")
    os.environ["RAGEN_JAX_CACHE"] = str(tmp_path_factory.mktemp("ragen_jax_cache"))
    yield
    if old is None:
        os.environ.pop("RAGEN_JAX_CACHE", None)
    else:
        os.environ["RAGEN_JAX_CACHE"] = old
