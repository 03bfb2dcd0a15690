"""Deprecated alias of `relayrl.transfer.plan` (removed in the next release)."""

import warnings

from relayrl.transfer.plan import *  # noqa: F403

warnings.warn(
    "relayrl.weightsync.plan moved to relayrl.transfer.plan",
    DeprecationWarning,
    stacklevel=2,
)
