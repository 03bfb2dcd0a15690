"""`relayrl-weightsync`: weight-sync: streams each new policy version into every engine."""

from relayrl.core.service_cli import service_command

main = service_command(
    "relayrl-weightsync",
    description="weight-sync: streams each new policy version into every engine.",
    config="relayrl.weightsync.config:WeightSyncConfig",
    serve="relayrl.weightsync.server:serve",
)
