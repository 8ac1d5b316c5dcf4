"""Which backends one exporter replica watches when several share a fleet.

Replica `index` of `total` owns the backends whose name hashes to `index` with the hash
of Prometheus' `hashmod` relabel action: the MD5 of the value, its last 8 bytes read as
a big-endian unsigned integer, modulo `total`. So the split a config's `shard:` makes is
the split this relabelling makes of the same names, and `/probe` targets (or a scrape
job) can be divided the same way by Prometheus itself:

```yaml
relabel_configs:
  - source_labels: [backend]        # one value: no separator is joined in
    modulus: 2
    target_label: __tmp_shard
    action: hashmod
  - source_labels: [__tmp_shard]
    regex: "0"                      # this replica's index
    action: keep
```

No coordinator: every replica computes the same answer from the name alone. Two
replicas with the same `index` are an HA pair: both watch the same backends, and the
rules aggregate them away (`max without (instance)`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass


def hashmod(value: str, modulus: int) -> int:
    """Prometheus' `hashmod` of one label value (relabel.go: md5, last 8 bytes, big endian)."""
    if modulus < 1:
        raise ValueError(f"modulus must be at least 1, got {modulus}")
    digest = hashlib.md5(value.encode("utf-8"), usedforsecurity=False).digest()
    return int.from_bytes(digest[8:], "big") % modulus


@dataclass(frozen=True)
class Shard:
    """`index` of `total`; the default, 0 of 1, owns every backend."""

    index: int = 0
    total: int = 1

    def __post_init__(self) -> None:
        if self.total < 1 or not 0 <= self.index < self.total:
            raise ValueError(f"shard index must be in 0..{self.total - 1} (total {self.total}), got {self.index}")

    def owns(self, backend: str) -> bool:
        return self.total == 1 or hashmod(backend, self.total) == self.index

    def __str__(self) -> str:
        return f"{self.index}/{self.total}"
