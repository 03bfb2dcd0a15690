"""Deprecated alias of `relayrl.transfer.transports.mooncake` (removed in the next release)."""

import warnings

from relayrl.transfer.transports.mooncake import *  # noqa: F403

warnings.warn(
    "relayrl.weightsync.transports.mooncake moved to relayrl.transfer.transports.mooncake",
    DeprecationWarning,
    stacklevel=2,
)
