"""Configuration of relayrl-gateway (the rollout-gateway)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator, model_validator

from relayrl.core.config import (
    GrpcClientConfig,
    HttpLinkConfig,
    ServiceConfig,
    StrictModel,
    TokenSourceConfig,
)
from relayrl.core.rollout_shape import RolloutShape
from relayrl.inference.config import EngineHttpConfig
from relayrl.tq.codec import check_partition_name
from relayrl.tq.config import PartitionNames, TQConfig


class KubernetesDiscoveryConfig(StrictModel):
    """Find engine replicas as the ready endpoints of a Service (`engines.kubernetes:`)."""

    service: str = Field(min_length=1, description="Name of the engines' Service.")
    namespace: str = Field(
        "default", min_length=1, description="Its namespace (the release's, usually)."
    )
    port_name: str | None = Field(
        "http",
        description="Named port of the engines' HTTP server in the EndpointSlice; null: the "
        "slice's first port.",
    )
    scheme: str = Field("http", pattern="^https?$", description="URL scheme of the engines.")
    watch_timeout_s: int = Field(
        300, ge=10, le=3600, description="Server-side timeout of one watch; then it is renewed."
    )
    api_host: str | None = Field(
        None,
        description="API server URL; null: the in-cluster service account (or ~/.kube/config).",
    )
    http: HttpLinkConfig = Field(
        default_factory=HttpLinkConfig,
        description="How a silent API server is noticed: the connect deadline, and TCP "
        "keepalive under the list and the long watch (the client's own is 165 s).",
    )


class EnginesConfig(TokenSourceConfig):
    """The engine replicas to route to (`relayrl engine` servers), called with this section's
    token when the engines check their callers (relayrl.engine.guard)."""

    urls: list[str] = Field(
        default_factory=list,
        description="Base URLs of the replicas, e.g. http://engine-0.engine:8000.",
    )
    health_interval_s: float = Field(
        5.0, gt=0.0, le=3600.0, description="Interval of each replica's health check."
    )
    unhealthy_after: int = Field(
        2, ge=1, le=100, description="Failed checks in a row that take a replica out of routing."
    )
    http: EngineHttpConfig = Field(
        default_factory=EngineHttpConfig,
        description="How a silent replica is noticed: connect, control-call and health-check "
        "deadlines, and TCP keepalive under every call, a generation's included.",
    )
    request_timeout_s: float = Field(
        600.0,
        gt=0.0,
        le=86_400.0,
        description="Longest one generate call may take before its rollout fails as infra.",
    )
    kubernetes: KubernetesDiscoveryConfig | None = Field(
        None,
        description="Also discover replicas as the ready endpoints of a Service's "
        "EndpointSlices (added and dropped at run time); needs RBAC to list and watch "
        "endpointslices.discovery.k8s.io in that namespace.",
    )
    initial_weight_version: int = Field(
        0,
        ge=0,
        description="Without weightsync: version label given at registration to a replica "
        "that has none yet (vLLM starts as 'default'). With weightsync, weight-sync labels "
        "every replica with the version it holds.",
    )
    register_interval_s: float = Field(
        2.0,
        gt=0.0,
        le=600.0,
        description="How often each healthy replica is registered with weight-sync (which "
        "reconciles it: a replica that does not hold the committed version is loaded with it "
        "before it is routed to). Keep it under weight-sync's engines.registration_ttl_s.",
    )

    @field_validator("urls")
    @classmethod
    def _http(cls, urls: list[str]) -> list[str]:
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"engine URL {url!r} must start with http:// or https://")
        if len(set(urls)) != len(urls):
            raise ValueError("engine URLs must be distinct")
        return urls


class RolloutConfig(StrictModel):
    """How prompt groups become trajectories."""

    renamed_keys = {
        "eta": "/rollout_shape.eta",
        "batch_size": "/rollout_shape.batch_groups",
        "max_response_tokens": "/rollout_shape.max_tokens",
    }

    partitions: PartitionNames = Field(
        default_factory=lambda: ["train"], description="Partitions to claim prompt groups from."
    )
    lease_s: float = Field(
        120.0, gt=0.0, le=86_400.0, description="Claim lease; renewed while a group runs."
    )
    max_inflight_groups: int = Field(
        64, ge=1, le=1_000_000, description="Groups this gateway rolls out at once."
    )
    claimer: str | None = Field(
        None, description="This gateway's claimer name; null: <hostname>-<pid>."
    )
    default_agent: str = Field(
        "single_turn", min_length=1, description="Agent loop for groups that name none."
    )
    max_turns: int = Field(4, ge=1, le=1000, description="Default cap on agent turns.")


class ExternalAgentConfig(StrictModel):
    """An agent run once per sample of the groups that name it (relayrl.gateway.external_agent):
    a program (`command`: its session's URL and token as OPENAI_BASE_URL / OPENAI_API_KEY, the
    task as JSON on stdin; it closes its session when done) or a Python coroutine function
    (`callable`: given an AsyncOpenAI client on its session and the task; its return closes the
    session)."""

    command: list[str] | None = Field(
        None, min_length=1, description="argv of the agent, e.g. [python, my_agent.py]."
    )
    callable: str | None = Field(
        None,
        description="`package.module:function`, an `async def f(client, task)` run in the "
        "gateway (a trusted agent: it shares the gateway's process).",
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Variables added to its environment (it gets only PATH, HOME, LANG, "
        "TMPDIR, PYTHONPATH and VIRTUAL_ENV of the gateway's, besides its session's).",
    )
    cwd: str | None = Field(None, description="Working directory; null: the gateway's.")
    deadline_s: float = Field(
        600.0,
        gt=0.0,
        le=86_400.0,
        description="Longest one sample's agent may run; then its process group is killed and "
        "the trajectory fails as infra.",
    )
    max_concurrent: int = Field(
        8, ge=1, le=4096, description="Agents of this kind running at once."
    )
    serve: bool = Field(
        False,
        description="One long-running process takes every sample's task (a JSON line on "
        "stdin with its session's base_url and api_key; it answers a line {session_id, error} "
        "per task) instead of one process per sample: the program starts once.",
    )

    @model_validator(mode="after")
    def _one_way_to_run(self) -> ExternalAgentConfig:
        if (self.command is None) == (self.callable is None):
            raise ValueError("give exactly one of command (a program) and callable (a function)")
        if self.serve and self.command is None:
            raise ValueError("serve goes with command (a callable runs in the gateway)")
        if self.callable is not None and (self.env or self.cwd):
            raise ValueError("env and cwd go with command; a callable runs in the gateway")
        return self


class AgentsConfig(StrictModel):
    """Agent loops and tools beyond the built-ins (by dotted path, configured by the operator)."""

    external: dict[str, ExternalAgentConfig] = Field(
        default_factory=dict,
        description="Name -> an external agent program; groups whose `agent` is the name are "
        "rolled out by it through the agent endpoint (needs agent_http.enabled).",
    )

    loops: dict[str, str] = Field(
        default_factory=dict, description="Name -> `package.module:AgentLoopClass`."
    )
    tools: dict[str, str] = Field(
        default_factory=dict, description="Name -> `package.module:ToolClass`."
    )
    tool_timeout_s: float = Field(
        30.0, gt=0.0, le=3600.0, description="A tool call running longer fails its rollout (infra)."
    )


class AgentHttpConfig(StrictModel):
    """The OpenAI-compatible HTTP endpoint for black-box agents: one session per trajectory,
    `/sessions/<id>/v1/chat/completions`, with the token accounting done by the gateway."""

    enabled: bool = Field(True, description="Serve the endpoint.")
    host: str = Field("127.0.0.1", min_length=1, description="Interface to bind; 0.0.0.0 in a pod.")
    port: int = Field(
        0, ge=0, le=65535, description="TCP port; 0 picks a free one (in the ready file)."
    )
    model_name: str = Field(
        "policy", min_length=1, description="The `model` agents must name (others get 404)."
    )
    partition: str = Field(
        "agent",
        description="Partition of the ad-hoc group a session creates when it names no claimed "
        "group (a partition of its own keeps those groups out of the rollout loop's way).",
    )
    session_idle_timeout_s: float = Field(
        600.0,
        gt=0.0,
        le=86_400.0,
        description="A session without a request for this long is aborted (failed, is_infra).",
    )
    default_max_tokens: int = Field(
        256, ge=1, le=1_000_000, description="Tokens per request when the agent names none."
    )
    max_tokens: int = Field(
        4096, ge=1, le=1_000_000, description="Most tokens one request may ask for (400 beyond)."
    )
    max_response_tokens: int = Field(
        8192,
        ge=1,
        le=10_000_000,
        description="Budget of a session's response (generated and observation tokens, all "
        "turns); a request's max_tokens is cut to what is left.",
    )
    adhoc_sessions: bool = Field(
        False,
        description="Let callers open sessions that name no claimed group. Each makes a group "
        "of one sample, which GRPO gives no advantage: for collecting or evaluating "
        "trajectories, not for training. Off: such an open is refused (403); groups of n are "
        "rolled out by the gateway's external agents (agents.external).",
    )
    open_partitions: PartitionNames | None = Field(
        None,
        description="Partitions a caller of the endpoint (HTTP, or gRPC OpenSession) may open "
        "sessions on, ad-hoc or on a group it claimed; others are refused (403). Null: only "
        "`partition`. The gateway's own external agents (agents.external) are not limited.",
    )
    segments: bool = Field(
        True,
        description="A request that extends none of the session's conversations starts a new "
        "segment of the same sample (changed tools, an edited system prompt, a rewritten "
        "scratchpad, a summarised history); every segment is trained with the sample's "
        "advantage. Off: such a request is refused (409 conversation_diverged).",
    )
    max_sessions: int = Field(
        10_000, ge=1, le=10_000_000, description="Open sessions at once (429 beyond)."
    )
    max_request_bytes: int = Field(
        16 * 1024 * 1024, ge=1024, le=1 << 30, description="Largest request body (413 beyond)."
    )

    @field_validator("partition")
    @classmethod
    def _partition(cls, name: str) -> str:
        return check_partition_name(name)

    @model_validator(mode="after")
    def _defaults_within_limits(self) -> AgentHttpConfig:
        if self.default_max_tokens > self.max_tokens:
            raise ValueError(
                f"default_max_tokens ({self.default_max_tokens}) is over max_tokens "
                f"({self.max_tokens}); lower it or raise max_tokens"
            )
        return self


class GatewayConfig(ServiceConfig):
    """rollout-gateway: claims prompt groups from the TransferQueue, rolls them out on engine
    replicas, and writes trajectories back."""

    tq: TQConfig = Field(default_factory=TQConfig, description="The TransferQueue (Redis).")
    tokenizer: Path | None = Field(
        None,
        description="Folder with the policy's tokenizer and chat template (the model folder); "
        "needed to render chat prompts and tool turns.",
    )
    engines: EnginesConfig = Field(default_factory=EnginesConfig, description="Engine replicas.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Rollouts.")
    rollout_shape: RolloutShape = Field(
        default_factory=RolloutShape,
        description="Groups per step and eta (the launch throttle, until the trainer says), "
        "the response budget of a group that names none; the trainer's config holds the same "
        "model and must hold the same values.",
    )
    agents: AgentsConfig = Field(default_factory=AgentsConfig, description="Agent loops, tools.")
    agent_http: AgentHttpConfig = Field(
        default_factory=AgentHttpConfig, description="OpenAI-compatible endpoint for agents."
    )
    weightsync: GrpcClientConfig | None = Field(
        None,
        description="relayrl-weightsync: every healthy replica is registered with it, and a "
        "replica is routed to only once weight-sync says it holds the committed version. "
        "Null: a healthy replica serves at once with the weights it holds (no weight updates "
        "reach it).",
    )

    @model_validator(mode="after")
    def _external_agents_have_an_endpoint(self) -> GatewayConfig:
        external = self.agents.external
        if external and not self.agent_http.enabled:
            raise ValueError(
                f"agents.external ({', '.join(sorted(external))}) talk to the agent endpoint: "
                "set agent_http.enabled: true"
            )
        clash = sorted(set(external) & set(self.agents.loops))
        if clash:
            raise ValueError(f"agents.external and agents.loops both name {clash}")
        return self

    @model_validator(mode="after")
    def _agent_http_port_free(self) -> GatewayConfig:
        http = self.agent_http
        taken = {"grpc": (self.grpc.host, self.grpc.port)}
        if self.metrics.enabled:
            taken["metrics"] = (self.metrics.host, self.metrics.port)
        for name, address in taken.items():
            if http.enabled and http.port != 0 and (http.host, http.port) == address:
                raise ValueError(
                    f"agent_http.port and {name}.port are both {http.port} on {http.host}; "
                    "give them different ports"
                )
        return self
