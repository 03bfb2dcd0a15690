"""Deprecated alias of `relayrl.inference.client` (removed in the next release)."""

import warnings

from relayrl.inference.client import *  # noqa: F403

warnings.warn(
    "relayrl.engine.client moved to relayrl.inference.client",
    DeprecationWarning,
    stacklevel=2,
)
