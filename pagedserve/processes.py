"""Helpers for the engine's own processes (the engine core, the ranks of a multi-process executor)."""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import sys
import threading
import time

from pagedserve import envs

# The exit code of a spawned child that found itself re-running its parent's program (exit_if_reimporting_main).
UNGUARDED_MAIN_EXIT_CODE = 87
UNGUARDED_MAIN_MESSAGE = (
    "pagedserve's worker processes start by spawn here ({reason}), and spawn runs this program's main module again in each "
    "of them, which started another engine. Put the code that creates the engine under `if __name__ == \"__main__\":` "
    "in the script you run."
)


# Whether pagedserve started this process to run an engine (the engine core, a rank), rather than it being the caller's.
_engine_process = False


def mark_engine_process() -> None:
    """Say that this process is one pagedserve started for an engine: it may set process-wide things (threads pinned to
    CPUs) that it must not impose on a program that runs an engine inside its own process."""
    global _engine_process
    _engine_process = True


def is_engine_process() -> bool:
    return _engine_process


def describe_exit(process) -> str:
    """How a child process (multiprocessing's) ended, as a message says it: "exit code 1", "killed by SIGKILL"."""
    process.join(1.0)  # its sentinel has fired: reap it, so that its exit code is known
    code = process.exitcode
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def freeze_start_up_objects() -> None:
    """Take what the process made to start (modules, a model, the KV cache's blocks, a web app) out of the garbage
    collector's sight. It lives as long as the process, and a full collection that walks all of it stalls whatever
    runs then (an engine step, a stream's next token) for a long while; objects made later are collected as usual."""
    gc.collect()
    gc.freeze()


def exit_process(code: int) -> None:
    """End this process at once, without the interpreter's teardown (torch's, the kernels', torch.distributed's: slow,
    and nothing is left to flush), but releasing first what outlives a process: the named semaphores that
    multiprocessing made here (tqdm's lock, for one, once a progress bar ran), which the parent's resource tracker
    would otherwise report as leaked when the server or LLM exits."""
    from multiprocessing import util

    util._run_finalizers()  # what a normal exit runs for multiprocessing: each semaphore unlinked once
    os._exit(code)


def exit_with_parent(parent_pid: int) -> None:
    """No orphans: a process whose parent is gone (killed before it could shut its children down) exits too."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def exit_if_reimporting_main() -> None:
    """In a child started by spawn, while it imports its parent's main module to begin: an engine started there means
    the parent's script has no `if __name__ == "__main__":` guard. Exit at once with UNGUARDED_MAIN_EXIT_CODE, so
    that the parent can say what to add (instead of Python's bootstrapping traceback and a dead worker)."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        os._exit(UNGUARDED_MAIN_EXIT_CODE)


def child_start_method() -> tuple[str, str]:
    """(how to start a child process of this one, why). fork where it is safe: on Linux, with no accelerator
    initialised and no thread pool of native threads running (OpenMP's, once a parallel region ran, or a ZMQ
    context's): a forked child inherits such a pool without its threads and hangs on its first use. spawn otherwise,
    or as PAGEDSERVE_WORKER_MULTIPROC_METHOD says."""
    chosen = envs.worker_multiproc_method()
    if chosen is not None:
        return chosen, f"{envs.PAGEDSERVE_WORKER_MULTIPROC_METHOD}={chosen}"
    if sys.platform != "linux":
        return "spawn", f"fork is not safe on {sys.platform}"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "spawn", "CUDA is initialised in this process"
    if _native_threads() > threading.active_count() + (1 if torch is not None else 0):  # torch's import starts one
        return "spawn", "native threads (OpenMP, ZMQ) already run in this process"
    return "fork", "fork is safe here"


def _native_threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return sys.maxsize  # unknown: assume the worst
