"""How pagedserve's processes log: one format, the level from PAGEDSERVE_LOG_LEVEL."""

from __future__ import annotations

import logging

from pagedserve import envs

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure(fmt: str = FORMAT, force: bool = False) -> None:
    """For a process pagedserve runs (the CLI, the engine core, a worker, set-up): the root logger."""
    logging.basicConfig(level=envs.log_level(), format=fmt, force=force)


def configure_library() -> None:
    """For pagedserve used as a library (the offline LLM): its own loggers say what the engine does, as the server's
    do, unless the program has configured logging itself."""
    library = logging.getLogger("pagedserve")
    if logging.getLogger().handlers or library.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(FORMAT))
    library.addHandler(handler)
    library.setLevel(envs.log_level())
    library.propagate = False
