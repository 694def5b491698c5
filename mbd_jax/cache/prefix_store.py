"""The prefix store: KV blocks keyed by a chained hash of block-aligned token ids.

    key_0 = H(model_id, tokens[0:blk]);  key_i = H(key_{i-1}, tokens[i*blk:(i+1)*blk])

so a key names a block *and everything before it*: two prompts share block i's entry only when
their first (i+1)*blk tokens are equal, which is exactly when the exact KV is equal. An entry is
one block's K and V for every layer, `[num_layers, 2, blk, K, Dh]`.

Two tiers. RAM: a byte-capped LRU. Disk (`storage_path`): one file per key written atomically
(temp file + rename) with a header carrying a sha256 of the payload, a byte cap (oldest files go
first) and a TTL; it survives restarts. A truncated or bit-flipped file is detected on read,
deleted and counted, never used; an unwritable or full disk logs one warning and the store keeps
serving from RAM. Thread-safe (the engine thread reads, the offload thread writes).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import pathlib
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

log = logging.getLogger("mbd_jax.cache")

_MAGIC = b"MBDKV001"
_HEADER = struct.Struct("<8s32sQ16s6Q")  # magic, sha256(payload), payload bytes, dtype, shape


def _dtype(name: str) -> np.dtype:
    try:
        return np.dtype(name)
    except TypeError:  # bfloat16 and friends live in ml_dtypes
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))


def block_keys(model_id: str, tokens: Sequence[int], block_size: int,
               known: Sequence[str] = ()) -> list[str]:
    """The chained key of every full block of `tokens`; `known` (keys of its leading blocks,
    computed earlier) are reused, not rehashed."""
    keys = list(known)
    prev = bytes.fromhex(keys[-1]) if keys else hashlib.sha256(model_id.encode()).digest()
    for b in range(len(keys), len(tokens) // block_size):
        block = np.asarray(tokens[b * block_size:(b + 1) * block_size], np.int64).tobytes()
        prev = hashlib.sha256(prev + block).digest()
        keys.append(prev.hex())
    return keys


def model_identity(cfg: Any, model_dir: pathlib.Path | None = None) -> str:
    """What a stored block's KV depends on besides its tokens: the architecture and the weights
    (a model directory's manifest checksums them; a random init is fixed by the config's seed)."""
    h = hashlib.sha256(json.dumps(dataclasses.asdict(cfg), sort_keys=True, default=str).encode())
    manifest = model_dir / "manifest.json" if model_dir is not None else None
    if manifest is not None and manifest.is_file():
        h.update(json.dumps(json.loads(manifest.read_text())["files"], sort_keys=True).encode())
    return h.hexdigest()


@dataclasses.dataclass
class StoreStats:
    hits: int = 0  # blocks found (either tier)
    misses: int = 0  # blocks looked up and not found
    ram_bytes: int = 0
    disk_bytes: int = 0
    evictions: int = 0  # RAM LRU evictions + disk capacity / TTL removals
    corrupt: int = 0  # disk entries that failed their checksum or were truncated
    disk_errors: int = 0  # failed disk writes (unwritable, full)


class PrefixStore:
    def __init__(self, model_id: str, block_size: int, *, ram_bytes: int,
                 storage_path: str | os.PathLike | None = None, disk_bytes: int = 0,
                 ttl_s: float = 0.0, clock: Callable[[], float] = time.time):
        self.model_id = model_id
        self.block_size = block_size
        self.ram_capacity = ram_bytes
        self.disk_capacity = disk_bytes
        self.ttl_s = ttl_s  # 0 = no expiry
        self.clock = clock
        self.stats = StoreStats()
        self._ram: collections.OrderedDict[str, np.ndarray] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._disk: pathlib.Path | None = None
        self._disk_warned = False
        if storage_path is not None and disk_bytes > 0:
            self._disk = pathlib.Path(storage_path) / hashlib.sha256(
                model_id.encode()).hexdigest()[:16]
            try:
                self._disk.mkdir(parents=True, exist_ok=True)
                self.stats.disk_bytes = sum(p.stat().st_size for p in self._disk.glob("*.kv"))
            except OSError as e:
                self._disk_failed(e)
                self._disk = None  # no usable directory: RAM only

    # ------------------------------------------------------------------ lookups
    def keys(self, tokens: Sequence[int], known: Sequence[str] = ()) -> list[str]:
        return block_keys(self.model_id, tokens, self.block_size, known)

    def lookup(self, tokens: Sequence[int], max_blocks: int | None = None) -> list[np.ndarray]:
        """The longest run of leading full blocks of `tokens` that the store holds."""
        found = []
        keys = self.keys(tokens)[:max_blocks]
        for key in keys:
            entry = self.get(key)
            if entry is None:
                break
            found.append(entry)
        with self._lock:
            self.stats.misses += len(keys) - len(found)
        return found

    def get(self, key: str) -> np.ndarray | None:
        with self._lock:
            entry = self._ram.get(key)
            if entry is not None:
                self._ram.move_to_end(key)
                self.stats.hits += 1
                return entry
        entry = self._read_disk(key)
        if entry is not None:
            with self._lock:
                self.stats.hits += 1
            self._put_ram(key, entry)
        return entry

    def __contains__(self, key: str) -> bool:
        with self._lock:
            if key in self._ram:
                return True
        return self._disk is not None and (self._disk / f"{key}.kv").is_file()

    # ------------------------------------------------------------------ writes
    def put(self, key: str, entry: np.ndarray) -> None:
        """Stores one block's KV in both tiers (a key already present is left alone)."""
        with self._lock:
            in_ram = key in self._ram
        if not in_ram:
            self._put_ram(key, entry)
        self._write_disk(key, entry)

    def _put_ram(self, key: str, entry: np.ndarray) -> None:
        if entry.nbytes > self.ram_capacity:
            return
        with self._lock:
            if key in self._ram:
                return
            self._ram[key] = entry
            self.stats.ram_bytes += entry.nbytes
            while self.stats.ram_bytes > self.ram_capacity:
                _, old = self._ram.popitem(last=False)
                self.stats.ram_bytes -= old.nbytes
                self.stats.evictions += 1

    # ------------------------------------------------------------------ disk tier
    def _path(self, key: str) -> pathlib.Path:
        assert self._disk is not None
        return self._disk / f"{key}.kv"

    def _disk_failed(self, e: OSError) -> None:
        self.stats.disk_errors += 1
        if not self._disk_warned:
            log.warning("prefix cache: disk tier at %s failed (%s); serving continues from RAM",
                        self._disk, e)
            self._disk_warned = True

    def _write_disk(self, key: str, entry: np.ndarray) -> None:
        if self._disk is None:
            return
        path = self._path(key)
        if path.is_file() and not self._expired(path):
            return
        payload = np.ascontiguousarray(entry).tobytes()
        shape = tuple(entry.shape) + (0,) * (6 - entry.ndim)
        header = _HEADER.pack(_MAGIC, hashlib.sha256(payload).digest(), len(payload),
                              entry.dtype.name.encode().ljust(16), *shape)
        size = len(header) + len(payload)
        if size > self.disk_capacity:
            return
        tmp = path.with_suffix(f".tmp{threading.get_ident()}")
        try:
            self._make_room(size)
            with open(tmp, "wb") as fh:
                fh.write(header)
                fh.write(payload)
            os.replace(tmp, path)  # atomic: readers see the old file or the whole new one
            with self._lock:
                self.stats.disk_bytes += size
        except OSError as e:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            self._disk_failed(e)

    def _make_room(self, size: int) -> None:
        """Removes expired files, then the oldest, until `size` more bytes fit."""
        files = sorted(self._disk.glob("*.kv"), key=lambda p: p.stat().st_mtime)
        total = sum(p.stat().st_size for p in files)
        for p in files:
            if total + size <= self.disk_capacity and not self._expired(p):
                continue
            total -= p.stat().st_size
            p.unlink(missing_ok=True)
            self.stats.evictions += 1
        with self._lock:
            self.stats.disk_bytes = total

    def _expired(self, path: pathlib.Path) -> bool:
        return self.ttl_s > 0 and self.clock() - path.stat().st_mtime > self.ttl_s

    def _read_disk(self, key: str) -> np.ndarray | None:
        if self._disk is None:
            return None
        path = self._path(key)
        try:
            if not path.is_file():
                return None
            if self._expired(path):
                self._drop(path, corrupt=False)
                return None
            data = path.read_bytes()
        except OSError:
            return None
        entry = self._decode(data)
        if entry is None:
            log.warning("prefix cache: entry %s is corrupt or truncated; ignored and removed", key)
            self._drop(path, corrupt=True)
        return entry

    @staticmethod
    def _decode(data: bytes) -> np.ndarray | None:
        if len(data) < _HEADER.size:
            return None
        magic, digest, n, dtype, *shape = _HEADER.unpack_from(data)
        payload = data[_HEADER.size:]
        if magic != _MAGIC or len(payload) != n or hashlib.sha256(payload).digest() != digest:
            return None
        shape = tuple(s for s in shape if s > 0)
        try:
            return np.frombuffer(payload, _dtype(dtype.rstrip().decode())).reshape(shape).copy()
        except (AttributeError, TypeError, ValueError):
            return None

    def _drop(self, path: pathlib.Path, corrupt: bool) -> None:
        try:
            size = path.stat().st_size
            path.unlink()
        except OSError:
            return
        with self._lock:
            self.stats.disk_bytes -= size
            if corrupt:
                self.stats.corrupt += 1
            else:
                self.stats.evictions += 1
