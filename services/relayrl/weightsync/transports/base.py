"""Deprecated alias of `relayrl.transfer.transports.base` (removed in the next release)."""

import warnings

from relayrl.transfer.transports.base import *  # noqa: F403

warnings.warn(
    "relayrl.weightsync.transports.base moved to relayrl.transfer.transports.base",
    DeprecationWarning,
    stacklevel=2,
)
