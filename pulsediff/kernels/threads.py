"""The CPU worker threads: how many, and a parallel map over chunks.

Why not Numba's own `parallel=True` threading layer: under load its OpenMP
threads spin at every barrier and each parallel region waits for its slowest,
statically assigned thread. Measured on the 2-core machine with two competing
CPU-bound processes, `make` of a 45 MB pair took 8x its idle time with 2
OpenMP threads and 1x with one (issue 13). GNU OpenMP is also not fork-safe
once a kernel has run, and the workqueue layer is not safe to enter from two
threads at once.

So the kernels are serial `@njit(nogil=True)` functions over a range of a
tensor, and parallelism comes from plain Python threads that call them with
the GIL released: a shared queue of chunks (dynamic scheduling: a thread the
OS descheduled simply takes fewer chunks), idle threads asleep on a condition
variable (no spinning), a fresh pool after a fork. Chunks are millions of
elements, so the ~20 microseconds a task costs in Python is noise.

PULSEDIFF_THREADS sets the thread count (default: the CPUs this process may
run on).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Callable, Sequence, TypeVar

T = TypeVar("T")

_pool: tuple[int, ThreadPoolExecutor] | None = None
_decode_pool: tuple[int, int, ThreadPoolExecutor] | None = None
_lock = threading.Lock()
_inside = threading.local()  # set in pool threads: a nested map runs inline instead of waiting on itself


def _after_fork_in_child() -> None:
    # The child has none of the parent's threads: a lock another thread held at the
    # fork would stay held forever, and the pool's workers are gone.
    global _pool, _decode_pool, _lock
    _lock = threading.Lock()
    _pool = _decode_pool = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def num_threads() -> int:
    """Worker threads: PULSEDIFF_THREADS, else the CPUs this process may run on."""
    value = os.environ.get("PULSEDIFF_THREADS", "").strip()
    if value:
        try:
            n = int(value)
        except ValueError:
            n = 0
        if n >= 1:
            return min(n, 256)
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def decode_pool(workers: int) -> ThreadPoolExecutor:
    """A second pool of `workers` threads, for work that runs ahead of what the main pool does
    (the entropy decode of the sections after the one being placed, ops/live.py), kept for the
    process: a pool made per apply cost a few milliseconds of thread starts each time."""
    global _decode_pool
    with _lock:
        if _decode_pool is None or _decode_pool[:2] != (os.getpid(), workers):
            _decode_pool = (os.getpid(), workers, ThreadPoolExecutor(max_workers=workers,
                                                                     thread_name_prefix="pulsediff-decode"))
        return _decode_pool[2]


def _mark_inside() -> None:
    _inside.active = True


def pool() -> ThreadPoolExecutor:
    """The process's worker pool (made again in a forked child, which inherits no threads)."""
    global _pool
    with _lock:
        if _pool is None or _pool[0] != os.getpid():
            _pool = (os.getpid(), ThreadPoolExecutor(max_workers=num_threads(), thread_name_prefix="pulsediff",
                                                     initializer=_mark_inside))
        return _pool[1]


class inline:
    """`with inline():` runs this thread's parallel_maps inline, on this thread alone: for a
    caller that already runs side by side with others on as many threads as there are cores
    (make's encoders, each on its own small tensor), where handing the ranges to the pool
    only queues them behind other tensors' ranges."""

    def __enter__(self) -> None:
        self._was = getattr(_inside, "active", False)
        _inside.active = True

    def __exit__(self, *exc) -> None:
        _inside.active = self._was


def serial() -> bool:
    """Whether parallel_map runs inline here: on a worker thread, inside `inline()`, or with one
    thread. A kernel may then choose a one-thread algorithm over its range-parallel one."""
    return bool(getattr(_inside, "active", False)) or num_threads() == 1


def parallel_map(fn: Callable[..., T], items: Sequence) -> list[T]:
    """[fn(*item) for item in items], run on the worker threads; results in order.

    Runs inline when there is one item, one thread, or when called from a
    worker thread (waiting on the same pool from inside it could deadlock).
    The first exception is raised once every task has finished, so no task is
    still writing into the caller's buffers when it returns.
    """
    if len(items) <= 1 or serial():
        return [fn(*item) for item in items]
    futures = [pool().submit(fn, *item) for item in items]
    try:
        return [future.result() for future in futures]
    finally:
        # Even when a task failed or Ctrl-C interrupted the wait: tasks write into the
        # caller's buffers, so none may still run once this returns or raises.
        wait(futures)


class Turns:
    """Lets tasks that run side by side each do one step in their index order: task c's step
    runs once task c-1's has (e.g. feeding a sequential hash with ranges other threads read).

    Safe with parallel_map: the pool's queue is first in, first out, so its tasks start in
    index order and the lowest unfinished one is always running, never waiting. Every task
    must take its turn, even one that failed, or those after it wait forever; a failed step
    still passes the turn on.
    """

    def __init__(self) -> None:
        self._next = 0
        self._cond = threading.Condition()

    def take(self, index: int, step: Callable[[], object] | None) -> None:
        """Runs `step` (None: nothing, the turn only passes on) once every lower index has."""
        with self._cond:
            self._cond.wait_for(lambda: self._next == index)
        try:
            if step is not None:
                step()
        finally:
            with self._cond:
                self._next = index + 1
                self._cond.notify_all()
