"""The paged latent KV pool: cache memory, a page allocator and the per-sequence page table.

MLA caches one latent vector per token per layer (`kv_lora_rank + qk_rope_head_dim` values),
shared by all heads. Memory is cut into pages of `page_size` tokens; a sequence's pages are listed
in its row of the page table. A row may start with pages of the prefix cache (shared, read only:
radix_cache.py owns them); the pages after those are the sequence's own, and only they are written.
"""

from __future__ import annotations

import torch

from afd_engine.errors import ConfigError


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


class KVPool:
    """Cache tensor [layers, num_pages * page_size, dim] plus page bookkeeping."""

    def __init__(
        self,
        num_layers: int,
        dim: int,
        num_pages: int,
        page_size: int,
        max_seqs: int,
        max_pages_per_seq: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        if num_pages < 1:
            raise ConfigError("the KV cache budget holds no page; raise --kv-cache-memory-mb or lower --page-size")
        self.page_size, self.num_pages = page_size, num_pages
        self.device = torch.device(device)
        self.cache = torch.zeros(num_layers, num_pages * page_size, dim, dtype=dtype, device=device)
        # bookkeeping stays on the host: ForwardBatch.build reads it and moves the step's tables
        self.page_table = torch.zeros(max_seqs, max_pages_per_seq, dtype=torch.int64)
        self._free_pages = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
        self._free_rows = list(range(max_seqs - 1, -1, -1))
        self._pages: dict[int, list[int]] = {}  # row -> pages owned

    @staticmethod
    def bytes_per_page(num_layers: int, dim: int, page_size: int, dtype: torch.dtype) -> int:
        return num_layers * dim * page_size * torch.empty((), dtype=dtype).element_size()

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def free_pages(self) -> int:
        return len(self._free_pages)

    @property
    def used_pages(self) -> int:
        return self.num_pages - len(self._free_pages)

    @property
    def free_rows(self) -> int:
        return len(self._free_rows)

    @property
    def open_rows(self) -> int:
        return len(self._pages)

    def reserve_page(self) -> int:
        """Takes the highest free page out of the pool for good (the padding page of CUDA graph
        decode steps, runtime/cuda_graph.py): no sequence gets it and the pool counts it no more."""
        if not self._free_pages:
            raise ConfigError("the KV cache has no free page to reserve; raise --kv-cache-memory-mb")
        page = max(self._free_pages)
        self._free_pages.remove(page)
        self.num_pages -= 1
        return page

    def open_row(self, prefix_pages: list[int] = ()) -> int:
        """A free row, starting with `prefix_pages` (pages the row reads but does not own)."""
        row = self._free_rows.pop()
        self._pages[row] = list(prefix_pages)
        self.page_table[row, : len(prefix_pages)] = torch.tensor(prefix_pages, dtype=torch.int64)
        return row

    def num_row_pages(self, row: int) -> int:
        return len(self._pages[row])

    def page_of(self, row: int, index: int) -> int:
        return self._pages[row][index]

    def row_pages(self) -> dict[int, list[int]]:
        """Each open row's pages, in order."""
        return {row: list(pages) for row, pages in self._pages.items()}

    def replace_page(self, row: int, index: int, page: int) -> None:
        """Points the row's page `index` at `page` (same contents) and frees the page it had."""
        self._free_pages.append(self._pages[row][index])
        self._pages[row][index] = page
        self.page_table[row, index] = page

    def free(self, pages: list[int]) -> None:
        self._free_pages.extend(pages)

    def tokens_capacity(self, row: int) -> int:
        return len(self._pages[row]) * self.page_size

    def extra_pages_needed(self, row: int | None, total_tokens: int) -> int:
        have = 0 if row is None else len(self._pages[row])
        return max(0, pages_for(total_tokens, self.page_size) - have)

    def grow(self, row: int, total_tokens: int) -> bool:
        """Ensures `row` owns enough pages for `total_tokens`; False (and no change) if pages run out."""
        need = self.extra_pages_needed(row, total_tokens)
        if need > len(self._free_pages):
            return False
        owned = self._pages[row]
        if len(owned) + need > self.page_table.shape[1]:
            return False
        for _ in range(need):
            page = self._free_pages.pop()
            self.page_table[row, len(owned)] = page
            owned.append(page)
        return True

    def shrink(self, row: int, pages: int) -> None:
        """Frees the row's own pages past its first `pages` (slots a step reserved and no longer needs)."""
        owned = self._pages[row]
        if len(owned) > pages:
            self._free_pages.extend(reversed(owned[pages:]))
            del owned[pages:]

    def release(self, row: int, keep: int = 0) -> None:
        """Frees the row and its pages but the first `keep` (which the prefix cache holds)."""
        self._free_pages.extend(reversed(self._pages.pop(row)[keep:]))
        self._free_rows.append(row)
