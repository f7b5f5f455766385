"""The scheduler's part in moving KV between instances (a KV connector that loads while the engine runs): requests
whose prompt KV is on its way, and blocks held for another instance to read.

A request whose KV loads asynchronously is admitted with blocks for all of it, which are not offered to the prefix
cache yet, and waits here (WAITING_FOR_REMOTE_KVS) while other requests run. When its load ends the request goes
back to the head of the waiting queue: with its KV in place (all of its prompt computed but the last token, whose
logits give its first output; a preempted request that comes back loads its prompt and computes its output tokens
again), or, if the load failed, to compute its prompt itself (kv_load_failure_policy "recompute") or to end ("fail").
Its blocks are never given back while a load may still write them: an aborted request's blocks wait for its load to
end.

A finished request the connector holds (for a decode instance to read) gives its blocks here, still allocated, until
the connector says nobody needs them any more.
"""

from __future__ import annotations

import logging

from pagedserve.core.block_pool import KVCacheBlock
from pagedserve.core.contracts import EngineCoreOutput
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.request import Request, RequestStatus

logger = logging.getLogger(__name__)


class RemoteKV:
    def __init__(self, kv_cache_manager: KVCacheManager, connector, failure_policy: str) -> None:
        self.kv_cache_manager = kv_cache_manager
        self.connector = connector
        self.failure_policy = failure_policy
        self.loading: dict[str, Request] = {}
        # Tokens a loading request has in place once its load ends: its local hit and what loads. A preempted request
        # that comes back loads its prompt only; its output tokens are computed again.
        self.loaded_upto: dict[str, int] = {}
        self.held: dict[str, list[KVCacheBlock]] = {}

    def admit(self, request: Request, computed_blocks: list, num_local_tokens: int, num_external_tokens: int) -> bool:
        """Allocate the request's blocks for its local hit and the tokens to load, and let it wait for them; False if
        the cache has no room."""
        kv = self.kv_cache_manager
        if kv.allocate_slots(request, num_external_tokens, computed_blocks, cache_prompt_blocks=False) is None:
            return False
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_local_tokens
        request.num_computed_tokens = num_local_tokens
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.loading[request.request_id] = request
        self.loaded_upto[request.request_id] = num_local_tokens + num_external_tokens
        self.connector.update_state_after_alloc(request, kv.block_ids(request.request_id), num_external_tokens)
        return True

    def take_news(self) -> tuple[list[Request], list[Request]]:
        """Give back held blocks nobody reads any more; settle loads that ended. Returns (requests to schedule again,
        requests that end because their load failed under the "fail" policy)."""
        for request_id in self.connector.take_released_holds():
            blocks = self.held.pop(request_id, None)
            if blocks is not None:
                self.kv_cache_manager.free_blocks(blocks)
        ready, failed = [], []
        for request_id, ok in self.connector.take_finished_loads():
            request = self.loading.pop(request_id, None)
            if request is None:
                continue
            loaded_upto = self.loaded_upto.pop(request_id)
            if request.is_finished:  # aborted while its KV arrived: its blocks could not be given back before
                self.kv_cache_manager.free(request)
            elif ok:
                # Its KV is in place: the last known token is computed again for the logits of the next output.
                request.num_computed_tokens = min(loaded_upto, request.num_tokens - 1)
                self.kv_cache_manager.cache_full_blocks(request, request.num_computed_tokens)
                request.status = RequestStatus.WAITING
                ready.append(request)
            else:
                self.kv_cache_manager.free(request)
                request.num_computed_tokens = 0
                if self.failure_policy == "fail":
                    failed.append(request)
                else:
                    request.status = RequestStatus.WAITING
                    ready.append(request)
        return ready, failed

    def holds_blocks(self, request: Request) -> bool:
        """Whether the request already has its blocks, its KV loaded from outside (admit it without a lookup)."""
        return request.status == RequestStatus.WAITING and request.request_id in self.kv_cache_manager.req_to_blocks

    def free(self, request: Request, hold: bool) -> None:
        """A finished request's blocks: held for a remote reader, left to its load, or given back."""
        if hold:
            stale = self.held.pop(request.request_id, None)  # the same id held before: that hold was replaced
            if stale is not None:
                self.kv_cache_manager.free_blocks(stale)
            self.held[request.request_id] = self.kv_cache_manager.detach(request)
        elif request.request_id not in self.loading:
            self.kv_cache_manager.free(request)

    def failed_output(self, request: Request) -> EngineCoreOutput:
        logger.error("request %s ended: its prompt's KV could not be loaded (kv_load_failure_policy fail)", request.request_id)
        return EngineCoreOutput(request.request_id, [], finish_reason=RequestStatus.FINISHED_ABORTED.finish_reason)
