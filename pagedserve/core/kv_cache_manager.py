"""KV cache manager: which blocks each request owns, prefix-cache lookups, and allocation per step."""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.core.block_pool import BlockHash, BlockPool, KVCacheBlock, hash_block
from pagedserve.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of which found in the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.req_to_block_hashes: dict[str, list[BlockHash]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # per request: how many leading blocks are hashed
        # Per request: the tokens its blocks hold. An allocation within them is a no-op, which the scheduler's decode
        # path reads here instead of calling.
        self.slot_capacity: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    def usage(self) -> float:
        return self.block_pool.usage()

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest run of cached full blocks that starts the request's tokens (no references taken)."""
        if not self.enable_caching or request.skips_prefix_cache:
            return [], 0
        block_hashes = self._block_hashes(request)
        # The last token is always recomputed: its logits are needed to sample.
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        computed: list[KVCacheBlock] = []
        for block_hash in block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            computed.append(block)
        num_computed_tokens = len(computed) * self.block_size
        self.prefix_cache_stats.queries += request.num_tokens
        self.prefix_cache_stats.hits += num_computed_tokens
        return computed, num_computed_tokens

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: list[KVCacheBlock] | None = None,
        num_lookahead_tokens: int = 0, cache_prompt_blocks: bool = True,
    ) -> list[KVCacheBlock] | None:
        """Make room for num_new_tokens more tokens after the computed ones, and num_lookahead_tokens more slots
        beyond them (a draft model's proposals write there). None if the pool can't. cache_prompt_blocks=False: the
        new tokens' KV is not in place before the step's forward pass (it arrives from outside later), so their
        blocks are not offered to other requests yet."""
        request_id, block_size, block_pool = request.request_id, self.block_size, self.block_pool
        if not new_computed_blocks:
            num_computed_tokens = request.num_computed_tokens
            num_slots, capacity = num_computed_tokens + num_new_tokens + num_lookahead_tokens, self.slot_capacity.get(request_id, -1)
            if num_slots <= capacity:
                return []
            if capacity >= 0 and num_computed_tokens >= request.num_prompt_tokens:
                # A running request past its prompt that outgrew its blocks (a decode crossing into a new block, nearly
                # always): only new blocks, none of them for the prefix cache yet.
                num_new_blocks = cdiv(num_slots - capacity, block_size)
                if num_new_blocks > block_pool.num_free_blocks:
                    return None
                new_blocks = block_pool.get_new_blocks(num_new_blocks)
                self.req_to_blocks[request_id].extend(new_blocks)
                self.slot_capacity[request_id] = capacity + num_new_blocks * block_size
                return new_blocks
            new_computed_blocks = []
        req_blocks = self.req_to_blocks.get(request_id)
        if req_blocks is None:
            req_blocks = self.req_to_blocks[request_id] = []
        num_computed_tokens = request.num_computed_tokens + len(new_computed_blocks) * block_size
        num_required_blocks = cdiv(num_computed_tokens + num_new_tokens + num_lookahead_tokens, block_size)
        num_new_blocks = num_required_blocks - len(req_blocks) - len(new_computed_blocks)
        # Cached blocks sitting in the free queue stop being free once touched.
        num_evictable_computed = sum(1 for block in new_computed_blocks if block.ref_cnt == 0) if new_computed_blocks else 0
        if num_new_blocks > block_pool.num_free_blocks - num_evictable_computed:
            if not req_blocks:
                del self.req_to_blocks[request_id]
            return None
        if new_computed_blocks:  # a prefix-cache hit (a decode that outgrew its blocks has none)
            block_pool.touch(new_computed_blocks)
            req_blocks.extend(new_computed_blocks)
        new_blocks = block_pool.get_new_blocks(max(num_new_blocks, 0))
        req_blocks.extend(new_blocks)
        # Blocks of the prompt are cached as they are computed: other requests may share them at once (a system
        # prompt, the other samples of the request). Blocks of generated tokens are cached when the request is freed.
        if (num_computed_tokens < request.num_prompt_tokens and cache_prompt_blocks and self.enable_caching
                and not request.skips_prefix_cache):
            self.cache_full_blocks(request, num_computed_tokens + num_new_tokens)
        self.slot_capacity[request_id] = len(req_blocks) * block_size
        return new_blocks

    def trim(self, request: Request) -> None:
        """Give back the request's trailing blocks that hold none of its known tokens (rejected drafts used them)."""
        blocks = self.req_to_blocks.get(request.request_id)
        keep = cdiv(request.num_tokens, self.block_size)
        if blocks is not None and len(blocks) > keep:
            self.block_pool.free_blocks(reversed(blocks[keep:]))
            del blocks[keep:]
            self.slot_capacity[request.request_id] = keep * self.block_size

    def free(self, request: Request) -> None:
        """Give back the request's blocks, those full of its computed tokens cached first (those its decodes filled are
        cached only now)."""
        self.free_blocks(self.detach(request))

    def detach(self, request: Request) -> list[KVCacheBlock]:
        """Take the request's blocks from it, still allocated, its full computed blocks cached first (free gives them
        back at once; a KV connector's remote reader reads them until free_blocks does)."""
        if request.request_id in self.req_to_blocks and self.enable_caching and not request.skips_prefix_cache:
            self.cache_full_blocks(request, request.num_computed_tokens)
        self.num_cached_blocks.pop(request.request_id, None)
        self.slot_capacity.pop(request.request_id, None)
        if request.is_finished:
            self.req_to_block_hashes.pop(request.request_id, None)
        return self.req_to_blocks.pop(request.request_id, [])

    def free_blocks(self, blocks: list[KVCacheBlock]) -> None:
        self.block_pool.free_blocks(reversed(blocks))

    def block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, [])]

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def _block_hashes(self, request: Request) -> list[BlockHash]:
        """Hashes of the request's full blocks of known tokens, extended as tokens arrive."""
        hashes = self.req_to_block_hashes.setdefault(request.request_id, [])
        num_full_blocks = request.num_tokens // self.block_size
        tokens = request.all_token_ids
        extra_keys = (request.lora_id,) if request.lora_id else None  # every block: two chains never alias
        for index in range(len(hashes), num_full_blocks):
            parent = hashes[-1] if hashes else None
            start = index * self.block_size
            hashes.append(hash_block(parent, tuple(tokens[start:start + self.block_size]), extra_keys))
        return hashes

    def cache_full_blocks(self, request: Request, num_tokens_after_step: int) -> None:
        # Only blocks full of known tokens: a step's draft tokens are not known until verified.
        num_full_blocks = min(num_tokens_after_step, request.num_tokens) // self.block_size
        num_cached = self.num_cached_blocks.get(request.request_id, 0)
        if num_full_blocks <= num_cached:
            return
        block_hashes = self._block_hashes(request)
        blocks = self.req_to_blocks[request.request_id]
        for index in range(num_cached, num_full_blocks):
            self.block_pool.cache_full_block(blocks[index], block_hashes[index])
        self.num_cached_blocks[request.request_id] = num_full_blocks
