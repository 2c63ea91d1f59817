"""Background prefetch: compute tasks ahead on worker threads or processes, deliver in order.

Guarantee: `Prefetcher.run(tasks)` yields (task, compute(task)) in exactly the order of `tasks`,
whatever the number of workers (0 = compute inline in the caller), their kind or the prefetch
depth (how many tasks may be submitted ahead of the consumer). Since `compute` is a pure
function of its task (batches.py), the delivered bytes cannot depend on those settings; they only
decide how much work overlaps with the consumer. Process workers are started with "spawn" and
build their own state once through `initializer(*initargs)`; `compute` must then be a module-level
function. Workers are shut down by `close()` (or leaving the `with` block).
"""

from __future__ import annotations

import multiprocessing
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")
WORKER_TYPES = ("thread", "process")


class Prefetcher:
    def __init__(
        self,
        compute: Callable[[Any], Any],
        *,
        workers: int = 0,
        depth: int = 2,
        kind: str = "thread",
        initializer: Callable[..., None] | None = None,
        initargs: tuple = (),
    ) -> None:
        if workers < 0:
            raise ValueError(f"workers must be >= 0, got {workers}")
        if depth < 1:
            raise ValueError(f"prefetch depth must be >= 1, got {depth}")
        if kind not in WORKER_TYPES:
            raise ValueError(f"unknown worker type {kind!r}; choose from {', '.join(WORKER_TYPES)}")
        self.compute, self.workers, self.depth, self.kind = compute, workers, depth, kind
        self._initializer, self._initargs = initializer, initargs
        self._executor: Executor | None = None

    def _pool(self) -> Executor:
        if self._executor is None:
            if self.kind == "thread":
                self._executor = ThreadPoolExecutor(self.workers, thread_name_prefix="titan-data")
            else:
                self._executor = ProcessPoolExecutor(
                    self.workers,
                    mp_context=multiprocessing.get_context("spawn"),
                    initializer=self._initializer,
                    initargs=self._initargs,
                )
        return self._executor

    def run(self, tasks: Iterable[T]) -> Iterator[tuple[T, Any]]:
        if self.workers == 0:
            for task in tasks:
                yield task, self.compute(task)
            return
        pool = self._pool()
        pending: deque[tuple[T, Future]] = deque()
        try:
            for task in tasks:
                pending.append((task, pool.submit(self.compute, task)))
                if len(pending) >= self.depth:
                    done, future = pending.popleft()
                    yield done, future.result()
            while pending:
                done, future = pending.popleft()
                yield done, future.result()
        finally:
            for _, future in pending:
                future.cancel()

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
