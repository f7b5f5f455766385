"""Each side's connector, built from EngineConfig.kv_transfer."""

from __future__ import annotations

from pagedserve.config import EngineConfig
from pagedserve.kv_transfer.base import KVConnectorScheduler, KVConnectorWorker
from pagedserve.kv_transfer.p2p import P2pScheduler, P2pWorker
from pagedserve.kv_transfer.shared_storage import SharedStorageScheduler, SharedStorageWorker, rank_tag


def scheduler_connector(config: EngineConfig) -> KVConnectorScheduler | None:
    if config.kv_transfer is None:
        return None
    if config.kv_transfer.kv_connector == "P2pConnector":
        return P2pScheduler(config)
    return SharedStorageScheduler(config)


def worker_connector(config: EngineConfig, tp_rank: int, pp_rank: int) -> KVConnectorWorker | None:
    """For the rank at tp_rank, pp_rank: its place among the ranks that hold parts of a block."""
    if config.kv_transfer is None:
        return None
    if config.kv_transfer.kv_connector == "P2pConnector":
        return P2pWorker(config, pp_rank * config.tensor_parallel_size + tp_rank)
    return SharedStorageWorker(config, rank_tag(tp_rank, pp_rank))
