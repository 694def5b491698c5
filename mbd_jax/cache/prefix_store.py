"""The prefix store: KV blocks keyed by a chained hash of block-aligned token ids.

    key_0 = H(model_id, tokens[0:blk]);  key_i = H(key_{i-1}, tokens[i*blk:(i+1)*blk])

so a key names a block *and everything before it*: two prompts share block i's entry only when
their first (i+1)*blk tokens are equal, which is exactly when the exact KV is equal. An entry is
one block's cache entries as one array whose shape and dtype the model's cache names
(`block_shape`, model/cache.py; the engine passes them to `expect`): the store never looks
inside. A model with recurrent state has a second kind of entry: its rows' snapshot after a block
(`state_key(key)`: the block's key and a suffix; `snapshot_shape`), kept only at some block
boundaries (where a row's committed blocks ended when they were staged), so a lookup that
needs one stops at the last boundary that has it.

Two tiers. RAM: a byte-capped LRU. Disk (`storage_path`): one file per key written atomically
(temp file + rename), a byte cap (oldest files go first) and a TTL; it survives restarts. The
file's sha256 covers its key, every header field and the payload, so a truncated or bit-flipped
file, or a valid file copied over another key's, is detected on read, deleted and counted, never
used; an entry whose shape or dtype is not the engine's is treated the same way. An unwritable or
full disk logs one warning and the store keeps serving from RAM.

The disk tier never scans its directory after startup: an in-memory index (key -> size, mtime,
oldest first) answers membership, capacity and TTL. Writes go through a bounded queue to a writer
thread, so `put` (the offload drain) costs a RAM insert; when the queue is full the disk copy of
a block is dropped (counted), never waited for. Thread-safe (the engine thread reads, the offload
thread puts, the writer thread writes).
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

_MAGIC = b"MBDKV002"
_HEADER = struct.Struct("<8s32sQ16s6Q")  # magic, digest, payload bytes, dtype, shape
_FIELDS = struct.Struct("<Q16s6Q")  # the header after the digest (what the digest covers)
MAX_PENDING_WRITES = 1024  # disk writes queued beyond this are dropped


def _digest(key: str, fields: bytes, payload: bytes) -> bytes:
    """What a file's header stores: sha256 over its key, header fields and payload."""
    h = hashlib.sha256(key.encode())
    h.update(fields)
    h.update(payload)
    return h.digest()


def _dtype(name: str) -> np.dtype:
    try:
        return np.dtype(name)
    except TypeError:  # bfloat16 and friends live in ml_dtypes
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))


STATE_SUFFIX = ".state"


def state_key(key: str) -> str:
    """The key of the recurrent state after the block keyed `key` (hybrid models)."""
    return key + STATE_SUFFIX


def _kind(key: str) -> str:
    """An entry's kind from its key: '' (a block's KV) or 'state' (a state snapshot)."""
    return key.partition(".")[2]


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
    corrupt: int = 0  # disk entries that failed their checksum, were truncated or misshapen
    disk_errors: int = 0  # failed disk writes (unwritable, full)
    disk_dropped: int = 0  # blocks not written to disk because the write queue was full
    disk_entries: int = 0


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
        # per entry kind ('' or 'state'): its (shape, dtype); a kind not named: any
        self.entry_spec: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
        self._disk: pathlib.Path | None = None
        self._disk_warned = False
        # disk index: key -> (bytes, mtime), oldest first; guarded by _lock
        self._index: collections.OrderedDict[str, tuple[int, float]] = collections.OrderedDict()
        self._pending: collections.deque[tuple[str, np.ndarray]] = collections.deque()
        self._pending_keys: set[str] = set()
        self._writes = threading.Condition(self._lock)
        self._writing = False
        self._closed = False
        if storage_path is not None and disk_bytes > 0:
            self._disk = pathlib.Path(storage_path) / hashlib.sha256(
                model_id.encode()).hexdigest()[:16]
            try:
                self._disk.mkdir(parents=True, exist_ok=True)
                self._scan()
            except OSError as e:
                self._disk_failed(e)
                self._disk = None  # no usable directory: RAM only
        if self._disk is not None:
            threading.Thread(target=self._write_loop, name="kv-disk", daemon=True).start()

    def _scan(self) -> None:
        """Startup only: index the files already on disk (oldest first); remove temp files."""
        found = []
        with os.scandir(self._disk) as it:
            for e in it:
                if e.name.endswith(".kv"):
                    st = e.stat()
                    found.append((st.st_mtime, e.name[:-3], st.st_size))
                elif ".tmp" in e.name:  # a write cut short by a crash
                    with contextlib.suppress(OSError):
                        os.unlink(e.path)
        for mtime, key, size in sorted(found):
            self._index[key] = (size, mtime)
        self.stats.disk_bytes = sum(size for size, _ in self._index.values())
        self.stats.disk_entries = len(self._index)

    def expect(self, shape: Sequence[int], dtype: Any, kind: str = "") -> None:
        """Entries of `kind` ('': blocks, 'state': state snapshots) must have this shape and
        dtype (the engine's layout): others read from disk are corrupt, puts of others refused."""
        self.entry_spec[kind] = (tuple(int(d) for d in shape), np.dtype(dtype))

    def _fits(self, key: str, entry: np.ndarray) -> bool:
        spec = self.entry_spec.get(_kind(key))
        return spec is None or (entry.shape, entry.dtype) == spec

    # ------------------------------------------------------------------ lookups
    def keys(self, tokens: Sequence[int], known: Sequence[str] = ()) -> list[str]:
        return block_keys(self.model_id, tokens, self.block_size, known)

    def lookup(self, tokens: Sequence[int], max_blocks: int | None = None,
               first: int = 0, count: bool = True, known: Sequence[str] = ()) -> list[np.ndarray]:
        """The longest run of full blocks of `tokens` from block `first` on (the caller holds
        the ones before it) that the store holds. A key chains the whole prefix, so a block is
        found by its prefix whatever the store still holds of the blocks before it. `count`:
        add the blocks found and missed to the stats (a caller that may look again, and use only
        the later lookup, counts that one with `record`); `known`: keys of leading blocks the
        caller computed already."""
        found = []
        keys = self.keys(tokens, known)[first:max_blocks]
        for key in keys:
            entry = self.get(key)
            if entry is None:
                break
            found.append(entry)
        if count:
            self.record(len(found), len(keys) - len(found))
        return found

    def lookup_with_state(self, tokens: Sequence[int], max_blocks: int | None = None,
                          count: bool = True, known: Sequence[str] = ()
                          ) -> tuple[list[np.ndarray], np.ndarray | None]:
        """A hybrid's lookup: the longest run of stored blocks of `tokens` from the first one
        that ends at a block with a state snapshot, and that snapshot (([], None): none)."""
        keys = self.keys(tokens, known)[:max_blocks]
        found: list[np.ndarray] = []
        for key in keys:
            entry = self.get(key)
            if entry is None:
                break
            found.append(entry)
        state = None
        while found and (state := self.get(state_key(keys[len(found) - 1]))) is None:
            found.pop()
        if count:
            self.record(len(found), len(keys) - len(found))
        return found, state

    def record(self, hits: int, misses: int) -> None:
        """Counts a lookup's blocks found and missed."""
        with self._lock:
            self.stats.hits += hits
            self.stats.misses += misses

    def get(self, key: str) -> np.ndarray | None:
        """One block's entry from RAM, else from disk (then kept in RAM); not counted."""
        with self._lock:
            entry = self._ram.get(key)
            if entry is not None:
                self._ram.move_to_end(key)
                return entry
        entry = self._read_disk(key)
        if entry is not None:
            self._put_ram(key, entry)
        return entry

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._ram or key in self._pending_keys or (
                key in self._index and not self._expired(self._index[key][1]))

    # ------------------------------------------------------------------ writes
    def put(self, key: str, entry: np.ndarray) -> None:
        """Stores one block's KV in RAM and queues its disk write (a key already present is left
        alone; with a full write queue the disk copy is dropped)."""
        if not self._fits(key, entry):
            raise ValueError(f"prefix store entry {entry.shape} {entry.dtype} is not the "
                             f"expected {self.entry_spec.get(_kind(key))}")
        with self._lock:
            in_ram = key in self._ram
        if not in_ram:
            self._put_ram(key, entry)
        if self._disk is None:
            return
        with self._writes:
            if key in self._pending_keys or (key in self._index
                                              and not self._expired(self._index[key][1])):
                return
            if len(self._pending) >= MAX_PENDING_WRITES:
                self.stats.disk_dropped += 1
                return
            self._pending.append((key, entry))
            self._pending_keys.add(key)
            self._writes.notify_all()

    def flush(self) -> None:
        """Waits until every queued disk write is done (tests, shutdown)."""
        with self._writes:
            while (self._pending or self._writing) and self._disk is not None:
                self._writes.wait(timeout=1.0)

    def close(self) -> None:
        self.flush()
        with self._writes:
            self._closed = True
            self._writes.notify_all()

    def _write_loop(self) -> None:
        while True:
            with self._writes:
                while not self._pending and not self._closed:
                    self._writes.wait()
                if not self._pending:
                    return
                key, entry = self._pending[0]
                self._writing = True
            try:
                self._write_disk(key, entry)
            finally:
                with self._writes:
                    self._pending.popleft()
                    self._pending_keys.discard(key)
                    self._writing = False
                    self._writes.notify_all()

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
        """Writer thread: one file, atomically; older files go first when the cap is reached."""
        if self._disk is None:
            return
        payload = np.ascontiguousarray(entry).tobytes()
        shape = tuple(entry.shape) + (0,) * (6 - entry.ndim)
        fields = _FIELDS.pack(len(payload), entry.dtype.name.encode().ljust(16), *shape)
        header = _MAGIC + _digest(key, fields, payload) + fields  # the _HEADER layout
        size = len(header) + len(payload)
        if size > self.disk_capacity:
            return
        path = self._path(key)
        tmp = path.with_suffix(f".tmp{threading.get_ident()}")
        try:
            self._make_room(size)
            with open(tmp, "wb") as fh:
                fh.write(header)
                fh.write(payload)
            os.replace(tmp, path)  # atomic: readers see the old file or the whole new one
            with self._lock:
                old = self._index.pop(key, None)
                self._index[key] = (size, self.clock())
                self.stats.disk_bytes += size - (old[0] if old else 0)
                self.stats.disk_entries = len(self._index)
        except OSError as e:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            self._disk_failed(e)

    def _make_room(self, size: int) -> None:
        """Removes expired entries, then the oldest, until `size` more bytes fit (from the index:
        no directory scan)."""
        while True:
            with self._lock:
                if not self._index:
                    return
                key, (old_size, mtime) = next(iter(self._index.items()))
                if self.stats.disk_bytes + size <= self.disk_capacity and not self._expired(mtime):
                    return
                del self._index[key]
                self.stats.disk_bytes -= old_size
                self.stats.disk_entries = len(self._index)
                self.stats.evictions += 1
            with contextlib.suppress(OSError):
                self._path(key).unlink()

    def _expired(self, mtime: float) -> bool:
        return self.ttl_s > 0 and self.clock() - mtime > self.ttl_s

    def _read_disk(self, key: str) -> np.ndarray | None:
        if self._disk is None:
            return None
        with self._lock:
            known = self._index.get(key)
        if known is None:
            return None
        if self._expired(known[1]):
            self._drop(key, corrupt=False)
            return None
        try:
            data = self._path(key).read_bytes()
        except OSError:  # removed behind our back
            self._drop(key, corrupt=False, count=False)
            return None
        entry = self._decode(key, data)
        if entry is None or not self._fits(key, entry):
            log.warning("prefix cache: entry %s is corrupt, truncated or not this model's layout; "
                        "ignored and removed", key)
            self._drop(key, corrupt=True)
            return None
        return entry

    @staticmethod
    def _decode(key: str, data: bytes) -> np.ndarray | None:
        if len(data) < _HEADER.size:
            return None
        magic, digest, n, dtype, *shape = _HEADER.unpack_from(data)
        fields = data[len(_MAGIC) + 32:_HEADER.size]
        payload = data[_HEADER.size:]
        if magic != _MAGIC or len(payload) != n or _digest(key, fields, payload) != digest:
            return None
        shape = tuple(s for s in shape if s > 0)
        try:
            return np.frombuffer(payload, _dtype(dtype.rstrip().decode())).reshape(shape).copy()
        except (AttributeError, TypeError, ValueError, UnicodeDecodeError):
            return None

    def _drop(self, key: str, corrupt: bool, count: bool = True) -> None:
        with self._lock:
            known = self._index.pop(key, None)
            if known is not None:
                self.stats.disk_bytes -= known[0]
                self.stats.disk_entries = len(self._index)
            if count and corrupt:
                self.stats.corrupt += 1
            elif count:
                self.stats.evictions += 1
        with contextlib.suppress(OSError):
            self._path(key).unlink()
