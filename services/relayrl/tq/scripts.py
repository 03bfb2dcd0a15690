"""Loads the TransferQueue's Lua scripts and turns their error replies into typed exceptions."""

from __future__ import annotations

from importlib import resources

import redis
import redis.asyncio as aioredis
from redis.commands.core import AsyncScript, Script

from relayrl.tq.errors import (
    ConflictError,
    IllegalTransitionError,
    InvalidInputError,
    StaleClaimError,
    UnknownKeyError,
    UnknownPartitionError,
)

# Scripts that operate on one partition and share the prelude's calling convention.
PARTITION_SCRIPTS = (
    "put_groups",
    "claim_groups",
    "claim_named",
    "put_and_claim",
    "renew_leases",
    "end_claims",
    "requeue_expired",
    "release_claimer",
    "move_groups",
    "put_trajectories",
    "score_trajectories",
    "consume",
    "reset_consumption",
)
# Scripts with their own calling convention (no prelude).
STANDALONE_SCRIPTS = ("reclaim", "redrive", "leases", "read_trajectories")


def _source(name: str) -> str:
    return resources.files("relayrl.tq").joinpath("lua", f"{name}.lua").read_text()


def load_scripts(client: redis.Redis | aioredis.Redis) -> dict[str, Script | AsyncScript]:
    """Registers every script with the client, sync or asyncio (EVALSHA, reloaded after a Redis
    restart)."""
    prelude = _source("prelude")
    scripts = {
        name: client.register_script(f"{prelude}\n{_source(name)}") for name in PARTITION_SCRIPTS
    }
    scripts.update({name: client.register_script(_source(name)) for name in STANDALONE_SCRIPTS})
    return scripts


def translate_error(partition: str, error: redis.ResponseError) -> Exception:
    """Maps a script's 'RELAYRL <code> <fields...>' error reply to a TransferQueue exception."""
    code, *fields = str(error).split("\t")
    if code != "RELAYRL" or not fields:
        return error
    kind, *args = fields
    match kind, args:
        case "UNKNOWN_PARTITION", [name]:
            return UnknownPartitionError(name)
        case "UNKNOWN_KEY", [key]:
            return UnknownKeyError(partition, key)
        case "CONFLICT", [key]:
            return ConflictError(partition, key)
        case "ILLEGAL_TRANSITION", [key, current, requested]:
            return IllegalTransitionError(partition, key, current, requested)
        case "STALE_CLAIM", [key, current, requested, detail]:
            return StaleClaimError(partition, key, current, requested, detail)
        case "BAD_INDEX", [key, index, num_samples]:
            return InvalidInputError(
                f"trajectory {partition}/{key}: index {index} is outside its group's "
                f"{num_samples} samples"
            )
        case "DUPLICATE_KEY", [key]:
            return InvalidInputError(f"{partition}/{key} appears twice in one request")
    return error
