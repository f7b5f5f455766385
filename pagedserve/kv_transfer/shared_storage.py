"""SharedStorageConnector: full blocks of prompt KV saved as files under a directory, named by their prefix (a SHA-256
chain over the prompt's tokens and the files of the LoRA adapter they ran under), and loaded by any engine of the same
model and layout that shares the directory: a prefix cache that survives restarts and is shared by replicas.

Layout: DIR/<layout>/<key[:2]>/<key>.<rank>. The layout names what makes two engines' blocks interchangeable (the
model, the KV cache's dtype, the block size, the parallel split); each rank writes its own share of a block (its heads,
its stage's layers). A file appears whole or not at all (written aside, then renamed), so two engines writing one block
at once leave one of their identical copies. With max_bytes the directory is bounded: the least recently used files go
first (a load refreshes a file's time), never one used within the last GRACE_S seconds. A block the scheduler
finds is pinned until its workers have read it: hard links under DIR/.pins/<engine>/, which keep the file's content
whatever another engine evicts meanwhile."""

from __future__ import annotations

import hashlib
import json
import os
import time
import uuid
from array import array
from pathlib import Path

from pagedserve.config import EngineConfig
from pagedserve.core.contracts import KVConnectorMetadata, SchedulerOutput
from pagedserve.kv_transfer.base import KVConnectorScheduler, KVConnectorWorker
from pagedserve.lora_request import CONFIG_FILE, WEIGHTS_FILE
from pagedserve.request import Request

GRACE_S = 60.0
# Pins of an engine that ended without removing them (killed) are removed by the next engine to start after this long.
_STALE_PINS_S = 3600.0
_KEEP_AFTER_EVICTION = 0.9  # of the budget: evicting down to it leaves room for a while of saves


def layout_dir(config: EngineConfig) -> Path:
    """The store's directory for blocks this engine can load: one per model and KV layout."""
    layout = {"model": config.model, "dtype": config.dtype, "kv_cache_dtype": config.kv_cache_dtype, "block_size": config.block_size,
              "tp": config.tensor_parallel_size, "pp": config.pipeline_parallel_size, "pp_layer_partition": config.pp_layer_partition}
    digest = hashlib.sha256(json.dumps(layout, sort_keys=True).encode()).hexdigest()[:16]
    return Path(config.kv_transfer.kv_connector_extra_config["shared_storage_path"]) / digest


def rank_tags(config: EngineConfig) -> list[str]:
    return [rank_tag(tp, pp) for pp in range(config.pipeline_parallel_size) for tp in range(config.tensor_parallel_size)]


def rank_tag(tp_rank: int, pp_rank: int) -> str:
    return f"tp{tp_rank}-pp{pp_rank}"


class BlockStore:
    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def path(self, key: str, tag: str) -> Path:
        return self.directory / key[:2] / f"{key}.{tag}"

    def has(self, key: str, tags: list[str]) -> bool:
        return all(self.path(key, tag).exists() for tag in tags)

    def write(self, key: str, tag: str, data: bytes) -> None:
        path = self.path(key, tag)
        path.parent.mkdir(parents=True, exist_ok=True)
        aside = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
        aside.write_bytes(data)
        os.replace(aside, path)

    def read(self, key: str, tag: str, directory: Path | None = None) -> bytes:
        """A block's bytes, from the store or (directory) where it was pinned."""
        path = self.path(key, tag) if directory is None else directory / f"{key}.{tag}"
        return path.read_bytes()

    def pin(self, key: str, tags: list[str], directory: Path) -> bool:
        """Hard-link the block's files into directory (and mark them used); False, linking nothing, when one is gone."""
        directory.mkdir(parents=True, exist_ok=True)
        linked = []
        try:
            for tag in tags:
                pinned = directory / f"{key}.{tag}"
                if not pinned.exists():
                    os.link(self.path(key, tag), pinned)
                    linked.append(pinned)
                os.utime(pinned)
        except FileNotFoundError:  # evicted since it was found
            for pinned in linked:
                pinned.unlink(missing_ok=True)
            return False
        return True

    def files(self, tag: str) -> list[tuple[float, int, Path]]:
        """(last use, bytes, path) of the tag's blocks."""
        found = []
        for path in self.directory.glob(f"*/*.{tag}"):
            try:
                info = path.stat()
            except FileNotFoundError:  # evicted by another engine meanwhile
                continue
            found.append((info.st_mtime, info.st_size, path))
        return found

    def evict(self, tag: str, budget: int) -> int:
        """Remove the tag's least recently used blocks (none used within GRACE_S) until they fit in a share of budget;
        returns the bytes left."""
        files = sorted(self.files(tag))
        total = sum(size for _, size, _ in files)
        cutoff = time.time() - GRACE_S
        for used, size, path in files:
            if total <= budget * _KEEP_AFTER_EVICTION or used > cutoff:
                break
            path.unlink(missing_ok=True)
            total -= size
        return total


class SharedStorageScheduler(KVConnectorScheduler):
    def __init__(self, config: EngineConfig) -> None:
        self.transfer = config.kv_transfer
        self.block_size = config.block_size
        self.store = BlockStore(layout_dir(config))
        self.tags = rank_tags(config)
        self._keys: dict[str, list[str]] = {}  # request id -> the keys of its full prompt blocks
        self._handled: dict[str, int] = {}  # request id -> its first prompt block not yet loaded, saved, or found locally
        self._loads: list[tuple[int, str]] = []  # for the next step's metadata
        self._adapter_digests: dict[tuple[int, str], bytes] = {}
        self._pins = self.store.directory / ".pins" / uuid.uuid4().hex  # this engine's
        _remove_stale_pins(self.store.directory / ".pins")

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if not self.transfer.loads or request.skips_prefix_cache:  # prompt logprobs: every position is computed here
            return 0, False
        keys = self._keys_of(request)
        first = num_computed_tokens // self.block_size
        # The prompt's last token is always computed: its logits give the first output token.
        last = (request.num_prompt_tokens - 1) // self.block_size
        found = 0
        while first + found < last and self.store.pin(keys[first + found], self.tags, self._pins):
            found += 1
        return found * self.block_size, False

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        end = request.num_computed_tokens // self.block_size
        first = end - num_external_tokens // self.block_size
        if num_external_tokens:
            keys = self._keys_of(request)
            self._loads += [(block_ids[index], keys[index]) for index in range(first, end)]
            self.received_tokens += num_external_tokens
        self._handled[request.request_id] = end

    def build_connector_meta(self, scheduler_output: SchedulerOutput, requests: dict[str, Request],
                             block_ids_of) -> KVConnectorMetadata:
        saves = []
        if self.transfer.saves:  # the step's prompt chunks fill prompt blocks; its decodes fill none
            for request_id, _, _, _ in scheduler_output.prompt_chunks:
                request = requests[request_id]
                done = min(request.num_computed_tokens, request.num_prompt_tokens) // self.block_size
                start = self._handled.get(request_id, 0)
                if done <= start:
                    continue
                keys, block_ids = self._keys_of(request), block_ids_of(request_id)
                saves += [(block_ids[index], keys[index]) for index in range(start, done) if not self.store.has(keys[index], self.tags)]
                self._handled[request_id] = done
        self.sent_tokens += len(saves) * self.block_size
        metadata = KVConnectorMetadata(self._loads, saves, str(self._pins))
        self._loads = []
        return metadata

    def step_done(self, metadata: KVConnectorMetadata) -> None:
        """Unpin the step's loads (a block found again since is pinned again when its request is admitted)."""
        for _, key in metadata.loads:
            for tag in self.tags:
                (self._pins / f"{key}.{tag}").unlink(missing_ok=True)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        self._keys.pop(request.request_id, None)
        self._handled.pop(request.request_id, None)
        return False, None

    def _keys_of(self, request: Request) -> list[str]:
        """Each full prompt block's key: a SHA-256 chain from the adapter's weights through every token up to the block's
        end."""
        keys = self._keys.get(request.request_id)
        if keys is None:
            digest = self._adapter_digest(request)
            tokens, size = request.prompt_token_ids, self.block_size
            keys = []
            for start in range(0, len(tokens) - size + 1, size):
                digest = hashlib.sha256(digest + array("q", tokens[start:start + size]).tobytes()).digest()
                keys.append(digest.hex()[:40])
            self._keys[request.request_id] = keys
        return keys


    def _adapter_digest(self, request: Request) -> bytes:
        """What a block's key starts from: the adapter's files' contents (an adapter id is only this engine's name for
        it, and another engine, or this one after a restart, may give the same id to other weights)."""
        lora = request.lora_request
        if lora is None:
            return hashlib.sha256(b"base model").digest()
        digest = self._adapter_digests.get((lora.lora_int_id, lora.lora_path))
        if digest is None:
            content = hashlib.sha256(b"lora")
            try:
                for name in (CONFIG_FILE, WEIGHTS_FILE):
                    with open(Path(lora.lora_path) / name, "rb") as file:
                        content.update(hashlib.file_digest(file, "sha256").digest())
            except OSError:  # its files are gone (the workers hold its weights): its blocks are this engine's alone
                content.update(uuid.uuid4().bytes)
            digest = self._adapter_digests[(lora.lora_int_id, lora.lora_path)] = content.digest()
        return digest


class SharedStorageWorker(KVConnectorWorker):
    def __init__(self, config: EngineConfig, tag: str) -> None:
        self.store = BlockStore(layout_dir(config))
        self.tag = tag
        max_bytes = config.kv_transfer.kv_connector_extra_config.get("max_bytes")
        self.budget = max_bytes // len(rank_tags(config)) if max_bytes else None  # this rank's share
        self._stored_bytes: int | None = None  # this rank's files, as last counted plus what it wrote since
        self.kv_caches: list = []

    def register_kv_caches(self, kv_caches: list) -> None:
        self.kv_caches = kv_caches

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        import torch

        pins = Path(metadata.load_from)
        for block_id, key in metadata.loads:
            data = torch.frombuffer(bytearray(self.store.read(key, self.tag, pins)), dtype=torch.uint8)
            parts = data.view(self.kv_caches[0].dtype).view(len(self.kv_caches), *self._block_shape())
            for cache, part in zip(self.kv_caches, parts):
                cache[:, block_id].copy_(part)

    def wait_for_save(self, metadata: KVConnectorMetadata) -> None:
        import torch

        for block_id, key in metadata.saves:
            block = torch.stack([cache[:, block_id] for cache in self.kv_caches])
            data = block.contiguous().view(torch.uint8).numpy().tobytes()
            self.store.write(key, self.tag, data)
            if self.budget is not None:
                self._count(len(data))

    def _block_shape(self) -> tuple[int, ...]:
        cache = self.kv_caches[0]
        return (cache.shape[0], *cache.shape[2:])

    def _count(self, written: int) -> None:
        if self._stored_bytes is None:
            self._stored_bytes = sum(size for _, size, _ in self.store.files(self.tag))
        else:
            self._stored_bytes += written
        if self._stored_bytes > self.budget:
            self._stored_bytes = self.store.evict(self.tag, self.budget)


def _remove_stale_pins(pins: Path) -> None:
    import shutil

    if not pins.is_dir():
        return
    cutoff = time.time() - _STALE_PINS_S
    for directory in pins.iterdir():
        try:
            if directory.stat().st_mtime < cutoff:
                shutil.rmtree(directory, ignore_errors=True)
        except FileNotFoundError:
            pass
