"""Deprecated alias of `relayrl.transfer.quant` (removed in the next release)."""

import warnings

from relayrl.transfer.quant import *  # noqa: F403

warnings.warn(
    "relayrl.weightsync.quant moved to relayrl.transfer.quant",
    DeprecationWarning,
    stacklevel=2,
)
