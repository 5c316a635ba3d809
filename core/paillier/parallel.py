"""Execution backends: run the same chunk function serially, in local processes or threads,
or on Dask.

Chunk functions are module-level and receive only plain data (moduli, ciphertext ints,
int64 exponent arrays), so every backend computes bit-identical results for deterministic
operations. Private-key material never goes to a Dask cluster unless explicitly allowed.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.context
import multiprocessing.util
import os
import sys
import threading
import types
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

import numpy as np

from core.lifetime import exit_with
from core.paillier.errors import BackendError

T = TypeVar("T")


class Backend(Protocol):
    """Anything that can map a picklable function over argument tuples."""

    @property
    def parallelism(self) -> int:
        """How many chunks are worth creating (1 means: do not split)."""
        ...

    def run(
        self, function: Callable[..., T], arguments: Sequence[tuple[Any, ...]], *, sensitive: bool
    ) -> list[T]:
        """Apply ``function(*args)`` to every tuple, preserving order."""
        ...


class SerialBackend:
    """In-process execution; the reference the parallel backends must match."""

    @property
    def parallelism(self) -> int:
        return 1

    def run(
        self,
        function: Callable[..., T],
        arguments: Sequence[tuple[Any, ...]],
        *,
        sensitive: bool = False,
    ) -> list[T]:
        return [function(*args) for args in arguments]


class _LocalPool(SerialBackend):
    """What both local pools share: chunks mapped in order on the pool's executor, a call of
    one chunk (or none) in the caller, as the serial backend runs it."""

    _max_workers: int

    @property
    def parallelism(self) -> int:
        return self._max_workers

    def _pool(self) -> Executor:
        raise NotImplementedError

    def run(
        self,
        function: Callable[..., T],
        arguments: Sequence[tuple[Any, ...]],
        *,
        sensitive: bool = False,
    ) -> list[T]:
        if len(arguments) <= 1:
            return super().run(function, arguments)
        futures = [self._pool().submit(function, *args) for args in arguments]
        return [future.result() for future in futures]


class ThreadBackend(_LocalPool):
    """Threads of this process, for chunk functions whose time goes to C code that releases
    the GIL and that gain from sharing this process's state: one fixed-base table serves
    every thread, where each worker process would build its own."""

    def __init__(self, max_workers: int) -> None:
        if max_workers < 1:
            raise BackendError(f"max_workers must be >= 1, got {max_workers}")
        self._max_workers = max_workers
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def _pool(self) -> Executor:
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(
                    self._max_workers, thread_name_prefix="privreg-kernel"
                )
            return self._executor


_MAIN_SWAP = threading.Lock()


@contextlib.contextmanager
def _main_module_hidden() -> Iterator[None]:
    """While a worker starts, show multiprocessing a bare ``__main__``.

    A ``forkserver`` or ``spawn`` worker normally re-imports the parent's main script. A
    script that calls a flow at module level (no ``if __name__ == "__main__":`` guard, as in
    Prefect's own examples) would then run the flow again in every worker, which fails and
    breaks the pool. Our chunk functions all live in importable modules, so workers never
    need the caller's ``__main__``: hiding it for the instant of the start is enough.
    """
    with _MAIN_SWAP:
        real = sys.modules["__main__"]
        sys.modules["__main__"] = types.ModuleType("__main__")
        try:
            yield
        finally:
            sys.modules["__main__"] = real


class _ForkServerWorker(multiprocessing.context.ForkServerProcess):
    def start(self) -> None:
        with _main_module_hidden():
            super().start()


class _SpawnWorker(multiprocessing.context.SpawnProcess):
    def start(self) -> None:
        with _main_module_hidden():
            super().start()


class _ForkServerWorkers(multiprocessing.context.ForkServerContext):
    Process = _ForkServerWorker


class _SpawnWorkers(multiprocessing.context.SpawnContext):
    Process = _SpawnWorker


def _worker_context(start_method: str) -> multiprocessing.context.BaseContext:
    """The start method's context, with workers that never import the caller's main."""
    if start_method == "forkserver":
        return _ForkServerWorkers()
    if start_method == "spawn":
        return _SpawnWorkers()
    return multiprocessing.get_context(start_method)


class ProcessBackend(_LocalPool):
    """A local process pool, created lazily and reused across calls (start-up is costly).

    Uses the ``forkserver`` start method so that worker processes never inherit threads or
    locks of a busy parent (Prefect, Dask clients), and starts them without re-importing the
    caller's main script (see :func:`_main_module_hidden`).
    """

    def __init__(self, max_workers: int | None = None, *, start_method: str = "forkserver"):
        if max_workers is not None and max_workers < 1:
            raise BackendError(f"max_workers must be >= 1, got {max_workers}")
        self._max_workers = max_workers or os.cpu_count() or 1
        self._start_method = start_method
        self._executor: Executor | None = None
        self._threads = ThreadBackend(self._max_workers)

    def threads(self) -> ThreadBackend:
        """As many threads of this process as there are workers (see :class:`ThreadBackend`)."""
        return self._threads

    def _pool(self) -> Executor:
        if self._executor is None:
            context = _worker_context(self._start_method)
            # a worker ends with this process, even one killed by SIGKILL (core.lifetime)
            self._executor = ProcessPoolExecutor(
                self._max_workers,
                mp_context=context,
                initializer=exit_with,
                initargs=(os.getpid(),),
            )
            # shut down before multiprocessing joins this process's children at its exit: a
            # process that is itself a multiprocessing child (Prefect's runner starts each
            # flow run so) would otherwise wait forever for the idle workers
            multiprocessing.util.Finalize(self, self._end_workers, exitpriority=10)
        return self._executor

    def close(self) -> None:
        """Shut the worker processes down."""
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None

    def _end_workers(self) -> None:
        """At this process's exit: the idle workers are ended outright (an orderly shutdown
        from inside multiprocessing's own exit hook waits on them forever), then reaped."""
        if self._executor is not None:
            for worker in list(getattr(self._executor, "_processes", {}).values()):
                worker.terminate()
            self.close()

    def __enter__(self) -> ProcessBackend:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


class DaskBackend:
    """Runs chunks on an existing Dask cluster (``Client(address)``) or a given client.

    ``allow_private_key`` must be set explicitly before decryption chunks (which carry the
    private key's primes) may be shipped to the cluster.
    """

    def __init__(
        self,
        address: str | None = None,
        *,
        client: Any | None = None,
        allow_private_key: bool = False,
    ) -> None:
        if (address is None) == (client is None):
            raise BackendError("give exactly one of a scheduler address or a dask Client")
        if client is None:
            from dask.distributed import Client

            client = Client(address)
            self._owns_client = True
        else:
            self._owns_client = False
        self._client = client
        self._allow_private_key = allow_private_key

    @property
    def parallelism(self) -> int:
        threads = sum(self._client.nthreads().values())
        return max(int(threads), 1)

    def run(
        self,
        function: Callable[..., T],
        arguments: Sequence[tuple[Any, ...]],
        *,
        sensitive: bool = False,
    ) -> list[T]:
        if sensitive and not self._allow_private_key:
            raise BackendError(
                "refusing to send private-key material to a Dask cluster; construct "
                "DaskBackend(..., allow_private_key=True) if the cluster is trusted"
            )
        futures = [
            self._client.submit(function, *[self._ship(value) for value in args], pure=False)
            for args in arguments
        ]
        return list(self._client.gather(futures))

    def _ship(self, value: Any) -> Any:
        """Scatter bulky arguments (ciphertext lists, exponent arrays) instead of embedding
        them in the task graph, which Dask warns about and serialises less efficiently."""
        if isinstance(value, list | tuple | np.ndarray) and len(value) > 64:
            return self._client.scatter([value], hash=False)[0]  # one object, not per item
        return value

    def close(self) -> None:
        """Close the client if this backend created it."""
        if self._owns_client:
            self._client.close()

    def __enter__(self) -> DaskBackend:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


SERIAL = SerialBackend()


def for_kernel(backend: Backend, in_kernel: bool) -> Backend:
    """``backend``, or its process's threads when the chunks run ``in_kernel`` (C code that
    releases the GIL): the threads then share the process's tables and need nothing shipped.
    A Dask cluster and the serial backend stay as they are."""
    if in_kernel and isinstance(backend, ProcessBackend):
        return backend.threads()
    return backend


def chunk_bounds(length: int, parts: int) -> list[tuple[int, int]]:
    """Split ``range(length)`` into at most ``parts`` contiguous, near-equal, non-empty pieces."""
    parts = max(1, min(parts, length))
    if length == 0:
        return []
    step, extra = divmod(length, parts)
    bounds, start = [], 0
    for index in range(parts):
        stop = start + step + (1 if index < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds
