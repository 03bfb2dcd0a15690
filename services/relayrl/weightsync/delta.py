"""Deprecated alias of `relayrl.transfer.delta` (removed in the next release)."""

import warnings

from relayrl.transfer.delta import *  # noqa: F403

warnings.warn(
    "relayrl.weightsync.delta moved to relayrl.transfer.delta",
    DeprecationWarning,
    stacklevel=2,
)
