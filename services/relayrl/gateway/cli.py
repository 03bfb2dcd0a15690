"""`relayrl-gateway`: the rollout-gateway: prompt groups in, trajectories out, on vLLM engines."""

from relayrl.core.service_cli import service_command

main = service_command(
    "relayrl-gateway",
    description="the rollout-gateway: prompt groups in, trajectories out, on vLLM engines.",
    config="relayrl.gateway.config:GatewayConfig",
    serve="relayrl.gateway.server:serve",
)
