"""The closed sets the core labels things with: tiers, miss reasons, eviction reasons.

Their own module, importing nothing else of the package (no compiled core, no torch), so the
client, the stats schema and the services name a tier or a reason without loading the index or
the tiers. They are also the only label values stats carry (stats.py), never prompts or ids.
"""

from __future__ import annotations

import enum


class TierKind(enum.IntEnum):
    """Tiers from fastest to slowest; a block spills to the next one."""

    DEVICE = 0
    HOST = 1
    REDIS = 2

    @property
    def label(self) -> str:
        return self.name.lower()


class MissReason(enum.Enum):
    """Why a lookup stopped before the prompt's last full block."""

    TOO_SHORT = "shorter_than_block"
    NOT_CACHED = "not_cached"
    EXPIRED = "expired"
    VERIFICATION_FAILED = "verification_failed"


class EvictionReason(enum.Enum):
    """Why a block left a tier."""

    LRU = "lru"  # chosen by LRU order to make room in a full tier
    TTL = "ttl"  # its sliding time-to-live ran out
    CAPACITY = "capacity"  # dropped because the tenant's quota in that tier was full
    MANUAL = "manual"  # an Evict or Flush call
