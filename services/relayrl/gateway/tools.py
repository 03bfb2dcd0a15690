"""Deprecated alias of `relayrl.conversation.tools` (removed in the next release)."""

import warnings

from relayrl.conversation.tools import *  # noqa: F403

warnings.warn(
    "relayrl.gateway.tools moved to relayrl.conversation.tools",
    DeprecationWarning,
    stacklevel=2,
)
