"""Loopback-only rules for database DSNs and tool endpoints. Pure code.

The lab only ever talks to services on this machine. A DSN or endpoint that
could reach anything else is refused with the reason, before any connection.

Both checks read the text the user gave, not a library's normalisation of it:
resolvers accept spellings such as ``2130706433``, ``0x7f.1`` or ``127.1`` for
127.0.0.1 and HTTP clients pass them through untouched, so only canonical literals
are accepted and everything else is refused rather than guessed at. Error
messages never contain a password, a query or userinfo; they name the rule.
"""

from __future__ import annotations

import ipaddress
import os
import re
import urllib.parse
from collections.abc import Mapping

from lab import errors

LOOPBACK_NAME = "localhost"
PINNED_LOOPBACK = "127.0.0.1"
_ALLOWED_DB = "allowed: 127.0.0.0/8, ::1, localhost, a unix socket directory"
_ALLOWED_ENDPOINT = "allowed: 127.0.0.0/8, [::1], localhost"
# libpq reads these when the DSN leaves the matching option unset; each could
# send the connection elsewhere. PGSERVICEFILE and PGSYSCONFDIR only matter
# with a service, which is refused, but refusing them costs nothing.
_HOST_ENV = "PGHOST"
_HOSTADDR_ENV = "PGHOSTADDR"
_SERVICE_ENV = ("PGSERVICE", "PGSERVICEFILE", "PGSYSCONFDIR")
# A host worth naming in an error: short, and only characters a host name or
# address literal uses (so a password that leaked into a host field is not).
_SHOWABLE_HOST = re.compile(r"[A-Za-z0-9.:\-]{1,64}")
# What a resolver would take as a numeric IPv4 address (inet_aton forms).
_NUMERIC_HOST = re.compile(r"(0[xX][0-9A-Fa-f]*|[0-9]+)(\.(0[xX][0-9A-Fa-f]*|[0-9]+)){0,3}")
_DOTTED_QUAD = re.compile(r"[0-9]{1,3}(\.[0-9]{1,3}){3}")
_PORT = re.compile(r"[1-9][0-9]{0,4}")
HOSTS_ENV = "LAB_HOST_ADDRESSES"
HOSTS_NETWORK = ipaddress.IPv4Network("169.254.0.0/16")
_learned: set[str] = set()


def _link_local(addresses: list[str]) -> set[str]:
    """The addresses, each a canonical IPv4 literal of ``HOSTS_NETWORK``, or raise."""
    chosen: set[str] = set()
    for text in addresses:
        try:
            address = ipaddress.IPv4Address(text)
        except ValueError:
            address = None
        if address is None or str(address) != text or address not in HOSTS_NETWORK:
            raise errors.BoundaryViolation(
                f"a lab host address must be a canonical IPv4 literal in {HOSTS_NETWORK}")
        chosen.add(text)
    return chosen


def learn(addresses: list[str]) -> None:
    """Admit these lab hosts' addresses in this process (see the module)."""
    _learned.update(_link_local(addresses))


def forget(addresses: list[str]) -> None:
    """Stop admitting these addresses (their hosts are gone)."""
    _learned.difference_update(addresses)


def host_addresses(environ: Mapping[str, str] | None = None) -> frozenset[str]:
    """The lab hosts' addresses admitted here: learned, or named by ``LAB_HOST_ADDRESSES``."""
    env = os.environ if environ is None else environ
    named = env.get(HOSTS_ENV, "")
    return frozenset(_learned | (_link_local(named.split(",")) if named else set()))


def _allowed_literal(host: str, environ: Mapping[str, str] | None = None) -> bool:
    """A canonical loopback literal, or the exact address of one of the run's lab hosts."""
    return _canonical_loopback(host) or (
        "%" not in host and host in host_addresses(environ))


def _canonical_loopback(host: str) -> bool:
    """True for a loopback IP literal written exactly as ``ipaddress`` writes it.

    An IPv6 zone (``::1%lo``) is refused: it names an interface, which a
    loopback target never needs.
    """
    if "%" in host:
        return False
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return address.is_loopback and str(address) == host


def _shown_host(host: str, secret: str) -> str:
    if _SHOWABLE_HOST.fullmatch(host) and not (secret and secret in host):
        return repr(host)
    return "(not shown)"


def _db_host_is_local(host: str, environ: Mapping[str, str]) -> bool:
    if host == "":
        return True  # libpq uses its default unix socket directory
    if host.startswith(("/", "@")):
        return True  # a unix-domain socket directory (or abstract socket) is local
    return host == LOOPBACK_NAME or _allowed_literal(host, environ)


def _split(params: Mapping[str, str], key: str) -> list[str] | None:
    value = params.get(key, "")
    return value.split(",") if value else None


def _looks_like_conninfo(dbname: str) -> bool:
    # libpq's own test (recognized_connection_string): tools that expand the
    # dbname (psql -d, PQconnectdbParams) would read connection options from it.
    return "=" in dbname or dbname.startswith(("postgresql://", "postgres://"))


def check_dsn(dsn: str, environ: Mapping[str, str] | None = None) -> str:
    """Return ``dsn`` with ``localhost`` pinned to 127.0.0.1, or raise ``BoundaryViolation``.

    Every host of a multi-host DSN and every ``hostaddr`` must be loopback (a
    canonical IP literal, ``localhost`` or a unix socket directory); a service
    name (which could point anywhere) is refused, and so are ``PG*``
    environment variables that libpq would use to fill a host or address the
    DSN leaves unset. TCP hosts get an explicit ``hostaddr`` in the returned
    DSN, so neither name resolution nor ``PGHOSTADDR`` can move them.
    """
    env = os.environ if environ is None else environ
    # Imported here: the egress guard imports this module, and must not import psycopg.
    from psycopg import conninfo

    try:
        params = {k: str(v) for k, v in conninfo.conninfo_to_dict(dsn).items()}
    except Exception:
        # from None: libpq's message can quote the whole DSN, password included.
        raise errors.BoundaryViolation("database DSN is malformed") from None
    secret = params.get("password", "")
    host_addresses(env)  # a LAB_HOST_ADDRESSES naming anything but link-local is refused
    if "service" in params:
        raise errors.BoundaryViolation("database DSN names a service, which could be remote")
    for name in _SERVICE_ENV:
        if env.get(name):
            raise errors.BoundaryViolation(
                f"{name} is set: a connection service could redirect the connection"
            )
    if _looks_like_conninfo(params.get("dbname", "")):
        raise errors.BoundaryViolation("database dbname is itself a connection string")
    hosts = _split(params, "host")
    addrs = _split(params, "hostaddr")
    if hosts is None and env.get(_HOST_ENV):
        raise errors.BoundaryViolation(
            f"DSN names no host and {_HOST_ENV} is set: it could redirect the connection"
        )
    for host in hosts or []:
        if not _db_host_is_local(host, env):
            raise errors.BoundaryViolation(
                f"database host {_shown_host(host, secret)} is not loopback ({_ALLOWED_DB})"
            )
    for addr in addrs or []:
        if addr != "" and not _allowed_literal(addr, env):
            raise errors.BoundaryViolation(
                f"database hostaddr {_shown_host(addr, secret)} is not a loopback address"
            )
    # Pin each TCP host without an address to one; a socket entry keeps an empty
    # slot, which libpq reads as "use the host". Lists of different lengths are
    # left alone: libpq refuses to connect with them.
    if hosts is not None and (addrs is None or len(addrs) == len(hosts)):
        pinned = [
            addr or (PINNED_LOOPBACK if h == LOOPBACK_NAME
                     else h if _allowed_literal(h, env) else "")
            for h, addr in zip(hosts, addrs or [""] * len(hosts), strict=True)
        ]
        if any(pinned):
            params["hostaddr"] = ",".join(pinned)
            addrs = pinned
    if addrs is None and env.get(_HOSTADDR_ENV):
        raise errors.BoundaryViolation(
            f"DSN has no hostaddr and {_HOSTADDR_ENV} is set: it could redirect the connection"
        )
    from psycopg import conninfo

    return conninfo.make_conninfo("", **params)


def _refuse(reason: str) -> errors.BoundaryViolation:
    return errors.BoundaryViolation(f"tool endpoint {reason}")


def _endpoint_host(host: str) -> str:
    """The address to connect to for a raw endpoint host, or raise with the reason."""
    if host == "":
        raise _refuse("must name a host")
    if host.endswith("."):
        raise _refuse("host must not end with a dot")
    if host == LOOPBACK_NAME:
        return PINNED_LOOPBACK  # pinned: name resolution cannot move it
    if host.startswith("["):
        inner = host[1:-1] if host.endswith("]") else ""
        try:
            address = ipaddress.IPv6Address(inner)
        except ValueError:
            raise _refuse("host is not a valid IPv6 literal") from None
        if address.scope_id is not None:
            raise _refuse("IPv6 host must not carry a zone")
        if str(address) != inner:
            raise _refuse("IPv6 host is not in canonical form (e.g. [::1])")
        if not address.is_loopback:
            raise _refuse(f"host {_shown_host(inner, '')} is not loopback ({_ALLOWED_ENDPOINT})")
        return inner
    if _DOTTED_QUAD.fullmatch(host):
        if not _allowed_literal(host):
            try:
                ipaddress.IPv4Address(host)
            except ValueError:
                raise _refuse("IPv4 host is not in canonical dotted-quad form") from None
            raise _refuse(f"host {_shown_host(host, '')} is not loopback ({_ALLOWED_ENDPOINT})")
        return host
    if _NUMERIC_HOST.fullmatch(host):
        raise _refuse(
            "host is a numeric address not in canonical dotted-quad form "
            "(decimal, octal, hex or short forms are refused)"
        )
    raise _refuse(f"host {_shown_host(host, '')} is not loopback ({_ALLOWED_ENDPOINT})")


def check_endpoint(endpoint: str) -> str:
    """Return the normalised base URL of a loopback tool endpoint, or raise.

    Only ``http://`` on a canonical loopback IP literal (or ``localhost``,
    pinned to 127.0.0.1) with an explicit port is allowed: no credentials,
    query, fragment or path (a lone ``/`` is fine), no numeric host spellings
    other than the canonical, no trailing dot. The result is
    ``http://127.0.0.1:PORT`` or ``http://[::1]:PORT``.
    """
    if not endpoint.isascii() or not endpoint.isprintable() or " " in endpoint:
        raise _refuse("must be printable ASCII without spaces")
    scheme, sep, rest = endpoint.partition("://")
    if not sep:
        raise _refuse("must be an absolute http:// URL")
    if scheme != "http":
        raise _refuse("must use plain http (lowercase http://) on loopback")
    # RFC 3986: the authority ends at the first "/", "?" or "#". A backslash is
    # a path separator to browsers and part of the authority to others, so it
    # is refused outright rather than interpreted.
    if "\\" in rest:
        raise _refuse("must not contain a backslash")
    cut = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    authority, tail = rest[:cut], rest[cut:]
    if "@" in authority:
        raise _refuse("must not carry credentials (userinfo)")
    if "?" in tail:
        raise _refuse("must not carry a query")
    if "#" in tail:
        raise _refuse("must not carry a fragment")
    if tail not in ("", "/"):
        raise _refuse("must not carry a path")
    if authority.startswith("[") and "]" in authority:
        host, _, after = authority.partition("]")
        host += "]"
        if after and not after.startswith(":"):
            raise _refuse("has text after the IPv6 host")
        port_text = after[1:] if after else None
    elif ":" in authority:
        host, _, port_text = authority.rpartition(":")
    else:
        host, port_text = authority, None
    address = _endpoint_host(host)
    if not port_text:
        raise _refuse("must name its port")
    if not _PORT.fullmatch(port_text) or int(port_text) > 65535:
        raise _refuse("port must be a number from 1 to 65535 without leading zeros")
    port = int(port_text)
    shown = f"[{address}]" if ":" in address else address
    base = f"http://{shown}:{port}"
    # The client (``toolclient.ToolClient``) checks that urllib and httpx both see exactly
    # this target.
    try:
        parsed = urllib.parse.urlsplit(base)
        parsed_port = parsed.port
    except ValueError:
        raise _refuse("could not be normalised") from None
    if parsed.hostname != address or parsed_port != port:
        raise _refuse("parses differently in the HTTP client")
    return base
