"""Batches: a deterministic, resumable stream of training windows, and fixed per-domain evaluation windows.

Training packs documents back to back (each starts with BOS) and cuts non-overlapping windows of seq_len + 1
tokens, visited in a seeded permutation per epoch. Sample i of the run is a pure function of (seed, i), so the
data position is just the number of samples consumed: resuming, or changing the world size at a fixed global
batch, sees exactly the same sequences.
"""

from __future__ import annotations

import numpy as np
import torch

from moe_lm.data.shards import TokenShard
from moe_lm.errors import DataError


class TrainWindows:
    def __init__(self, shard: TokenShard, seq_len: int, seed: int) -> None:
        self.tokens = shard.tokens
        self.seq_len = seq_len
        self.seed = seed
        self.n_windows = (len(self.tokens) - 1) // seq_len
        if self.n_windows < 1:
            raise DataError(f"the training split has {len(self.tokens)} tokens, fewer than one window of {seq_len + 1}")
        self._perm_epoch, self._perm = -1, None

    def sample(self, i: int) -> np.ndarray:
        """Window number i of the run: [seq_len + 1] tokens."""
        epoch, j = divmod(i, self.n_windows)
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)
            self._perm_epoch = epoch
        start = int(self._perm[j]) * self.seq_len
        return np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int64)

    def batch(self, first: int, n: int) -> torch.Tensor:
        """Samples first .. first + n - 1 as a LongTensor [n, seq_len + 1]."""
        return torch.from_numpy(np.stack([self.sample(i) for i in range(first, first + n)]))


def eval_windows(shard: TokenShard, seq_len: int, per_domain: int) -> dict[str, torch.Tensor]:
    """Up to `per_domain` fixed windows [n, seq_len + 1] per domain, cut from that domain's validation documents.

    A domain with less validation text than one window gets one shorter window of all of it (never a silent
    zero); a domain with no validation documents has no entry (the caller says so).
    """
    out = {}
    for domain in shard.domains:
        docs = shard.domain_docs(domain)
        if len(docs) == 0:
            continue
        stream = np.concatenate([np.asarray(shard.document(d), dtype=np.int64) for d in docs])
        if len(stream) < 2:
            continue
        window = min(seq_len, len(stream) - 1)
        n = min(per_domain, (len(stream) - 1) // window)
        out[domain] = torch.from_numpy(np.stack([stream[i * window : i * window + window + 1] for i in range(n)]))
    return out
