"""A stand-in for the Docker Engine API, for machines where no Docker daemon runs.

It lets the container provider run end to end: the Docker SDK and testcontainers talk HTTP to
it over a unix socket exactly as they would to a daemon, and it answers the part of the Engine
API they use (version, images, containers, exec, logs, networks). Instead of isolating a
process it runs the real thing on the host:

- a ``postgres`` image "runs" as a throwaway PostgreSQL cluster from this machine's server
  binaries (``lab.pg.cluster.start_embedded``), initialised as the official image's entrypoint
  would from ``POSTGRES_USER``, ``POSTGRES_PASSWORD`` and ``POSTGRES_DB``, with the ``-c``
  settings of its command applied; its port 5432 is "published" as the cluster's port on
  127.0.0.1;
- an exec runs its command on the host with ``PGPORT`` set to that port, so a ``psql`` that
  targets 127.0.0.1:5432 inside the container reaches the same server;
- a Ryuk image (testcontainers' reaper) listens on 127.0.0.1, takes label filters, answers
  ``ACK``, and once every connection has closed and none came back within
  ``RYUK_RECONNECTION_TIMEOUT`` it removes the containers those filters match, as Ryuk does.

Images come from a small built-in "registry": each repository maps tags to a content digest,
and a pull of a tag or digest it does not list fails with ``manifest unknown``. Requests it does
not emulate are answered 501 naming the request, so a new SDK call fails loudly rather than
being half-served. Only tests use it; the socket lives in a private 0700 directory.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.server
import json
import os
import re
import secrets
import shlex
import shutil
import socket
import socketserver
import struct
import subprocess
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import conninfo, sql

from lab.pg import cluster

API_VERSION = "1.47"
MIN_API_VERSION = "1.24"
_STDOUT, _STDERR = 1, 2
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


class EngineError(Exception):
    """A request the engine refuses, with the HTTP status a daemon would answer."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def default_registry() -> dict[str, dict[str, str]]:
    """The pinned PostgreSQL image (tag and digest as pinned) and testcontainers' Ryuk image."""
    from testcontainers.core.config import testcontainers_config

    registry: dict[str, dict[str, str]] = {}
    for reference in (cluster.POSTGRES_IMAGE, testcontainers_config.ryuk_image):
        repository, tag, digest = parse_reference(reference)
        digest = digest or "sha256:" + hashlib.sha256(reference.encode()).hexdigest()
        registry.setdefault(repository, {})[tag or "latest"] = digest
    return registry


def parse_reference(reference: str) -> tuple[str, str | None, str | None]:
    """Split ``repo[:tag][@digest]`` into its parts (a registry host's port is not a tag)."""
    name, _, digest = reference.partition("@")
    repository, tag = name, None
    slash = name.rfind("/")
    colon = name.rfind(":")
    if colon > slash:
        repository, tag = name[:colon], name[colon + 1 :]
    return repository, tag, digest or None


def go_duration(text: str, default: float) -> float:
    """Seconds in a Go duration such as ``10s``, ``1m30s`` or ``500ms``."""
    parts = _DURATION_PART.findall(text.strip())
    if not parts or "".join(n + u for n, u in parts) != text.strip():
        return default
    return sum(float(number) * _DURATION_UNITS[unit] for number, unit in parts)


def _frame(stream: int, data: bytes) -> bytes:
    return struct.pack(">BxxxL", stream, len(data)) + data


@dataclass
class Image:
    """A pulled image: its id, repository, tags and content digest."""

    id: str
    repository: str
    digest: str
    tags: list[str] = field(default_factory=list)

    def inspect(self) -> dict[str, Any]:
        return {
            "Id": self.id,
            "RepoTags": list(self.tags),
            "RepoDigests": [f"{self.repository}@{self.digest}"],
            "Created": "2026-01-01T00:00:00Z",
            "Config": {"Env": [], "Cmd": None},
            "Os": "linux",
            "Architecture": "amd64",
        }


@dataclass
class Container:
    """A created container and what runs it on the host once started."""

    id: str
    name: str
    reference: str
    image: Image
    command: list[str]
    env: dict[str, str]
    labels: dict[str, str]
    exposed: list[str]
    auto_remove: bool
    status: str = "created"
    exit_code: int = 0
    ports: dict[str, int] = field(default_factory=dict)
    postgres: cluster.RunningPostgres | None = None
    ryuk: Ryuk | None = None
    log: bytearray = field(default_factory=bytearray)

    def summary(self) -> dict[str, Any]:
        return {
            "Id": self.id,
            "Names": [f"/{self.name}"],
            "Image": self.reference,
            "ImageID": self.image.id,
            "Command": " ".join(self.command),
            "Labels": dict(self.labels),
            "State": self.status,
            "Status": self.status,
            "Ports": [
                {"PrivatePort": int(key.split("/")[0]), "PublicPort": port, "Type": "tcp"}
                for key, port in self.ports.items()
            ],
            "HostConfig": {"NetworkMode": "bridge"},
            "NetworkSettings": {"Networks": self._networks()},
        }

    def inspect(self) -> dict[str, Any]:
        return {
            "Id": self.id,
            "Name": f"/{self.name}",
            "Image": self.image.id,
            "Created": "2026-01-01T00:00:00Z",
            "Config": {
                "Image": self.reference,
                "Cmd": list(self.command),
                "Env": [f"{k}={v}" for k, v in self.env.items()],
                "Labels": dict(self.labels),
                "ExposedPorts": {key: {} for key in self.exposed},
                "Tty": False,
            },
            "State": {
                "Status": self.status,
                "Running": self.status == "running",
                "ExitCode": self.exit_code,
                "Pid": 0,
            },
            "HostConfig": {"NetworkMode": "bridge", "AutoRemove": self.auto_remove},
            "NetworkSettings": {
                "Ports": {
                    key: [{"HostIp": "127.0.0.1", "HostPort": str(port)}]
                    for key, port in self.ports.items()
                },
                "Networks": self._networks(),
            },
        }

    def _networks(self) -> dict[str, Any]:
        # Everything the stand-in runs lives on the host's loopback.
        return {"bridge": {"IPAddress": "127.0.0.1", "Gateway": "127.0.0.1"}}


class Ryuk:
    """testcontainers' reaper: removes what its filters match once its clients are gone."""

    def __init__(self, engine: DockerStandIn, reconnection_timeout: float) -> None:
        self._engine = engine
        self._timeout = reconnection_timeout
        self._filters: list[dict[str, str]] = []
        self._clients = 0
        self._ever_connected = False
        self._last_left = 0.0
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen()
        self._listener.settimeout(0.1)
        self.port: int = self._listener.getsockname()[1]
        self._thread = threading.Thread(target=self._serve, name="ryuk", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop listening and wait for the accept loop to end."""
        self._stopped.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)
        self.close()

    def close(self) -> None:
        self._listener.close()

    def _serve(self) -> None:
        while not self._stopped.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                if self._idle_long_enough():
                    self._reap()
                    return
                continue
            except OSError:
                return
            with self._lock:
                self._clients += 1
                self._ever_connected = True
            threading.Thread(target=self._client, args=(conn,), daemon=True).start()

    def _client(self, conn: socket.socket) -> None:
        # A client that dies (SIGKILL) resets the connection: that is a departure too.
        with contextlib.suppress(OSError), conn, conn.makefile("rb") as lines:
            for raw in lines:
                wanted = self._parse(raw.decode(errors="replace").strip())
                if wanted:
                    with self._lock:
                        self._filters.append(wanted)
                    conn.sendall(b"ACK\n")
        with self._lock:
            self._clients -= 1
            self._last_left = time.monotonic()

    @staticmethod
    def _parse(line: str) -> dict[str, str]:
        labels: dict[str, str] = {}
        for part in line.split("&"):
            kind, _, value = part.partition("=")
            if kind == "label" and value:
                key, _, label_value = value.partition("=")
                labels[key] = label_value
        return labels

    def _idle_long_enough(self) -> bool:
        with self._lock:
            return (
                self._ever_connected
                and self._clients == 0
                and time.monotonic() - self._last_left >= self._timeout
            )

    def _reap(self) -> None:
        with self._lock:
            filters = list(self._filters)
        self._engine.remove_matching(filters)
        self._engine.retire(self)


class DockerStandIn:
    """A Docker Engine API over a unix socket; see the module docstring. Use as a context."""

    def __init__(self, registry: Mapping[str, Mapping[str, str]] | None = None) -> None:
        self.registry = {
            repo: dict(tags) for repo, tags in (registry or default_registry()).items()
        }
        self.created: list[str] = []  # references of every container created, in order
        self._images: dict[str, Image] = {}
        self._containers: dict[str, Container] = {}
        self._execs: dict[str, dict[str, Any]] = {}
        self._lock = threading.RLock()
        self._directory = tempfile.mkdtemp(prefix="lab-dockerd-", dir="/tmp")
        self.socket_path = os.path.join(self._directory, "docker.sock")
        self._server = _Server(self.socket_path, _Handler)
        self._server.engine = self
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def host(self) -> str:
        """The ``DOCKER_HOST`` value that reaches this engine."""
        return f"unix://{self.socket_path}"

    def __enter__(self) -> DockerStandIn:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop serving, then remove every container (their servers stop with them)."""
        self._server.shutdown()
        self._server.server_close()
        with self._lock:
            ids = list(self._containers)
        for container_id in ids:
            with contextlib.suppress(EngineError):
                self.remove(container_id, force=True)
        shutil.rmtree(self._directory, ignore_errors=True)

    def containers(self) -> list[Container]:
        """The containers that exist now, running or not."""
        with self._lock:
            return list(self._containers.values())

    # --- images ---------------------------------------------------------------------------

    def pull(self, from_image: str, tag: str | None) -> Image:
        repository, name_tag, name_digest = parse_reference(from_image)
        wanted = tag or name_tag or "latest"
        digest = name_digest
        if wanted.startswith("sha256:"):
            digest = wanted
        known = self.registry.get(repository)
        if known is None:
            raise EngineError(404, f"pull access denied for {repository}: repository unknown")
        if digest is None:
            digest = known.get(wanted)
            if digest is None:
                raise EngineError(
                    404, f"manifest for {repository}:{wanted} not found: manifest unknown"
                )
        elif digest not in known.values():
            raise EngineError(
                404, f"manifest for {repository}@{digest} not found: manifest unknown"
            )
        image_id = "sha256:" + hashlib.sha256(f"{repository}@{digest}".encode()).hexdigest()
        with self._lock:
            image = self._images.setdefault(image_id, Image(image_id, repository, digest))
            if not wanted.startswith("sha256:") and name_digest is None:
                tagged = f"{repository}:{wanted}"
                if tagged not in image.tags:
                    image.tags.append(tagged)
        return image

    def image(self, name: str) -> Image:
        repository, tag, digest = parse_reference(name)
        with self._lock:
            for image in self._images.values():
                hex_id = image.id.removeprefix("sha256:")
                if name in (image.id, hex_id) or (len(name) >= 12 and hex_id.startswith(name)):
                    return image
                if image.repository != repository:
                    continue
                if digest is not None and image.digest == digest:
                    return image
                if digest is None and f"{repository}:{tag or 'latest'}" in image.tags:
                    return image
        raise EngineError(404, f"No such image: {name}")

    # --- containers -----------------------------------------------------------------------

    def create(self, body: Mapping[str, Any], name: str | None) -> Container:
        reference = str(body.get("Image") or "")
        image = self.image(reference)
        command = body.get("Cmd") or []
        if isinstance(command, str):
            command = shlex.split(command)
        env = dict(str(item).partition("=")[::2] for item in body.get("Env") or [])
        host_config = body.get("HostConfig") or {}
        container_id = secrets.token_hex(32)
        with self._lock:
            name = name or f"standin_{container_id[:12]}"
            if any(c.name == name for c in self._containers.values()):
                raise EngineError(409, f'Conflict. The container name "/{name}" is already in use')
            container = Container(
                id=container_id,
                name=name,
                reference=reference,
                image=image,
                command=[str(part) for part in command],
                env=env,
                labels=dict(body.get("Labels") or {}),
                exposed=list((body.get("ExposedPorts") or {}).keys()),
                auto_remove=bool(host_config.get("AutoRemove")),
            )
            self._containers[container_id] = container
            self.created.append(reference)
        return container

    def find(self, name_or_id: str) -> Container:
        with self._lock:
            for container in self._containers.values():
                if name_or_id in (container.id, container.name, f"/{container.name}"):
                    return container
                if len(name_or_id) >= 12 and container.id.startswith(name_or_id):
                    return container
        raise EngineError(404, f"No such container: {name_or_id}")

    def start(self, container: Container) -> None:
        if container.status == "running":
            return
        if container.image.repository.endswith("ryuk"):
            timeout = go_duration(container.env.get("RYUK_RECONNECTION_TIMEOUT", "10s"), 10.0)
            container.ryuk = Ryuk(self, timeout)
            container.ports = {"8080/tcp": container.ryuk.port}
            container.log += b"Started!\n"
            container.status = "running"
            return
        if container.image.repository.split("/")[-1] != "postgres":
            raise EngineError(
                500, f"the stand-in only runs postgres and ryuk images, not {container.reference}"
            )
        self._start_postgres(container)

    def _start_postgres(self, container: Container) -> None:
        password = container.env.get("POSTGRES_PASSWORD")
        if not password and container.env.get("POSTGRES_HOST_AUTH_METHOD") != "trust":
            container.log += (
                b"Error: Database is uninitialized and superuser password is not specified.\n"
            )
            container.status, container.exit_code = "exited", 1
            return
        settings = _server_settings(container.command)
        running = cluster.start_embedded()
        try:
            _initialise(running.provisioned.dsn, container.env, settings)
        except BaseException:
            running.stop()
            raise
        container.postgres = running
        port = conninfo.conninfo_to_dict(running.provisioned.dsn)["port"]
        container.ports = {"5432/tcp": int(str(port))}
        container.log += b"database system is ready to accept connections\n"
        container.status = "running"

    def exec_create(self, container: Container, body: Mapping[str, Any]) -> str:
        if container.status != "running":
            raise EngineError(409, f"Container {container.id} is not running")
        exec_id = secrets.token_hex(32)
        command = body.get("Cmd") or []
        env = dict(str(item).partition("=")[::2] for item in body.get("Env") or [])
        with self._lock:
            self._execs[exec_id] = {
                "container": container.id, "command": [str(c) for c in command], "env": env,
                "exit_code": None, "running": False,
            }  # fmt: skip
        return exec_id

    def exec_run(self, exec_id: str) -> tuple[int, bytes, bytes]:
        record = self.exec_record(exec_id)
        container = self.find(record["container"])
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **container.env, **record["env"]}
        if container.postgres is not None:
            bindir = container.postgres.provisioned.details.get("binaries")
            if bindir:
                env["PATH"] = f"{bindir}:{env['PATH']}"
            env["PGPORT"] = str(container.ports["5432/tcp"])
        record["running"] = True
        try:
            done = subprocess.run(
                record["command"], env=env, capture_output=True, timeout=60, check=False
            )
            code, out, err = done.returncode, done.stdout, done.stderr
        except FileNotFoundError as exc:
            code, out, err = 127, b"", f"exec failed: {exc}\n".encode()
        except subprocess.TimeoutExpired:
            code, out, err = 124, b"", b"exec timed out\n"
        record["running"], record["exit_code"] = False, code
        return code, out, err

    def exec_record(self, exec_id: str) -> dict[str, Any]:
        """The exec instance, or a 404 as the daemon answers for an unknown id."""
        with self._lock:
            record = self._execs.get(exec_id)
        if record is None:
            raise EngineError(404, f"No such exec instance: {exec_id}")
        return record

    def exec_inspect(self, exec_id: str) -> dict[str, Any]:
        record = self.exec_record(exec_id)
        return {
            "ID": exec_id,
            "ContainerID": record["container"],
            "Running": record["running"],
            "ExitCode": record["exit_code"],
            "ProcessConfig": {
                "entrypoint": record["command"][:1],
                "arguments": record["command"][1:],
            },
        }

    def remove(self, container_id: str, force: bool) -> None:
        container = self.find(container_id)
        if container.status == "running" and not force:
            raise EngineError(
                409,
                f"You cannot remove a running container {container.id}. "
                "Stop the container before attempting removal or force remove",
            )
        self.stop(container)
        with self._lock:
            self._containers.pop(container.id, None)

    def stop(self, container: Container) -> None:
        """Stop what runs the container (its server, its reaper); the container stays."""
        postgres, container.postgres = container.postgres, None
        ryuk, container.ryuk = container.ryuk, None
        if postgres is not None:
            postgres.stop()
        if ryuk is not None:
            ryuk.stop()
        container.status = "exited"

    def remove_matching(self, filters: list[dict[str, str]]) -> None:
        """Remove the containers whose labels match any filter (Ryuk's job)."""
        with self._lock:
            doomed = [
                c for c in self._containers.values()
                if any(f and all(c.labels.get(k) == v for k, v in f.items()) for f in filters)
            ]  # fmt: skip
        for container in doomed:
            with contextlib.suppress(EngineError):
                self.remove(container.id, force=True)

    def retire(self, ryuk: Ryuk) -> None:
        """The reaper has done its job and exits; its container was made with auto-remove."""
        with self._lock:
            mine = [c for c in self._containers.values() if c.ryuk is ryuk]
        for container in mine:
            container.ryuk = None
            ryuk.close()
            container.status = "exited"
            if container.auto_remove:
                with self._lock:
                    self._containers.pop(container.id, None)

    def listed(self, all_: bool, filters: Mapping[str, list[str]]) -> list[Container]:
        with self._lock:
            found = list(self._containers.values())
        if not all_:
            found = [c for c in found if c.status == "running"]
        for wanted in filters.get("id", []):
            found = [c for c in found if c.id.startswith(wanted)]
        for wanted in filters.get("name", []):
            found = [c for c in found if wanted.lstrip("/") in c.name]
        for wanted in filters.get("label", []):
            key, has_value, value = wanted.partition("=")
            found = [
                c for c in found
                if key in c.labels and (not has_value or c.labels[key] == value)
            ]  # fmt: skip
        for wanted in filters.get("status", []):
            found = [c for c in found if c.status == wanted]
        return found


def _server_settings(command: list[str]) -> dict[str, str]:
    """``-c name=value`` settings of a ``postgres`` command; anything else is refused."""
    if not command:
        return {}
    if command[0] != "postgres":
        raise EngineError(500, f"the stand-in runs only the postgres command, not {command[0]!r}")
    settings: dict[str, str] = {}
    rest = iter(command[1:])
    for part in rest:
        if part == "-c":
            part = next(rest, "")
        elif part.startswith("--") and "=" in part:
            part = part[2:]
        else:
            raise EngineError(500, f"the stand-in does not emulate postgres option {part!r}")
        name, equals, value = part.partition("=")
        if not equals or not name:
            raise EngineError(500, f"malformed postgres setting {part!r}")
        settings[name.replace("-", "_")] = value
    return settings


def _initialise(dsn: str, env: Mapping[str, str], settings: Mapping[str, str]) -> None:
    """What the official image's entrypoint does on first start, on an embedded cluster."""
    user = env.get("POSTGRES_USER") or "postgres"
    database = env.get("POSTGRES_DB") or user
    password = env.get("POSTGRES_PASSWORD") or secrets.token_urlsafe(16)
    with psycopg.connect(dsn, autocommit=True, connect_timeout=10) as conn:
        role = sql.Identifier(user)
        if user == "postgres":
            conn.execute(sql.SQL("ALTER ROLE {} PASSWORD {}").format(role, sql.Literal(password)))
        else:
            conn.execute(
                sql.SQL("CREATE ROLE {} LOGIN SUPERUSER PASSWORD {}").format(
                    role, sql.Literal(password)
                )
            )
        if database != "postgres":
            conn.execute(
                sql.SQL("CREATE DATABASE {} OWNER {}").format(sql.Identifier(database), role)
            )
        for name, value in settings.items():
            row = conn.execute(
                "SELECT context FROM pg_settings WHERE name = %s", (name,)
            ).fetchone()
            if row is None:
                raise EngineError(500, f"unrecognized configuration parameter {name!r}")
            if row[0] == "postmaster":
                raise EngineError(500, f"the stand-in cannot apply {name!r} without a restart")
            conn.execute(
                sql.SQL("ALTER SYSTEM SET {} = {}").format(sql.Identifier(name), sql.Literal(value))
            )
        conn.execute("SELECT pg_reload_conf()")


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    engine: DockerStandIn


_VERSIONED = re.compile(r"^/v\d+\.\d+(/.*)$")


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def address_string(self) -> str:
        return "unix"

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def _dispatch(self, method: str) -> None:
        parsed = urllib.parse.urlsplit(self.path)
        path = urllib.parse.unquote(parsed.path)
        versioned = _VERSIONED.match(path)
        if versioned:
            path = versioned.group(1)
        query = dict(urllib.parse.parse_qsl(parsed.query))
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            body = json.loads(raw) if raw else {}
            self._route(method, path, query, body)
        except EngineError as exc:
            self._json(exc.status, {"message": str(exc)})
        except Exception as exc:  # a daemon answers 500 with the message, and keeps serving
            self._json(500, {"message": f"{type(exc).__name__}: {exc}"})

    def _route(self, method: str, path: str, query: dict[str, str], body: Any) -> None:
        engine = self.server.engine
        parts = [p for p in path.split("/") if p]
        if method == "GET" and path == "/version":
            self._json(200, {
                "ApiVersion": API_VERSION, "MinAPIVersion": MIN_API_VERSION,
                "Version": "stand-in", "Os": "linux", "Arch": "amd64",
                "Components": [{"Name": "lab Docker API stand-in", "Version": "1"}],
            })  # fmt: skip
        elif method == "GET" and path == "/networks":
            self._json(200, [])
        elif method == "POST" and path == "/images/create":
            image = engine.pull(query.get("fromImage", ""), query.get("tag"))
            status = {"status": f"Digest: {image.digest}"}
            self._send(200, (json.dumps(status) + "\r\n").encode(), "application/json")
        elif method == "GET" and parts[:1] == ["images"] and parts[-1] == "json":
            self._json(200, engine.image("/".join(parts[1:-1])).inspect())
        elif method == "POST" and path == "/containers/create":
            container = engine.create(body, query.get("name"))
            self._json(201, {"Id": container.id, "Warnings": []})
        elif method == "GET" and path == "/containers/json":
            # list(): older clients send {"label": {"k=v": true}} rather than lists
            filters = {k: list(v) for k, v in json.loads(query.get("filters") or "{}").items()}
            wanted = engine.listed(query.get("all") in ("1", "true", "True"), filters)
            self._json(200, [c.summary() for c in wanted])
        elif parts[:1] == ["containers"] and len(parts) >= 2:
            self._container_route(method, parts[1], parts[2:], query, body)
        elif parts[:1] == ["exec"] and len(parts) == 3:
            self._exec_route(method, parts[1], parts[2])
        else:
            raise EngineError(501, f"the Docker API stand-in does not emulate {method} {path}")

    def _container_route(
        self, method: str, name: str, rest: list[str], query: dict[str, str], body: Any
    ) -> None:
        engine = self.server.engine
        container = engine.find(name)
        action = rest[0] if rest else ""
        if method == "GET" and action == "json":
            self._json(200, container.inspect())
        elif method == "POST" and action == "start":
            engine.start(container)
            self._send(204, b"")
        elif method == "DELETE" and not action:
            engine.remove(container.id, force=query.get("force") in ("1", "true", "True"))
            self._send(204, b"")
        elif method == "POST" and action == "exec":
            self._json(201, {"Id": engine.exec_create(container, body)})
        elif method == "GET" and action == "logs":
            data = bytes(container.log)
            self._send(200, _frame(_STDERR, data) if data else b"",
                       "application/vnd.docker.multiplexed-stream")  # fmt: skip
        else:
            raise EngineError(501, f"the Docker API stand-in does not emulate {method} "
                              f"/containers/{{id}}/{action}")  # fmt: skip

    def _exec_route(self, method: str, exec_id: str, action: str) -> None:
        engine = self.server.engine
        if method == "GET" and action == "json":
            self._json(200, engine.exec_inspect(exec_id))
            return
        if method != "POST" or action != "start":
            raise EngineError(
                501, f"the Docker API stand-in does not emulate {method} /exec/{action}"
            )
        engine.exec_record(exec_id)  # 404 before switching protocols
        # As the daemon does: switch protocols, then stream multiplexed frames until EOF. The
        # headers go out before the command runs, so the client reads them on their own.
        self.wfile.write(
            b"HTTP/1.1 101 UPGRADED\r\nContent-Type: application/vnd.docker.raw-stream\r\n"
            b"Connection: Upgrade\r\nUpgrade: tcp\r\n\r\n"
        )
        self.wfile.flush()
        _, out, err = engine.exec_run(exec_id)
        payload = (_frame(_STDOUT, out) if out else b"") + (_frame(_STDERR, err) if err else b"")
        self.wfile.write(payload)
        self.wfile.flush()
        self.close_connection = True

    def _json(self, status: int, payload: Any) -> None:
        self._send(status, json.dumps(payload).encode(), "application/json")

    def _send(self, status: int, body: bytes, kind: str = "text/plain") -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
