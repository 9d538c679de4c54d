"""Loopback-only rules for database DSNs and tool endpoints. Pure code.

The lab only ever talks to services on this machine. A DSN or endpoint that
could reach anything else is refused with the reason, before any connection.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping

import httpx
from psycopg import conninfo

from lab import errors

LOOPBACK_NAME = "localhost"
PINNED_LOOPBACK = "127.0.0.1"
# Environment variables through which libpq could be redirected to another host.
_REDIRECTING_ENV = ("PGHOST", "PGHOSTADDR", "PGSERVICE", "PGSERVICEFILE")


def _is_loopback_literal(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _check_db_host(host: str, field: str) -> None:
    if host.startswith("/") or host.startswith("@"):
        return  # a unix-domain socket directory is local by construction
    if host == LOOPBACK_NAME or _is_loopback_literal(host):
        return
    raise errors.BoundaryViolation(
        f"database {field} {host!r} is not loopback (allowed: 127.0.0.0/8, ::1, localhost, "
        "a unix socket directory)"
    )


def check_dsn(dsn: str, environ: Mapping[str, str] | None = None) -> str:
    """Return ``dsn`` with ``localhost`` pinned to 127.0.0.1, or raise ``BoundaryViolation``.

    Every host of a multi-host DSN and every ``hostaddr`` must be loopback; a
    service name (which could point anywhere) is refused, and so are ``PG*``
    environment variables that would redirect a DSN that names no host.
    """
    env = os.environ if environ is None else environ
    try:
        params = conninfo.conninfo_to_dict(dsn)
    except Exception as exc:  # psycopg raises ProgrammingError for a malformed DSN
        raise errors.BoundaryViolation("database DSN is malformed") from exc
    if "service" in params:
        raise errors.BoundaryViolation("database DSN names a service, which could be remote")
    hosts = [h for h in str(params.get("host", "")).split(",") if h]
    addrs = [a for a in str(params.get("hostaddr", "")).split(",") if a]
    for host in hosts:
        _check_db_host(host, "host")
    for addr in addrs:
        if not _is_loopback_literal(addr):
            raise errors.BoundaryViolation(f"database hostaddr {addr!r} is not loopback")
    if not hosts and not addrs:
        for name in _REDIRECTING_ENV:
            if env.get(name):
                raise errors.BoundaryViolation(
                    f"DSN names no host and {name} is set: it could redirect the connection"
                )
    if hosts and not addrs and any(h == LOOPBACK_NAME for h in hosts):
        # Pin localhost so name resolution cannot move the connection.
        params["hostaddr"] = ",".join(
            PINNED_LOOPBACK if h == LOOPBACK_NAME else (h if _is_loopback_literal(h) else "")
            for h in hosts
        )
        if any(h.startswith("/") for h in hosts):
            del params["hostaddr"]
    return conninfo.make_conninfo(**params)


def check_endpoint(endpoint: str) -> str:
    """Return the normalised base URL of a loopback tool endpoint, or raise.

    Only ``http://`` on a loopback IP literal (or ``localhost``, pinned to
    127.0.0.1) with an explicit port is allowed: no credentials, query,
    fragment or path, and no numeric host spellings other than the canonical.
    """
    try:
        url = httpx.URL(endpoint)
    except Exception as exc:  # httpx.InvalidURL and friends
        raise errors.BoundaryViolation("tool endpoint is not a valid URL") from exc
    if url.scheme != "http":
        raise errors.BoundaryViolation("tool endpoint must use plain http on loopback")
    if url.userinfo:
        raise errors.BoundaryViolation("tool endpoint must not carry credentials")
    if url.query:
        raise errors.BoundaryViolation("tool endpoint must not carry a query")
    if url.fragment:
        raise errors.BoundaryViolation("tool endpoint must not carry a fragment")
    if url.path not in ("", "/"):
        raise errors.BoundaryViolation("tool endpoint must not carry a path")
    host = url.host
    if host == LOOPBACK_NAME:
        host = PINNED_LOOPBACK
    elif not _is_loopback_literal(host):
        raise errors.BoundaryViolation(f"tool endpoint host {url.host!r} is not loopback")
    elif ":" not in host and str(ipaddress.ip_address(host)) != host:
        raise errors.BoundaryViolation("tool endpoint host is not in canonical form")
    if url.port is None:
        raise errors.BoundaryViolation("tool endpoint must name its port")
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{url.port}"
