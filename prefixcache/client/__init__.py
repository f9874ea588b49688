"""Worker-side client of the prefix-cache service; see `api.py` for usage.

This package may import grpc (it is not part of the core library); the core
(hashing, index, tiers, cache, config) never imports it.
"""

from ..wire import ServiceStats
from .api import Attachment, BlockInfo, CacheClient, Hit, InspectReport, MatchReport, PinInfo, Reservation
from .errors import CacheUnavailable, PermissionDenied, ServiceError, Unauthenticated

__all__ = [
    "Attachment",
    "BlockInfo",
    "CacheClient",
    "CacheUnavailable",
    "Hit",
    "InspectReport",
    "MatchReport",
    "PinInfo",
    "PermissionDenied",
    "Reservation",
    "ServiceError",
    "ServiceStats",
    "Unauthenticated",
]
