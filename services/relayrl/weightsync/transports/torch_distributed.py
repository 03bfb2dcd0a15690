"""Deprecated alias of `relayrl.transfer.transports.torch_distributed` (removed next release)."""

import warnings

from relayrl.transfer.transports.torch_distributed import *  # noqa: F403

warnings.warn(
    "relayrl.weightsync.transports.torch_distributed moved to "
    "relayrl.transfer.transports.torch_distributed",
    DeprecationWarning,
    stacklevel=2,
)
