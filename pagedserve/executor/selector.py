"""Which executor runs an engine's ranks (distributed_executor_backend): the one place that chooses."""

from __future__ import annotations

from pagedserve.config import EngineConfig
from pagedserve.executor.abstract import Executor


def executor_class(config: EngineConfig) -> type[Executor]:
    backend = config.executor_backend
    if backend == "ray":
        from pagedserve.executor.ray_executor import RayExecutor

        return RayExecutor
    if backend == "mp":
        from pagedserve.executor.multiproc_executor import MultiprocExecutor

        return MultiprocExecutor
    from pagedserve.executor.uniproc_executor import UniprocExecutor

    return UniprocExecutor
