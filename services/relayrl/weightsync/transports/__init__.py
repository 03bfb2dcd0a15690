"""Deprecated alias of `relayrl.transfer.transports` (removed in the next release)."""

import warnings

from relayrl.transfer.transports import *  # noqa: F403

warnings.warn(
    "relayrl.weightsync.transports moved to relayrl.transfer.transports",
    DeprecationWarning,
    stacklevel=2,
)
