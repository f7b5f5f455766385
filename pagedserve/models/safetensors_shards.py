"""Tensors written into safetensors files as they come, a shard at a time, so that writing a model holds no more than
one shard's tensors in memory."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

# Bytes of tensors per shard.
SHARD_BYTES = 2 * 1024**3


class ShardWriter:
    """Writes the tensors added into out_dir / name_of(n), n = 1, 2, ..., each file up to SHARD_BYTES of tensors (a
    larger tensor alone)."""

    def __init__(self, out_dir: Path, name_of: Callable[[int], str]) -> None:
        self.out_dir, self.name_of, self.max_bytes = out_dir, name_of, SHARD_BYTES
        self.files: list[str] = []
        self.file_of: dict[str, str] = {}  # tensor name -> its shard's file name
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if self._pending and self._pending_bytes + tensor.nbytes > self.max_bytes:
            self._flush()
        self._pending[name] = tensor.contiguous()
        self._pending_bytes += tensor.nbytes

    def close(self) -> list[str]:
        """Write what is pending; returns the files written, in order."""
        if self._pending or not self.files:
            self._flush()
        return self.files

    def _flush(self) -> None:
        from safetensors.torch import save_file

        file = self.name_of(len(self.files) + 1)
        save_file(self._pending, str(self.out_dir / file), metadata={"format": "pt"})
        self.files.append(file)
        self.file_of.update(dict.fromkeys(self._pending, file))
        self._pending, self._pending_bytes = {}, 0
