"""Reference C_r compressor (C4 / C128): proves the compressed-KV write positions of ragged verify rows.

DSV4's compressor turns every r committed positions of a request into one compressed KV entry. This
reference pools them (the mean of the r positions' features), which is enough to check what matters for
the port: which packed row completes which group, and that the state after a step equals the state the
static path leaves after the same committed tokens. `write` takes one forward's rows (prefill or verify,
eager or tier-padded) with its `AscendVerifyMetadata`: every real row's feature is stored at its position,
then each entry the metadata names (`compressed[r]`: slot, packed row, group start) is pooled from the
r positions ending at that row, which must be the row's own position. Padding rows write nothing.
"""
from __future__ import annotations

import torch
from torch import Tensor

from dspark.ascend.metadata import AscendVerifyMetadata
from dspark.util.validate import check_int, check_tensor


class ReferenceCompressor:
    """Per-request features by position and compressed entries of ratio r (NaN until written).

    ratio: r; num_requests, max_len, dim: the state's extent ([requests, max_len, dim] features,
    [requests, max_len // r, dim] entries).
    """

    def __init__(self, ratio: int, num_requests: int, max_len: int, dim: int,
                 device: torch.device | str = "cpu") -> None:
        self.ratio = check_int("ratio", ratio, 1)
        for name, value in (("num_requests", num_requests), ("max_len", max_len), ("dim", dim)):
            check_int(name, value, 1)
        self.features = torch.zeros(num_requests, max_len, dim, device=device)
        self.entries = torch.full((num_requests, max_len // ratio, dim), float("nan"), device=device)

    def write(self, meta: AscendVerifyMetadata, rows: Tensor, requests: Tensor) -> Tensor:
        """Store one forward's rows and pool the groups they complete.

        Args:
            meta: the forward's metadata (built with this ratio in `compress_ratios`).
            rows: [meta.num_tokens, dim] feature of every packed row (padding rows ignored).
            requests: [meta.num_requests] int64 request index of each real slot.
        Returns:
            [entries, 2] int64 (request, compressed index) of the entries written, in the metadata's order.
        """
        if self.ratio not in meta.compressed:
            raise ValueError(f"metadata has no ratio {self.ratio} entries (compress_ratios {list(meta.compressed)})")
        check_tensor("rows", rows)
        if tuple(rows.shape) != (meta.num_tokens, self.features.shape[2]):
            raise ValueError(f"rows must be [{meta.num_tokens}, {self.features.shape[2]}], got {list(rows.shape)}")
        if tuple(requests.shape) != (meta.num_requests,):
            raise ValueError(f"requests must be [{meta.num_requests}], got {list(requests.shape)}")
        device = self.features.device
        row_ids = torch.arange(meta.num_tokens, device=device)
        slot = torch.searchsorted(meta.cu_seqlens_q[1:].to(device, torch.int64), row_ids, right=True)
        real = meta.row_valid.to(device) & (slot < meta.num_requests)
        owner = requests.to(device, torch.int64)[slot[real]]
        pos = meta.positions.to(device)[real]
        if bool((pos >= self.features.shape[1]).any()):
            raise ValueError(f"a row's position {int(pos.max())} is past max_len={self.features.shape[1]}")
        self.features[owner, pos] = rows.to(device, self.features.dtype)[real]
        g = meta.compressed[self.ratio]
        valid = g.valid.to(device)
        start, at, who = g.positions.to(device)[valid], g.rows.to(device, torch.int64)[valid], \
            g.slots.to(device, torch.int64)[valid]
        if bool((at >= meta.num_tokens).any()):
            raise ValueError(f"C{self.ratio} entries name rows {at.tolist()} past the {meta.num_tokens} packed rows")
        ends = meta.positions.to(device)[at]
        if not torch.equal(ends, start + self.ratio - 1) or bool((slot[at] != who).any()):
            raise ValueError(f"C{self.ratio} entries name rows that do not end their groups: group starts "
                             f"{start.tolist()} at rows {at.tolist()} whose positions are {ends.tolist()}")
        req = requests.to(device, torch.int64)[who]
        window = start[:, None] + torch.arange(self.ratio, device=device)
        self.entries[req, start // self.ratio] = self.features[req[:, None], window].mean(1)
        return torch.stack([req, start // self.ratio], 1)
