"""The executor of a tensor- and pipeline-parallel engine whose ranks run as Ray actors: on the cluster
that RAY_ADDRESS names (`ray start --head` on one machine, `ray start --address ...` on the others), or
on a local one it starts. The actors are placed in a placement group, one bundle a rank, and run the
same WorkerProcess as the mp backend; torch.distributed connects them (gloo on CPU, NCCL on CUDA),
meeting at the first rank's node. Ray carries each step's scheduler output to every rank.
"""

from __future__ import annotations

import logging
import os
from collections import deque

from pagedserve.config import EngineConfig
from pagedserve.core.contracts import ModelRunnerOutput, SchedulerOutput
from pagedserve.executor.abstract import WorkerCall
from pagedserve.executor.distributed import DistributedExecutor, WorkerDiedError

logger = logging.getLogger(__name__)

_STARTUP_TIMEOUT_S = 900.0


def _ray():
    try:
        import ray
    except ImportError as exc:
        raise ValueError("distributed_executor_backend 'ray' needs Ray: pip install -e \".[ray]\"") from exc
    return ray


class RayWorker:
    """A rank as a Ray actor (made remote in RayExecutor, so that importing this module needs no Ray)."""

    def rendezvous(self) -> str:
        """Where torch.distributed's ranks meet: this node's address and a free port."""
        import ray

        from pagedserve.ports import free_port

        return f"tcp://{ray.util.get_node_ip_address()}:{free_port()}"

    def start(self, config: EngineConfig, info, init_method: str) -> None:
        from pagedserve.executor.distributed import WorkerProcess

        self.process = WorkerProcess(config, info, init_method)

    def step(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        output = self.process.step(scheduler_output)
        return output if self.process.rank.is_output_rank else None  # only one rank's output travels back

    def call(self, method: WorkerCall, args) -> object:
        return self.process.call(method, args)


class RayExecutor(DistributedExecutor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        ray = _ray()
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._ray = ray
        self._started_ray = not ray.is_initialized()
        if self._started_ray:
            ray.init(address=os.environ.get("RAY_ADDRESS"), ignore_reinit_error=True, log_to_driver=False)
        world = len(self.infos)
        cpus_per_rank = max(0.1, min(1.0, ray.cluster_resources().get("CPU", 1.0) / world))
        self._group = placement_group([{"CPU": cpus_per_rank}] * world, strategy="PACK")
        self._remove_group = remove_placement_group
        try:
            ray.get(self._group.ready(), timeout=_STARTUP_TIMEOUT_S)
            actor_class = ray.remote(RayWorker)
            self.actors = [
                actor_class.options(num_cpus=cpus_per_rank, scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self._group, placement_group_bundle_index=rank)).remote()
                for rank in range(world)
            ]
            init_method = ray.get(self.actors[0].rendezvous.remote())
            ray.get([actor.start.remote(config, info, init_method) for actor, info in zip(self.actors, self.infos)],
                    timeout=_STARTUP_TIMEOUT_S)
        except BaseException:
            self.shutdown()
            raise
        self._pending: deque[list] = deque()
        logger.info("%d Ray workers ready (tensor parallel %d x pipeline parallel %d)", world, config.tensor_parallel_size,
                    config.pipeline_parallel_size)

    def submit_step(self, scheduler_output: SchedulerOutput) -> None:
        self._pending.append([actor.step.remote(scheduler_output) for actor in self.actors])

    def wait_step(self) -> ModelRunnerOutput:
        return self._get(self._pending.popleft())[self.output_rank]

    def collective_rpc(self, method: WorkerCall, *args) -> list:
        return self._get([actor.call.remote(method, args) for actor in self.actors])

    def check_health(self) -> None:
        self._get([actor.call.remote("model_info", ()) for actor in self.actors])

    def _get(self, refs: list) -> list:
        try:
            return self._ray.get(refs)
        except self._ray.exceptions.RayActorError as exc:
            raise WorkerDiedError(f"a Ray worker died: {exc}") from exc

    def shutdown(self) -> None:
        for actor in getattr(self, "actors", []):
            self._ray.kill(actor)
        self.actors = []
        if getattr(self, "_group", None) is not None:
            self._remove_group(self._group)
            self._group = None
        if self._started_ray and self._ray.is_initialized():
            self._ray.shutdown()
