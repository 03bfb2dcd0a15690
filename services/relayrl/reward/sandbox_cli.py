"""`relayrl-sandbox`: runs candidate code for a reward-service that cannot isolate it itself
(relayrl.reward.sandbox_service)."""

from relayrl.core.service_cli import service_command

main = service_command(
    "relayrl-sandbox",
    description="the code sandbox: runs candidate code for the reward-service's "
    "sandbox_remote managers, over a unix socket.",
    config="relayrl.reward.sandbox_service:SandboxServiceConfig",
    serve="relayrl.reward.sandbox_service:serve",
)
