"""Small JSON files kept under the cache directory: what a start computed once, read back by later starts.

Written atomically (a concurrent start reads a whole file or none); a missing, unreadable or half-written file reads
as absent, and a cache that cannot be written costs only the next start's time.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from pagedserve.envs import cache_root


def cache_file(kind: str, *key_parts: str | bytes) -> Path:
    """The cache file for `kind` (a folder of the cache) under a digest of key_parts."""
    digest = hashlib.sha256()
    for part in key_parts:
        digest.update(part if isinstance(part, bytes) else part.encode())
        digest.update(b"\0")
    return cache_root() / kind / f"{digest.hexdigest()[:24]}.json"


def read(path: Path):
    """The stored value, or None when there is none."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def write(path: Path, value) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = path.with_suffix(f".tmp{os.getpid()}")
        staging.write_text(json.dumps(value))
        os.replace(staging, path)
    except OSError:
        pass
