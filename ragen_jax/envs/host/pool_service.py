"""``PoolService``: a ``ProcessPool`` driven by its own thread, for callers on other threads
(the env server), sharing each worker fairly between clients."""

from __future__ import annotations

import collections
import contextlib
import os
import threading
from collections.abc import Callable, Hashable

from ragen_jax.envs.host.processes import Job, ProcessPool

Waiting = tuple[Job, Callable[[Job], None]]


class FairQueue:
    """The jobs waiting for one worker, taken round robin across clients, each client's in
    the order it gave them: a client with many queued calls delays another's next call by at
    most one of its own, where a single FIFO would make the other wait for all of them."""

    def __init__(self) -> None:
        # Clients with waiting jobs, in turn order: the front one is served next and goes to
        # the back if it has more; a client new to the queue joins at the back.
        self._clients: collections.OrderedDict[Hashable, collections.deque[Waiting]] = (
            collections.OrderedDict())

    def __len__(self) -> int:
        return len(self._clients)

    def put(self, client: Hashable, item: Waiting) -> None:
        self._clients.setdefault(client, collections.deque()).append(item)

    def take(self) -> Waiting:
        """The front client's oldest job (the queue must not be empty)."""
        client, items = self._clients.popitem(last=False)
        item = items.popleft()
        if items:
            self._clients[client] = items
        return item


class PoolService:
    """A ``ProcessPool`` driven by its own thread, for callers on other threads (the env
    server): ``submit(job, done, client)`` queues a job and returns at once; ``done(job)`` is
    called on the service's thread when the job has its reply or error. Jobs of different
    rows run at the same time on different workers, so one caller's hang does not wait on
    another's; the jobs waiting for one worker go to it one at a time, round robin across
    ``client`` keys (``FairQueue``), so each client's jobs keep their order."""

    def __init__(self, pool: ProcessPool):
        self.pool = pool
        self._incoming: collections.deque = collections.deque()
        self._queues = [FairQueue() for _ in pool.slots]  # touched on the service's thread only
        # Each counter is written by one thread only (submit's caller, the service), so their
        # difference is safe to read anywhere.
        self._submitted = self._started = 0
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)  # a full pipe wakes the loop already
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="ragen_jax-env-pool", daemon=True)
        self._thread.start()

    def submit(self, job: Job, done: Callable[[Job], None], client: Hashable = None) -> None:
        """Queues ``job`` behind the jobs ``client`` queued before it (call from one thread)."""
        if self._closed:
            raise RuntimeError("the env pool is closed")
        self._submitted += 1
        self._incoming.append((job, done, client))  # deque.append is atomic
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_w, b"\0")

    def backlog(self) -> int:
        """Jobs submitted that no worker has taken yet (for tests and monitoring)."""
        return self._submitted - self._started

    def _loop(self) -> None:
        pending: list[Waiting] = []
        slots = self.pool.slots
        while not self._closed:
            with contextlib.suppress(BlockingIOError):
                os.read(self._wake_r, 4096)
            while self._incoming:
                job, done, client = self._incoming.popleft()
                self._queues[slots.index(self.pool.home(job.row))].put(client, (job, done))
            for slot, queue in zip(slots, self._queues, strict=True):
                # One job at a time per worker, so the next is chosen when the worker is free.
                if slot.job is None and not slot.queue and queue:
                    job, done = queue.take()
                    self._started += 1
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
