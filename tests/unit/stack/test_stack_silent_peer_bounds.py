"""docs/recovery.md#silent-peers, as defaults: every bound that notices a silent peer is at
most 30 s, and a fault that heals within the longest of them and one recovery stays inside the
trainer's stop rules."""

from __future__ import annotations

from relayrl.core.config import GrpcClientConfig, GrpcServerConfig
from relayrl.dataplane.transports.base import PEER_KEEPALIVE
from relayrl.gateway.config import GatewayConfig, KubernetesDiscoveryConfig
from relayrl.reward.managers.judge import RemoteConfig
from relayrl.tq import TQConfig
from relayrl.trainer.config import WeightSyncPublishConfig
from relayrl.trainer.progress import ProgressConfig
from relayrl.weightsync.config import WeightSyncConfig

RECOVERY_S = 30.0
"""The slowest recovery that follows a bound: an engine restart with its reload (20-30 s here)."""


def silent_peer_bounds() -> dict[str, float]:
    tq = TQConfig()
    gateway_engines = GatewayConfig().engines.http
    weightsync_engines = WeightSyncConfig().engines.http
    judge = RemoteConfig(base_url="http://judge:8000", model="judge").http
    return {
        "tq.connect_timeout_s": tq.connect_timeout_s,
        "tq.socket_timeout_s": tq.socket_timeout_s,
        "grpc client keepalive": GrpcClientConfig(target="x:1").keepalive.silent_peer_s,
        "grpc client default_timeout_s": GrpcClientConfig(target="x:1").default_timeout_s,
        "grpc server keepalive": GrpcServerConfig().keepalive.silent_peer_s,
        "trainer publish.keepalive": WeightSyncPublishConfig(
            type="weightsync", target="x:1"
        ).keepalive.silent_peer_s,
        "gateway engines.http.connect_timeout_s": gateway_engines.connect_timeout_s,
        "gateway engines.http.control_timeout_s": gateway_engines.control_timeout_s,
        "gateway engines.http.health_timeout_s": gateway_engines.health_timeout_s,
        "gateway engines.http.tcp_keepalive": gateway_engines.tcp_keepalive.silent_peer_s,
        "weightsync engines.http.control_timeout_s": weightsync_engines.control_timeout_s,
        "weightsync engines.http.tcp_keepalive": weightsync_engines.tcp_keepalive.silent_peer_s,
        "judge http.connect_timeout_s": judge.connect_timeout_s,
        "judge http.tcp_keepalive": judge.tcp_keepalive.silent_peer_s,
        "kubernetes http": KubernetesDiscoveryConfig(service="e").http.tcp_keepalive.silent_peer_s,
        "data plane PEER_KEEPALIVE": PEER_KEEPALIVE.silent_peer_s,
    }


def test_every_default_silent_peer_bound_is_at_most_30_s() -> None:
    over = {name: s for name, s in silent_peer_bounds().items() if s > 30}
    assert not over


def test_a_fault_healed_within_the_bounds_trips_no_stop_rule() -> None:
    healed_s = max(silent_peer_bounds().values()) + RECOVERY_S
    progress = ProgressConfig()
    assert healed_s < progress.infra_grace_s < progress.stall_min_s
