"""Who may call what: the roles of the system and each gRPC service's access table.

A server with authentication (`auth.type: static_token` or `mtls`) first names the caller (a
principal), then allows the call only if one of the principal's roles is listed for the method
here; anything else is PERMISSION_DENIED with a message naming the roles the method is for. A
principal's roles are its own name unless the server's `auth.roles` lists others, so a
deployment that names its callers after their roles (`trainer`, `weightsync`, ...) needs no
mapping. A method missing from a table is refused to everyone.

The tables follow the data flow (docs/security.md explains each line): only the trainer
publishes weights, only engines (with a token weight-sync mints for that one transfer) pull
them, only weight-sync and the trainer pause and resume the gateway's replicas, only operators
stop the trainer or drain a replica by hand, and the reward API serves every authenticated
tenant.
"""

from __future__ import annotations

from relayrl.core.interceptors import ANY_PRINCIPAL, AccessPolicy, access_table

TRAINER = "trainer"
WEIGHTSYNC = "weightsync"
GATEWAY = "gateway"
ENGINE = "engine"
"""An engine's workers pulling a version; weight-sync mints its token per transfer."""
OPERATOR = "operator"
"""A person or tool running the system: status, stop, drain (`relayrl up` itself)."""
AGENT = "agent"
"""A program opening agent sessions on the gateway."""
ROLES = (TRAINER, WEIGHTSYNC, GATEWAY, ENGINE, OPERATOR, AGENT)

WEIGHTSYNC_ACCESS = access_table(
    "relayrl.proto.weightsync.v1.WeightSync",
    RegisterSender=(TRAINER,),
    RegisterEngine=(GATEWAY, OPERATOR),
    Publish=(TRAINER,),
    PushBuckets=(TRAINER,),
    GetBucketPlan=(TRAINER, ENGINE),
    PullBuckets=(ENGINE,),
    AckVersion=(ENGINE,),
    GetVersion=(TRAINER, GATEWAY, ENGINE, OPERATOR),
)
TRAINER_ACCESS = access_table(
    "relayrl.proto.trainer.v1.Trainer",
    GetStatus=(OPERATOR,),
    Control=(OPERATOR,),
)
GATEWAY_ACCESS = access_table(
    "relayrl.proto.rollout.v1.RolloutGateway",
    GetStatus=(OPERATOR, TRAINER, WEIGHTSYNC),
    ListReplicas=(OPERATOR, WEIGHTSYNC),
    UpdatePolicyStep=(TRAINER,),
    PauseReplicas=(WEIGHTSYNC, TRAINER),
    ResumeReplicas=(WEIGHTSYNC, TRAINER),
    DrainReplica=(WEIGHTSYNC, OPERATOR),
    OpenSession=(AGENT,),
    CloseSession=(AGENT,),
    AbortSession=(AGENT,),
)
REWARD_ACCESS = access_table(
    "relayrl.proto.reward.v1.RewardService",
    Score=(ANY_PRINCIPAL,),
    Submit=(ANY_PRINCIPAL,),
    Collect=(ANY_PRINCIPAL,),
    ScoreStream=(ANY_PRINCIPAL,),
    ListManagers=(ANY_PRINCIPAL,),
)
ACCESS: dict[str, AccessPolicy] = {
    "weightsync": WEIGHTSYNC_ACCESS,
    "trainer": TRAINER_ACCESS,
    "gateway": GATEWAY_ACCESS,
    "reward": REWARD_ACCESS,
}
"""Each service's table, by the service's short name."""
