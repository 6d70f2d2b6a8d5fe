"""``PoolService``: a ``ProcessPool`` driven by its own thread, for callers on other threads
(the env server)."""

from __future__ import annotations

import collections
import contextlib
import os
import threading
from collections.abc import Callable

from ragen_jax.envs.host.processes import Job, ProcessPool


class PoolService:
    """A ``ProcessPool`` driven by its own thread, for callers on other threads (the env
    server): ``submit(job, done)`` queues a job and returns at once; ``done(job)`` is called on
    the service's thread when the job has its reply or error. Jobs of different rows run at
    the same time on different workers, so one caller's hang does not wait on another's."""

    def __init__(self, pool: ProcessPool):
        self.pool = pool
        self._incoming: collections.deque = collections.deque()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)  # a full pipe wakes the loop already
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="ragen_jax-env-pool", daemon=True)
        self._thread.start()

    def submit(self, job: Job, done: Callable[[Job], None]) -> None:
        if self._closed:
            raise RuntimeError("the env pool is closed")
        self._incoming.append((job, done))  # deque.append is atomic
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_w, b"\0")

    def _loop(self) -> None:
        pending: list[tuple[Job, Callable[[Job], None]]] = []
        while not self._closed:
            with contextlib.suppress(BlockingIOError):
                os.read(self._wake_r, 4096)
            while self._incoming:
                job, done = self._incoming.popleft()
                self.pool.submit([job])
                pending.append((job, done))
            self.pool.pump(wake=[self._wake_r])
            still = []
            for job, done in pending:
                if not job.done:
                    still.append((job, done))
                    continue
                with contextlib.suppress(Exception):  # a caller's callback must not stop the pool
                    done(job)
            pending = still

    def close(self) -> None:
        """Stops the thread and ends the workers (idempotent; jobs still running get no reply)."""
        if not self._closed:
            self._closed = True
            with contextlib.suppress(BlockingIOError):
                os.write(self._wake_w, b"\0")
            self._thread.join(timeout=10.0)
            os.close(self._wake_r)
            os.close(self._wake_w)
        self.pool.close()
