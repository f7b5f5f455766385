"""The connector interface, each side's methods as vLLM V1 names them. The workers' side loads before the forward
pass and saves after it; a connector that moves KV while the layers run (vLLM's wait_for_layer_load and save_kv_layer)
adds per-layer calls to this seam."""

from __future__ import annotations

from abc import ABC, abstractmethod

from pagedserve.core.contracts import KVConnectorMetadata, SchedulerOutput
from pagedserve.request import Request


class KVConnectorScheduler(ABC):
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
