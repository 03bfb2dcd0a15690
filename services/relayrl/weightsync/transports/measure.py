"""Deprecated alias of `relayrl.transfer.transports.measure` (removed in the next release)."""

import warnings

from relayrl.transfer.transports.measure import *  # noqa: F403

warnings.warn(
    "relayrl.weightsync.transports.measure moved to relayrl.transfer.transports.measure",
    DeprecationWarning,
    stacklevel=2,
)

if __name__ == "__main__":  # `python -m relayrl.weightsync.transports.measure` still runs
    main()  # noqa: F405
