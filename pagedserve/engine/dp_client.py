"""Data parallelism: N engine cores, each with its own scheduler and KV cache, behind one front end.

Each request goes to the core with the least load (running + waiting, as of its last step, plus
what was sent to it since), except that requests starting with the same prompt block stay on the
core that saw that block first while it is not much busier than the least loaded, so the prefix cache
keeps hitting. All samples of a request go to one core (they share the prompt's blocks). Aborts go
to the core that holds the request. Any core's death is the engine's.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import OrderedDict

from pagedserve.config import DataParallelPlace, EngineConfig
from pagedserve.engine.core_client import AsyncMPClient, EngineCoreClient
from pagedserve.engine.wire import EngineCoreOutputs, EngineCoreRequest
from pagedserve.executor.cpu_host import threads_per_rank

# Prompts are grouped by their first this-many tokens (a KV block at the default size).
AFFINITY_TOKENS = 16
# A core keeps its prefix's requests unless it carries this many more than the least loaded core.
AFFINITY_SLACK = 8
_AFFINITY_ENTRIES = 65536


# Where the cores' processes meet (expert parallelism over them): this machine's loopback.
_STORE_HOST = "127.0.0.1"


def _group_store():
    """A torch.distributed store on a free port, served by this process for as long as the cores run."""
    import torch.distributed as dist

    return dist.TCPStore(_STORE_HOST, 0, is_master=True, wait_for_workers=False)


class DPAsyncMPClient(EngineCoreClient):
    def __init__(self, config: EngineConfig, while_starting=None, on_model_located=None) -> None:
        size = config.data_parallel_size
        # Each core's ranks get their share of the machine's threads, as the one rule for all ranks says.
        # Each core would pin its threads to the same first CPUs, not knowing which the others took: the OS places them.
        per_core = dataclasses.replace(config, data_parallel_size=1, num_threads=threads_per_rank(config), pin_threads=False)
        self.clients: list[AsyncMPClient] = []
        # Expert parallelism over the cores: their processes meet at a store this process holds to form their groups.
        self._store = _group_store() if config.enable_expert_parallel else None
        try:
            for rank in range(size):  # all start at once; then each is waited for
                place = None if self._store is None else DataParallelPlace(rank, size, f"{_STORE_HOST}:{self._store.port}")
                self.clients.append(AsyncMPClient(dataclasses.replace(per_core, data_parallel_place=place), wait=False))
            self.clients[0].wait_ready(while_starting, on_model_located)
            for client in self.clients[1:]:
                client.wait_ready()
        except BaseException:
            self.shutdown()
            raise
        self.model_info = self.clients[0].model_info
        self.load_at_last_step = [0] * size  # running + waiting, from each core's stats
        self.sent_since_step = [0] * size
        self.core_of: dict[str, int] = {}  # engine request id -> its core
        self.prefix_core: OrderedDict[tuple[int, ...], int] = OrderedDict()
        self._outputs: dict[int, asyncio.Task] = {}

    def choose_core(self, prompt_token_ids: list[int]) -> int:
        loads = [at_step + sent for at_step, sent in zip(self.load_at_last_step, self.sent_since_step)]
        least = min(range(len(loads)), key=loads.__getitem__)
        if len(prompt_token_ids) < AFFINITY_TOKENS:
            return least
        key = tuple(prompt_token_ids[:AFFINITY_TOKENS])
        core = self.prefix_core.get(key)
        if core is None or loads[core] > loads[least] + AFFINITY_SLACK:
            core = least
        self.prefix_core[key] = core
        self.prefix_core.move_to_end(key)
        if len(self.prefix_core) > _AFFINITY_ENTRIES:
            self.prefix_core.popitem(last=False)
        return core

    async def add_requests_async(self, requests: list[EngineCoreRequest]) -> None:
        core = self.choose_core(requests[0].prompt_token_ids)
        for request in requests:
            self.core_of[request.request_id] = core
        self.sent_since_step[core] += len(requests)
        await self.clients[core].add_requests_async(requests)
        if self._store is not None:  # cores that step together: the others start stepping now, not at their next meeting
            for other, client in enumerate(self.clients):
                if other != core:
                    await client.wake_async()

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        by_core: dict[int, list[str]] = {}
        for request_id in request_ids:
            core = self.core_of.pop(request_id, None)
            if core is not None:
                by_core.setdefault(core, []).append(request_id)
        for core, ids in by_core.items():
            await self.clients[core].abort_requests_async(ids)

    async def get_output_async(self) -> EngineCoreOutputs:
        """The next step's outputs of whichever core finishes one first, tagged with its engine index."""
        for index, client in enumerate(self.clients):
            if index not in self._outputs:
                self._outputs[index] = asyncio.ensure_future(client.get_output_async())
        done, _ = await asyncio.wait(self._outputs.values(), return_when=asyncio.FIRST_COMPLETED)
        index = next(i for i, task in self._outputs.items() if task in done)
        outputs = self._outputs.pop(index).result()  # raises EngineDeadError if that core died
        outputs.engine_index = index
        if outputs.scheduler_stats is not None:
            self.load_at_last_step[index] = outputs.scheduler_stats.num_running + outputs.scheduler_stats.num_waiting
            self.sent_since_step[index] = 0
        for output in outputs.outputs:
            if output.finished:
                self.core_of.pop(output.request_id, None)
        return outputs

    async def call_utility_async(self, method: str, *args):
        """On every core; the first core's result."""
        return (await self.call_utility_on_each_async(method, *args))[0]

    async def call_utility_on_each_async(self, method: str, *args) -> list:
        return list(await asyncio.gather(*(client.call_utility_async(method, *args) for client in self.clients)))

    def is_alive(self) -> bool:
        return all(client.is_alive() for client in self.clients)

    def shutdown(self) -> None:
        for task in self._outputs.values() if hasattr(self, "_outputs") else ():
            task.cancel()
        for client in self.clients:
            client.shutdown()

