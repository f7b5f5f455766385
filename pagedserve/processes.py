"""Helpers for the engine's own processes (the engine core, the ranks of a multi-process executor)."""

from __future__ import annotations

import os
import threading
import time


def exit_with_parent(parent_pid: int) -> None:
    """No orphans: a process whose parent is gone (killed before it could shut its children down) exits too."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()
