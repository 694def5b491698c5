"""Page accounting for the paged KV pool (model/paged_kv.py): which pool pages are free, how
many rows hold each, and which hold a committed prompt prefix that later requests may share.

Host-side and pure bookkeeping: the engine asks for pages when it admits a request (enough for
every position the row can write: its prompt, its new tokens and one decode window) and keeps
them in the row's record (rows.py), gives them back when the row is released, and builds the
device's page table from its rows' pages (`page_table`).

Prefix pages. Once a row's prompt is prefilled, each of its pages that lies wholly inside the
prompt's full blocks is indexed by a chained hash of the tokens up to its end (`page_keys`). A
later prompt starting with the same tokens maps those pages into its own table (`lookup`, then
`reserve(..., shared=)`) and prefills only the rest: committed blocks never change, so the pages
are shared as they are, never copied. A page is in exactly one of three places: held by one or
more rows (`refs` counts them), free, or cached (indexed, held by no row: it stays mapped for a
later hit and is the first to go, oldest first and a prefix's last page first, when a
reservation needs pages).
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Sequence

import numpy as np


def page_keys(prompt: Sequence[int], page: int, full_len: int) -> list[bytes]:
    """The chained hash of each page of `prompt` that lies wholly inside its first `full_len`
    positions (its full blocks): key i covers tokens [0, (i + 1) * page)."""
    tokens = np.asarray(prompt, np.int32)
    keys, key = [], b""
    for i in range(full_len // page):
        key = hashlib.blake2b(key + tokens[i * page:(i + 1) * page].tobytes(), digest_size=16).digest()
        keys.append(key)
    return keys


def page_table(held: dict[int, Sequence[int]], rows: int, pages_per_row: int, num_pages: int
               ) -> np.ndarray:
    """[rows, pages_per_row] the pool page of each row's logical page (`held`: row -> its pages
    in order); num_pages (maps nothing: writes there are dropped) everywhere else."""
    table = np.full((rows, pages_per_row), num_pages, np.int32)
    for row, pages in held.items():
        table[row, : len(pages)] = pages
    return table


class PagePool:
    def __init__(self, num_pages: int, page: int, pages_per_row: int):
        self.num_pages, self.page, self.pages_per_row = num_pages, page, pages_per_row
        self.clear()

    def clear(self) -> None:
        """Every page free, none held, nothing indexed (a fresh pool)."""
        self.refs = np.zeros(self.num_pages, np.int32)  # rows holding each page
        self._free = list(range(self.num_pages - 1, -1, -1))  # a stack: the lowest page first
        self._cached: collections.OrderedDict[int, None] = collections.OrderedDict()  # oldest first
        self.index: dict[bytes, int] = {}  # prefix key -> page
        self._key: dict[int, bytes] = {}  # page -> its prefix key

    @property
    def free(self) -> int:
        """Pages a reservation may take: free ones and cached prefix pages no row holds."""
        return len(self._free) + len(self._cached)

    @property
    def in_use(self) -> int:
        """Pages rows hold (a shared page counts once)."""
        return self.num_pages - self.free

    @property
    def cached(self) -> int:
        return len(self._cached)

    def pages_for(self, tokens: int) -> int:
        """Pages a row needs to hold positions [0, tokens)."""
        return min(-(-tokens // self.page), self.pages_per_row)

    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        """The pages of the leading keys found in the index (a prefix hit), in order."""
        pages = []
        for key in keys:
            page = self.index.get(key)
            if page is None:
                break
            pages.append(page)
        return pages

    def cost(self, tokens: int, shared: Sequence[int]) -> int:
        """Free pages a reservation of `tokens` positions over `shared` leading pages takes: its
        own pages, and the shared ones no row holds now (they leave the cached set)."""
        return self.pages_for(tokens) - len(shared) + sum(self.refs[p] == 0 for p in shared)

    def reserve(self, tokens: int, shared: Sequence[int] = ()) -> list[int]:
        """Pages for one row's positions [0, tokens), in order: the `shared` prefix pages first,
        then its own, taken from the free pages or, when none are left, from the oldest cached
        prefix pages. The caller checks `free` against `cost` first: running out here is a
        bug, not a full pool."""
        n = self.pages_for(tokens)
        shared = list(shared)[:n]
        if self.cost(tokens, shared) > self.free:
            raise RuntimeError(f"KV pool: a row needs {self.cost(tokens, shared)} pages, "
                               f"{self.free} are free")
        for p in shared:
            self._cached.pop(p, None)
        pages = shared + [self._take() for _ in range(n - len(shared))]
        self.refs[pages] += 1
        return pages

    def _take(self) -> int:
        if self._free:
            return self._free.pop()
        page, _ = self._cached.popitem(last=False)  # the oldest cached prefix page
        del self.index[self._key.pop(page)]
        return page

    def register(self, pages: Sequence[int], keys: Sequence[bytes]) -> None:
        """Indexes a row's leading `pages` under `keys` (its prompt pages, now prefilled); a key
        already indexed keeps its page."""
        for key, page in zip(keys, pages):
            if key not in self.index and page not in self._key:
                self.index[key], self._key[page] = page, key

    def release(self, pages: Sequence[int]) -> None:
        """Gives back the pages a row held. A prefix page no row holds any more stays cached
        (indexed) until a reservation needs it. A row's pages join the cache last page first,
        so eviction (oldest first) eats a prefix from its end and what stays cached is still a
        prefix a lookup can reach."""
        for p in reversed(pages):
            self.refs[p] -= 1
            if self.refs[p] == 0:
                if p in self._key:
                    self._cached[p] = None
                else:
                    self._free.append(p)

    def check(self, held: Sequence[Sequence[int]]) -> None:
        """Raises AssertionError unless every page is in exactly one place (held by the rows'
        `held` page lists, free or cached), each page's count equals its holders, the index and
        its reverse agree, cached pages are indexed and free pages are not."""
        holders = np.zeros(self.num_pages, np.int32)
        for pages in held:
            assert len(set(pages)) == len(pages), "a row holds a page twice"
            np.add.at(holders, list(pages), 1)
        free, cached = set(self._free), set(self._cached)
        in_use = set(np.flatnonzero(holders).tolist())
        assert len(free) == len(self._free), "a page is free twice"
        assert not (free & cached) and not (free & in_use) and not (cached & in_use), \
            "a page is in two places"
        assert len(free) + len(cached) + len(in_use) == self.num_pages, "a page is lost"
        assert (self.refs == holders).all(), "reference counts differ from the holders"
        assert {v: k for k, v in self.index.items()} == self._key, "index and reverse differ"
        assert cached <= set(self._key) and not (free & set(self._key)), "cache / index mismatch"
