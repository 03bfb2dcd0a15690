"""A private redis-server process with AOF on its own data directory, tracked by PID.

Used by the test fixtures, the benchmarks and `relayrl up`: each gets a server it can kill and
restart on the same data directory, never the machine's shared Redis.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Literal

import redis
import redis.asyncio as aioredis

from relayrl.core.ports import free_port


class RedisServerError(RuntimeError):
    pass


@dataclasses.dataclass(frozen=True)
class RedisTls:
    """TLS of a RedisServer: it then listens with TLS only (on its one port)."""

    cert_file: Path
    key_file: Path
    ca_file: Path
    require_client_cert: bool = False

    def args(self, port: int) -> list[str]:
        return [
            "--port", "0", "--tls-port", str(port),
            "--tls-cert-file", str(self.cert_file), "--tls-key-file", str(self.key_file),
            "--tls-ca-cert-file", str(self.ca_file),
            "--tls-auth-clients", "yes" if self.require_client_cert else "no",
        ]  # fmt: skip


class RedisServer:
    """One redis-server child process. Data (AOF) lives under `data_dir`, so a server killed
    with SIGKILL and started again on the same directory recovers what it had acknowledged."""

    def __init__(
        self,
        data_dir: str | Path,
        *,
        port: int = 0,
        host: str = "127.0.0.1",
        appendfsync: Literal["everysec", "always", "no"] = "everysec",
        executable: str = "redis-server",
        password: str | None = None,
        extra_args: tuple[str, ...] = (),
        tls: RedisTls | None = None,
    ) -> None:
        # Absolute: redis-server changes into --dir before it opens --logfile, so a relative
        # log path would name a file inside the data dir's own copy of that path.
        self.data_dir = Path(data_dir).absolute()
        self.host = host
        self.port = port or free_port(host)
        self.appendfsync = appendfsync
        self._executable = executable
        self.password = password
        self._extra_args = extra_args
        self.tls = tls
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        scheme = "rediss" if self.tls else "redis"
        return f"{scheme}://{self.host}:{self.port}/0"

    @property
    def pid(self) -> int | None:
        """None before `start()` and after `stop()` or `kill()`."""
        return self._process.pid if self._process else None

    def alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def exit_code(self) -> int | None:
        """Once it exited by itself; None while it runs, before `start()` and after `stop()`."""
        return None if self._process is None else self._process.poll()

    @property
    def log_path(self) -> Path:
        return self.data_dir / "redis.log"

    def _command(self) -> list[str]:
        binary = shutil.which(self._executable)
        if binary is None:
            raise RedisServerError(
                f"{self._executable} not found on PATH: run `make setup` (installs redis-server)"
            )
        listen = self.tls.args(self.port) if self.tls else ["--port", str(self.port)]
        return [
            binary,
            *listen,
            "--bind",
            self.host,
            "--dir",
            str(self.data_dir),
            "--appendonly",
            "yes",
            "--appendfsync",
            self.appendfsync,
            "--save",
            "",
            "--daemonize",
            "no",
            "--logfile",
            str(self.log_path),
            *(["--requirepass", self.password] if self.password else []),
            *self._extra_args,
        ]

    def start(self, timeout_s: float = 10.0) -> None:
        if self._process and self._process.poll() is None:
            raise RedisServerError(f"redis-server already running (pid {self._process.pid})")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        # Its own session: a Ctrl-C meant for the parent (`relayrl up`) must not reach it;
        # the parent stops it, after the services that write to it.
        self._process = subprocess.Popen(
            self._command(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            self._wait_ready(timeout_s)
        except BaseException:
            self.kill()  # never leave a half-started server behind
            raise

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        client = self.client(socket_connect_timeout=0.5)
        try:
            while time.monotonic() < deadline:
                if self._process is None or self._process.poll() is not None:
                    raise RedisServerError(
                        f"redis-server exited at start (code {self._process.returncode}); "
                        f"see {self.log_path}"
                    )
                try:
                    # LOADING while it replays the AOF: keep waiting.
                    if client.ping():
                        return
                except (redis.ConnectionError, redis.BusyLoadingError):
                    time.sleep(0.02)
            raise RedisServerError(
                f"redis-server not ready after {timeout_s}s; see {self.log_path}"
            )
        finally:
            client.close()

    def client(self, **kwargs: Any) -> redis.Redis:
        return redis.Redis(**self._client_options(kwargs))

    def async_client(self, **kwargs: Any) -> aioredis.Redis:
        """A redis.asyncio client of the server (for an AsyncTransferQueue), with `client`'s
        options; use it from one event loop."""
        return aioredis.Redis(**self._client_options(kwargs))

    def _client_options(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        if self.tls is not None:
            # its own client: the server's certificate (with the client's when it asks for one)
            kwargs = {"ssl": True, "ssl_ca_certs": str(self.tls.ca_file), **kwargs}
            if self.tls.require_client_cert:
                kwargs.setdefault("ssl_certfile", str(self.tls.cert_file))
                kwargs.setdefault("ssl_keyfile", str(self.tls.key_file))
        return {"host": self.host, "port": self.port, "password": self.password, **kwargs}

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM: Redis flushes and fsyncs the AOF, then exits."""
        self._signal_and_wait(signal.SIGTERM, timeout_s)

    def kill(self) -> None:
        """SIGKILL: a crash. Only what reached the AOF survives."""
        self._signal_and_wait(signal.SIGKILL, 10.0)

    def _signal_and_wait(self, sig: signal.Signals, timeout_s: float) -> None:
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        os.kill(process.pid, sig)
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.kill(process.pid, signal.SIGKILL)
            process.wait()

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
