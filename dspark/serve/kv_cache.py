"""Paged KV cache and its page allocator.

K and V live in `[num_layers, num_pages, page_size, H, D]` buffers; each request owns the pages listed
in its row of the block table. A batch is admitted only if every request's whole sequence fits.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor


class BlockAllocator:
    """Free list of page ids."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self._free = list(range(num_pages))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise ValueError(f"need {n} KV pages but only {len(self._free)} of {self.num_pages} are free")
        pages, self._free = self._free[:n], self._free[n:]
        return pages

    def free(self, pages: list[int]) -> None:
        self._free.extend(pages)


class PagedKVCache:
    """One model's paged K/V buffers plus the block table of the batch currently admitted."""

    def __init__(self, *, num_layers: int, num_heads: int, head_dim: int, num_pages: int, page_size: int,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        for name, v in (("num_pages", num_pages), ("page_size", page_size)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        shape = (num_layers, num_pages, page_size, num_heads, head_dim)
        try:
            self.k = torch.zeros(shape, device=device, dtype=dtype)
            self.v = torch.zeros(shape, device=device, dtype=dtype)
        except (RuntimeError, MemoryError) as e:
            if not isinstance(e, (torch.OutOfMemoryError, MemoryError)) and "alloc" not in str(e):
                raise  # not a failed allocation (the CPU allocator's is a RuntimeError naming it)
            gib = 2 * math.prod(shape) * dtype.itemsize / 2**30
            raise MemoryError(f"the paged KV cache of {num_pages * page_size} tokens ({gib:.1f} GiB for K and V) "
                              f"does not fit on {device}: serve fewer requests at once or shorter sequences "
                              f"({type(e).__name__}: {str(e).splitlines()[0]})") from None
        self.page_size = page_size
        self.allocator = BlockAllocator(num_pages)
        self.block_table = torch.zeros(0, 0, dtype=torch.int32, device=device)
        self._owned: list[int] = []

    @property
    def capacity_tokens(self) -> int:
        return self.allocator.num_pages * self.page_size

    def admit(self, batch: int, max_len: int) -> Tensor:
        """Reserve `ceil(max_len / page_size)` pages for each of `batch` requests; returns the block table."""
        self.release()
        per_req = -(-max_len // self.page_size)
        need = batch * per_req
        if need > self.allocator.num_pages:
            raise ValueError(
                f"batch {batch} x {max_len} tokens needs {need} KV pages of {self.page_size} tokens but "
                f"the cache holds {self.allocator.num_pages} pages ({self.capacity_tokens} tokens); "
                f"lower the batch size or enlarge the cache"
            )
        pages = self.allocator.allocate(need)
        self._owned = pages
        table = torch.tensor(pages, dtype=torch.int32).reshape(batch, per_req)
        self.block_table = table.to(self.k.device)
        return self.block_table

    def release(self) -> None:
        self.allocator.free(self._owned)
        self._owned = []
