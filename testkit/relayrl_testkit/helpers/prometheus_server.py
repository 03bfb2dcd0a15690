"""A real Prometheus server (Debian's package) for tests: its own data dir and free loopback
port, stopped by PID; and the translation of the chart's ServiceMonitors into a static scrape
config that keeps their relabelings, so what a test sees is what the operator would scrape."""

from __future__ import annotations

import json
import re
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from relayrl.core.ports import free_port

_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))

# prometheus-operator's RelabelConfig fields -> Prometheus' relabel_config keys
_RELABEL_KEYS = {
    "sourceLabels": "source_labels",
    "separator": "separator",
    "targetLabel": "target_label",
    "regex": "regex",
    "modulus": "modulus",
    "replacement": "replacement",
    "action": "action",
}


def _relabel(config: dict[str, Any]) -> dict[str, Any]:
    unknown = set(config) - set(_RELABEL_KEYS)
    if unknown:
        raise ValueError(f"relabeling field(s) {sorted(unknown)} not understood")
    out = {_RELABEL_KEYS[key]: value for key, value in config.items()}
    if "action" in out:
        out["action"] = str(out["action"]).lower()
    return out


def _label_name(label: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", label)


@dataclass(frozen=True)
class LocalTarget:
    """Where one Service's pods are on this machine: host:port per named container port."""

    service: dict[str, Any]  # the rendered Service object
    pod_name: str
    ports: dict[str, str]  # port name -> "127.0.0.1:12345"


def scrape_configs(
    service_monitors: list[dict[str, Any]], targets: list[LocalTarget], interval: str
) -> list[dict[str, Any]]:
    """One job per ServiceMonitor endpoint, as prometheus-operator would generate it: the
    Kubernetes discovery labels a pod behind the Service would have become static `__meta_*`
    labels, then the operator's own relabelings (namespace, service, pod, endpoint, job), then
    the ServiceMonitor's. `interval` replaces the monitors' own (a test cannot wait 15 s per
    sample)."""
    jobs = []
    for monitor in service_monitors:
        meta, spec = monitor["metadata"], monitor["spec"]
        wanted = spec["selector"].get("matchLabels", {})
        matched = [
            t
            for t in targets
            if all(t.service["metadata"].get("labels", {}).get(k) == v for k, v in wanted.items())
        ]
        if not matched:
            raise AssertionError(f"ServiceMonitor {meta['name']} selects no Service: {wanted}")
        for number, endpoint in enumerate(spec["endpoints"]):
            static = []
            for target in matched:
                service_meta = target.service["metadata"]
                if endpoint["port"] not in target.ports:
                    raise AssertionError(
                        f"ServiceMonitor {meta['name']} scrapes port {endpoint['port']!r}, "
                        f"which Service {service_meta['name']} does not expose"
                    )
                labels = {
                    "__meta_kubernetes_namespace": service_meta.get("namespace", "default"),
                    "__meta_kubernetes_service_name": service_meta["name"],
                    "__meta_kubernetes_pod_name": target.pod_name,
                    "__meta_kubernetes_endpoint_port_name": endpoint["port"],
                }
                for key, value in service_meta.get("labels", {}).items():
                    labels[f"__meta_kubernetes_service_label_{_label_name(key)}"] = value
                static.append({"targets": [target.ports[endpoint["port"]]], "labels": labels})
            # job: the Service label named by jobLabel, else the Service's name
            job_source = (
                f"service_label_{_label_name(spec['jobLabel'])}"
                if spec.get("jobLabel")
                else "service_name"
            )
            operator_relabelings = [
                {"source_labels": [f"__meta_kubernetes_{what}"], "target_label": label}
                for what, label in (
                    ("namespace", "namespace"),
                    ("service_name", "service"),
                    ("pod_name", "pod"),
                    ("endpoint_port_name", "endpoint"),
                    (job_source, "job"),
                )
            ]
            jobs.append(
                {
                    "job_name": f"serviceMonitor/{meta.get('namespace', 'default')}/"
                    f"{meta['name']}/{number}",
                    "scrape_interval": interval,
                    "metrics_path": endpoint.get("path", "/metrics"),
                    "scheme": endpoint.get("scheme", "http"),
                    "static_configs": static,
                    "relabel_configs": operator_relabelings
                    + [_relabel(r) for r in endpoint.get("relabelings", [])],
                    "metric_relabel_configs": [
                        _relabel(r) for r in endpoint.get("metricRelabelings", [])
                    ],
                }
            )
    return jobs


class PrometheusServer:
    def __init__(self, binary: Path, workdir: Path) -> None:
        self.binary = binary
        self.workdir = workdir
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(
        self, scrape: list[dict[str, Any]], rules: list[Path], interval: str = "1s"
    ) -> PrometheusServer:
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = {
            "global": {
                "scrape_interval": interval,
                "scrape_timeout": interval,
                "evaluation_interval": interval,
            },
            "rule_files": [str(path) for path in rules],
            "scrape_configs": scrape,
        }
        config_path = self.workdir / "prometheus.yml"
        config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        log = (self.workdir / "prometheus.log").open("wb")
        self.process = subprocess.Popen(
            [
                str(self.binary),
                f"--config.file={config_path}",
                f"--storage.tsdb.path={self.workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--web.enable-lifecycle",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"prometheus exited {self.process.returncode}:\n{self.log()}")
            try:
                with _NO_PROXY.open(f"{self.url}/-/ready", timeout=2) as reply:
                    if reply.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        raise AssertionError(f"prometheus not ready in 60 s:\n{self.log()}")

    def log(self) -> str:
        path = self.workdir / "prometheus.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    def api(self, path: str, **params: Any) -> Any:
        query = urllib.parse.urlencode(params)
        with _NO_PROXY.open(f"{self.url}/api/v1/{path}?{query}", timeout=30) as reply:
            body = json.loads(reply.read())
        if body.get("status") != "success":
            raise AssertionError(f"{path} {params}: {body}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        params: dict[str, Any] = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        return self.api("query", **params)["result"]

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
