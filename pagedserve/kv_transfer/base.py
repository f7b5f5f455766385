"""The connector interface, each side's methods as vLLM V1 names them. The workers' side loads before the forward
pass and saves after it; a connector that moves KV while the layers run (vLLM's wait_for_layer_load and save_kv_layer)
adds per-layer calls to this seam.

A connector that moves KV between instances while the engines run (P2pConnector) also has news between steps, which
the scheduler takes before it plans one: loads that ended (a request waiting for its KV may run, or must compute it),
and held blocks nobody reads any more (given back to the pool). Its sockets wake an idle engine core when news
arrives."""

from __future__ import annotations

from abc import ABC, abstractmethod

from pagedserve.config import KVTransferConfig
from pagedserve.core.contracts import KVConnectorMetadata, SchedulerOutput
from pagedserve.request import Request


class KVConnectorScheduler(ABC):
    transfer: KVTransferConfig
    # Prompt tokens whose KV the workers loaded from outside, and saved for others, since start.
    received_tokens: int = 0
    sent_tokens: int = 0

    @abstractmethod
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """(prompt tokens beyond the num_computed_tokens found locally that can be loaded from outside, or None to be
        asked again next step; whether they load asynchronously)."""

    @abstractmethod
    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        """The request got its blocks (all of them, in order); its num_external_tokens after the local hit load."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput, requests: dict[str, Request],
                             block_ids_of) -> KVConnectorMetadata:
        """What the workers load and save in this step (block_ids_of(request_id): the request's blocks)."""

    @abstractmethod
    def step_done(self, metadata: KVConnectorMetadata) -> None:
        """The workers ran the step metadata was built for (its loads and saves are done)."""

    @abstractmethod
    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        """(whether its blocks stay allocated for a remote reader, the kv_transfer_params returned to the client)."""

    def has_news(self) -> bool:
        """Whether loads ended or held blocks may be given back since the last take_* calls."""
        return False

    def take_finished_loads(self) -> list[tuple[str, bool]]:
        """(request id, whether its KV arrived whole) of each asynchronous load that ended."""
        return []

    def take_released_holds(self) -> list[str]:
        """The requests whose held blocks no remote reader needs any more (read, or their lease ran out)."""
        return []

    def wake_sockets(self) -> list:
        """ZMQ sockets whose messages are news: an idle engine core polls them with its input."""
        return []

    def stats(self) -> dict:
        """What it moved since start (SchedulerStats' kv_* fields)."""
        return {"kv_received_tokens": self.received_tokens, "kv_sent_tokens": self.sent_tokens}

    def close(self) -> None:
        """Stop listening (the engine is shutting down)."""
        return None


class KVConnectorWorker(ABC):
    @abstractmethod
    def register_kv_caches(self, kv_caches: list) -> None:
        """This rank's KV cache, one tensor per local layer: [2, blocks, block_size, heads, row width]."""

    @abstractmethod
    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        """Begin (or, synchronously, do) the step's loads, before the forward pass."""

    @abstractmethod
    def wait_for_save(self, metadata: KVConnectorMetadata) -> None:
        """Return once the step's saves are done, after the forward pass."""

    def close(self) -> None:
        """Stop serving and pulling (the worker is shutting down)."""
        return None
