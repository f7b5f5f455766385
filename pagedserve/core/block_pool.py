"""KV cache blocks: ref counts, an LRU queue of free blocks, and the hash -> cached block map."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple


class BlockHash(NamedTuple):
    """Chained hash of a full block. Token ids ride along so a 64-bit collision cannot alias two blocks."""

    hash_value: int
    token_ids: tuple[int, ...]
    extra_keys: tuple | None = None


def hash_block(parent: BlockHash | None, token_ids: tuple[int, ...], extra_keys: tuple | None = None) -> BlockHash:
    parent_value = parent.hash_value if parent is not None else None
    return BlockHash(hash((parent_value, token_ids, extra_keys)), token_ids, extra_keys)


@dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None  # set once the block is full and cached


class BlockPool:
    """Owns every block. A block is either referenced (ref_cnt > 0) or in the free queue, never both.

    Freed blocks keep their hash and stay findable until they are handed out again, oldest first
    (the free queue is the LRU order of eviction).
    """

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached_blocks: dict[BlockHash, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_blocks.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"cannot get {num_blocks} blocks: only {self.num_free_blocks} free")
        new_blocks = []
        pop_oldest = self.free_queue.popitem
        for _ in range(num_blocks):
            _, block = pop_oldest(last=False)
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            new_blocks.append(block)
        return new_blocks

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Take a reference on cached blocks found by a prefix lookup."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks) -> None:
        """Drop one reference each; blocks that reach zero join the free queue in the given order,
        so callers pass tails first to have them evicted before the prefixes others may share."""
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = block

    def cache_full_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        if block.block_hash is not None:
            return
        if block_hash in self.cached_blocks:
            # Same content computed twice (e.g. two requests prefilled together): keep the first one findable.
            return
        block.block_hash = block_hash
        self.cached_blocks[block_hash] = block

    def reset_prefix_cache(self) -> bool:
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_blocks.clear()
        return True

    def _evict(self, block: KVCacheBlock) -> None:
        """Forget a cached block's hash (the block is about to hold other tokens)."""
        if self.cached_blocks.get(block.block_hash) is block:
            del self.cached_blocks[block.block_hash]
        block.block_hash = None
