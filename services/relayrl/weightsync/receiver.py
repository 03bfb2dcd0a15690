"""Deprecated alias of `relayrl.transfer.receiver` (removed in the next release)."""

import warnings

from relayrl.transfer.receiver import *  # noqa: F403

warnings.warn(
    "relayrl.weightsync.receiver moved to relayrl.transfer.receiver",
    DeprecationWarning,
    stacklevel=2,
)
