"""Engine replica identity shared by every service.

A replica has one id everywhere: in the gateway's pool, in weight-sync's registry, in every
metric label and log line, and in each trajectory's generation spans. Replicas discovered
from a Kubernetes Service are named by their pod; replicas listed in a config file by
`static_replica_ids`, so the gateway and weight-sync derive the same id from the same list.
"""

from __future__ import annotations

from collections.abc import Sequence


def static_replica_ids(urls: Sequence[str]) -> dict[str, str]:
    """replica id -> URL for engines listed in a config: `engine-<index>`, in list order."""
    return {f"engine-{index}": url for index, url in enumerate(urls)}
