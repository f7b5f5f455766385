"""Each side's connector, built from EngineConfig.kv_transfer."""

from __future__ import annotations

from pagedserve.config import EngineConfig
from pagedserve.kv_transfer.base import KVConnectorScheduler, KVConnectorWorker
from pagedserve.kv_transfer.shared_storage import SharedStorageScheduler, SharedStorageWorker


def scheduler_connector(config: EngineConfig) -> KVConnectorScheduler | None:
    if config.kv_transfer is None:
        return None
    return SharedStorageScheduler(config)


def worker_connector(config: EngineConfig, rank_tag: str) -> KVConnectorWorker | None:
    """rank_tag: this rank's place among the ranks that hold parts of a block (tensor-parallel and pipeline rank)."""
    if config.kv_transfer is None:
        return None
    return SharedStorageWorker(config, rank_tag)
