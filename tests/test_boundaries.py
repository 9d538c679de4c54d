"""Loopback rules for DSNs and tool endpoints, table-driven.

Every refusal is checked for its reason and for not leaking the DSN password.
The environment is passed explicitly, so nothing here reads or changes
``os.environ``.
"""

from __future__ import annotations

import ipaddress

import httpx
import pytest
from hypothesis import event, given
from hypothesis import strategies as st
from psycopg import conninfo

from lab import errors, loopback

PASSWORD = "book-lab-only"
NO_ENV: dict[str, str] = {}


def refused_dsn(dsn: str, environ: dict[str, str] | None = None) -> str:
    with pytest.raises(errors.BoundaryViolation) as info:
        loopback.check_dsn(dsn, NO_ENV if environ is None else environ)
    message = str(info.value)
    assert PASSWORD not in message
    assert "secret" not in message
    # Nothing chained either: a traceback would print the cause's text.
    assert info.value.__cause__ is None or PASSWORD not in str(info.value.__cause__)
    return message


def params(dsn: str) -> dict[str, str]:
    return {k: str(v) for k, v in conninfo.conninfo_to_dict(dsn).items()}


# (dsn, expected host, expected hostaddr or None when there must be none)
ALLOWED_DSNS = [
    (
        "postgres://book:book-lab-only@127.0.0.1:25432/book?sslmode=disable",
        "127.0.0.1",
        "127.0.0.1",
    ),
    ("postgres://book:book-lab-only@localhost:25432/book", "localhost", "127.0.0.1"),
    ("postgresql://[::1]:5432/book", "::1", "::1"),
    ("postgresql://127.0.0.2/book", "127.0.0.2", "127.0.0.2"),
    (
        "host=127.0.0.1 port=25432 user=book password=book-lab-only dbname=book",
        "127.0.0.1",
        "127.0.0.1",
    ),
    ("host=localhost port=5432 dbname=book", "localhost", "127.0.0.1"),
    ("host=localhost,127.0.0.1 port=5432,5433", "localhost,127.0.0.1", "127.0.0.1,127.0.0.1"),
    ("host=localhost,/run/pg dbname=book", "localhost,/run/pg", "127.0.0.1,"),
    ("host=/var/run/postgresql dbname=book", "/var/run/postgresql", None),
    ("host=@abstract dbname=book", "@abstract", None),
    ("postgresql://%2Frun%2Fpg%2Fsock/book", "/run/pg/sock", None),
    ("postgresql:///book?host=/run/pg", "/run/pg", None),
    ("host=localhost hostaddr=127.0.0.1", "localhost", "127.0.0.1"),
    ("host=localhost hostaddr=::1", "localhost", "::1"),
    # An empty hostaddr slot for localhost is pinned too; a socket slot stays empty.
    ("host=localhost,localhost hostaddr=,::1", "localhost,localhost", "127.0.0.1,::1"),
    ("host=/run/pg,localhost hostaddr=,", "/run/pg,localhost", ",127.0.0.1"),
    # Mismatched lists are left to libpq, which refuses to connect with them.
    ("host=localhost,localhost hostaddr=127.0.0.1", "localhost,localhost", "127.0.0.1"),
    ("hostaddr=127.0.0.1 dbname=book", None, "127.0.0.1"),
    ("dbname=book", None, None),
    ("", None, None),
]


@pytest.mark.parametrize(("dsn", "host", "hostaddr"), ALLOWED_DSNS)
def test_loopback_dsns_are_allowed(dsn: str, host: str | None, hostaddr: str | None) -> None:
    checked = params(loopback.check_dsn(dsn, NO_ENV))
    assert checked.get("host") == host
    assert checked.get("hostaddr") == hostaddr
    # Everything else the user gave survives unchanged.
    for key, value in params(dsn).items():
        if key != "hostaddr":
            assert checked[key] == value


def test_localhost_is_pinned_to_127_0_0_1() -> None:
    checked = loopback.check_dsn("postgres://book:pw@localhost:25432/book", NO_ENV)
    assert params(checked)["hostaddr"] == "127.0.0.1"
    assert params(checked)["password"] == "pw"


REFUSED_DSNS = [
    # The seed's two remote DSNs.
    (
        "postgres://book:book-lab-only@192.0.2.1:25432/book?sslmode=disable",
        "database host '192.0.2.1' is not loopback",
    ),
    (
        "host=127.0.0.1,192.0.2.1 port=25432,25432 user=book password=book-lab-only "
        "dbname=book sslmode=disable",
        "database host '192.0.2.1' is not loopback",
    ),
    ("postgresql://book:book-lab-only@127.0.0.1,db.example:5432/b", "host 'db.example' is not"),
    ("postgresql://book:book-lab-only@example.com/book", "host 'example.com' is not loopback"),
    ("host=/run/pg,192.0.2.1 password=book-lab-only", "host '192.0.2.1' is not loopback"),
    ("host=localhost. password=book-lab-only", "host 'localhost.' is not loopback"),
    ("host=LOCALHOST password=book-lab-only", "host 'LOCALHOST' is not loopback"),
    ("host=localhost.example.com", "host 'localhost.example.com' is not loopback"),
    ("host=127.1 password=book-lab-only", "host '127.1' is not loopback"),
    ("host=2130706433 password=book-lab-only", "host '2130706433' is not loopback"),
    ("host=0x7f.1 password=book-lab-only", "host '0x7f.1' is not loopback"),
    ("host=127.0.0.01 password=book-lab-only", "host '127.0.0.01' is not loopback"),
    ("host=0.0.0.0", "host '0.0.0.0' is not loopback"),
    ("host=::ffff:127.0.0.1", "host '::ffff:127.0.0.1' is not loopback"),
    ("host=::1%lo", "host (not shown) is not loopback"),
    ("postgresql://[::2]:5432/book", "host '::2' is not loopback"),
    ("postgresql://[fe80::1]:5432/book", "host 'fe80::1' is not loopback"),
    ("postgresql://[0:0:0:0:0:0:0:1]:5432/book", "host '0:0:0:0:0:0:0:1' is not loopback"),
    # hostaddr overrides host for the connection itself.
    ("host=localhost hostaddr=192.0.2.1 password=book-lab-only", "hostaddr '192.0.2.1' is not"),
    ("host=/run/pg hostaddr=192.0.2.1", "hostaddr '192.0.2.1' is not a loopback address"),
    ("hostaddr=127.0.0.1,192.0.2.1 host=localhost,localhost", "hostaddr '192.0.2.1' is not"),
    ("postgresql://127.0.0.1/book?hostaddr=192.0.2.1", "hostaddr '192.0.2.1' is not"),
    ("hostaddr=::2", "hostaddr '::2' is not a loopback address"),
    ("hostaddr=127.1", "hostaddr '127.1' is not a loopback address"),
    # A password that spills into the host field (unescaped '@') is never shown.
    ("postgresql://book:book-lab-only@secret@192.0.2.1/book", "host (not shown) is not loopback"),
    ("postgresql://book:book@book-lab-only/x", "host (not shown) is not loopback"),
    # Services can point anywhere.
    ("service=book password=book-lab-only", "names a service"),
    ("postgresql://book:book-lab-only@127.0.0.1/book?service=book", "names a service"),
    # A dbname that tools would expand into connection options.
    ("host=127.0.0.1 dbname='host=192.0.2.1'", "dbname is itself a connection string"),
    ("host=127.0.0.1 dbname=postgresql://192.0.2.1/x", "dbname is itself a connection string"),
    # Malformed: libpq's own message would quote the password.
    ("postgresql://book:book-lab-only@[::1/book", "database DSN is malformed"),
    ("host=127.0.0.1 password=book-lab-only nonsense", "database DSN is malformed"),
    ("host=127.0.0.1 password='book-lab-only", "database DSN is malformed"),
    ("postgresql://book:book-lab-only@127.0.0.1/book?evil=1", "database DSN is malformed"),
]


@pytest.mark.parametrize(("dsn", "reason"), REFUSED_DSNS)
def test_non_loopback_dsns_are_refused(dsn: str, reason: str) -> None:
    assert reason in refused_dsn(dsn)


# (environment, DSN, reason): libpq fills unset options from these variables.
REFUSED_ENVIRONMENTS = [
    ({"PGHOST": "192.0.2.1"}, "dbname=book", "names no host and PGHOST is set"),
    ({"PGHOST": "192.0.2.1"}, "hostaddr=127.0.0.1", "names no host and PGHOST is set"),
    ({"PGHOST": "192.0.2.1"}, "host=''", "names no host and PGHOST is set"),
    ({"PGHOSTADDR": "192.0.2.1"}, "dbname=book", "no hostaddr and PGHOSTADDR is set"),
    ({"PGHOSTADDR": "192.0.2.1"}, "host=/run/pg", "no hostaddr and PGHOSTADDR is set"),
    ({"PGSERVICE": "evil"}, "dbname=book", "PGSERVICE is set"),
    ({"PGSERVICE": "evil"}, "host=127.0.0.1", "PGSERVICE is set"),
    ({"PGSERVICEFILE": "/run/pg/pg_service.conf"}, "dbname=book", "PGSERVICEFILE is set"),
    ({"PGSYSCONFDIR": "/run/pg"}, "dbname=book", "PGSYSCONFDIR is set"),
]


@pytest.mark.parametrize(("environ", "dsn", "reason"), REFUSED_ENVIRONMENTS)
def test_redirecting_environment_is_refused(environ: dict[str, str], dsn: str, reason: str) -> None:
    assert reason in refused_dsn(dsn + " password=book-lab-only", environ)


@pytest.mark.parametrize(
    ("environ", "dsn"),
    [
        # An explicit host or hostaddr makes the variable irrelevant to libpq.
        ({"PGHOST": "192.0.2.1"}, "host=127.0.0.1"),
        ({"PGHOST": "192.0.2.1"}, "host=/run/pg"),
        ({"PGHOSTADDR": "192.0.2.1"}, "host=127.0.0.1"),  # pinned: hostaddr is now set
        ({"PGHOSTADDR": "192.0.2.1"}, "host=localhost"),
        ({"PGHOSTADDR": "192.0.2.1"}, "host=localhost,/run/pg"),
        ({"PGPORT": "1", "PGUSER": "x", "PGPASSWORD": "y"}, "dbname=book"),
        ({"PGHOST": ""}, "dbname=book"),
    ],
)
def test_environment_that_cannot_redirect_is_allowed(environ: dict[str, str], dsn: str) -> None:
    checked = params(loopback.check_dsn(dsn, environ))
    if "PGHOSTADDR" in environ:
        assert checked["hostaddr"]


def test_default_environment_is_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PGHOST", "192.0.2.1")
    with pytest.raises(errors.BoundaryViolation, match="PGHOST is set"):
        loopback.check_dsn("dbname=book")


@given(
    user=st.text("abcxyz", min_size=1, max_size=8),
    password=st.text(st.characters(codec="ascii", exclude_characters="\x00"), max_size=20),
    host=st.sampled_from(
        ["127.0.0.1", "localhost", "::1", "/run/pg/sock", "192.0.2.1", "10.0.0.1"]
    ),
)
def test_password_never_appears_in_a_refusal(user: str, password: str, host: str) -> None:
    # No refusal text contains a "Q", so a password holding one is never there by chance.
    password = "Q" + password
    dsn = conninfo.make_conninfo("", user=user, password=password, host=host, dbname="book")
    if host in ("192.0.2.1", "10.0.0.1"):
        with pytest.raises(errors.BoundaryViolation) as info:
            loopback.check_dsn(dsn, NO_ENV)
        assert password not in str(info.value)
    else:
        assert params(loopback.check_dsn(dsn, NO_ENV))["password"] == password


# ---------------------------------------------------------------------------
# Tool endpoints

ALLOWED_ENDPOINTS = [
    ("http://127.0.0.1:8080", "http://127.0.0.1:8080"),
    ("http://127.0.0.1:8080/", "http://127.0.0.1:8080"),
    ("http://localhost:8080", "http://127.0.0.1:8080"),
    ("http://localhost:1/", "http://127.0.0.1:1"),
    ("http://127.0.0.2:65535", "http://127.0.0.2:65535"),
    ("http://[::1]:8080", "http://[::1]:8080"),
    ("http://[::1]:8080/", "http://[::1]:8080"),
]


@pytest.mark.parametrize(("endpoint", "base"), ALLOWED_ENDPOINTS)
def test_loopback_endpoints_are_normalised(endpoint: str, base: str) -> None:
    assert loopback.check_endpoint(endpoint) == base
    url = httpx.URL(base)
    assert url.scheme == "http"
    assert url.port == int(base.rsplit(":", 1)[1])


REFUSED_ENDPOINTS = [
    # The seed's four unsafe endpoints.
    ("http://192.0.2.1:8080", "host '192.0.2.1' is not loopback"),
    ("https://127.0.0.1:8080", "must use plain http"),
    ("http://user:secret@127.0.0.1:8080", "must not carry credentials"),
    ("http://127.0.0.1:8080?token=secret", "must not carry a query"),
    # Scheme.
    ("ftp://127.0.0.1:8080", "must use plain http"),
    ("HTTP://127.0.0.1:8080", "must use plain http"),
    ("ws://127.0.0.1:8080", "must use plain http"),
    ("127.0.0.1:8080", "must be an absolute http:// URL"),
    ("http:127.0.0.1:8080", "must be an absolute http:// URL"),
    ("//127.0.0.1:8080", "must be an absolute http:// URL"),
    # Userinfo, query, fragment, path.
    ("http://user@127.0.0.1:8080", "must not carry credentials"),
    ("http://:secret@127.0.0.1:8080", "must not carry credentials"),
    ("http://127.0.0.1:8080@192.0.2.1:80", "must not carry credentials"),
    ("http://127.0.0.1:8080\\@192.0.2.1", "must not contain a backslash"),
    ("http://127.0.0.1:8080/?token=secret", "must not carry a query"),
    ("http://127.0.0.1:8080?", "must not carry a query"),
    ("http://127.0.0.1:8080#secret", "must not carry a fragment"),
    ("http://127.0.0.1:8080/api", "must not carry a path"),
    ("http://127.0.0.1:8080//", "must not carry a path"),
    ("http://127.0.0.1:8080/..", "must not carry a path"),
    # Numeric spellings a resolver would take as 127.0.0.1.
    ("http://2130706433:8080/", "numeric address not in canonical dotted-quad form"),
    ("http://0x7f.1:8080/", "numeric address not in canonical dotted-quad form"),
    ("http://0x7f000001:8080", "numeric address not in canonical dotted-quad form"),
    ("http://017700000001:8080", "numeric address not in canonical dotted-quad form"),
    ("http://0177.0.0.1:8080", "numeric address not in canonical dotted-quad form"),
    ("http://127.1:8080", "numeric address not in canonical dotted-quad form"),
    ("http://127.0.1:8080", "numeric address not in canonical dotted-quad form"),
    ("http://127.0.0.01:8080", "IPv4 host is not in canonical dotted-quad form"),
    ("http://127.000.000.001:8080", "IPv4 host is not in canonical dotted-quad form"),
    ("http://127.0.0.256:8080", "IPv4 host is not in canonical dotted-quad form"),
    ("http://127.0.0.%31:8080", "is not loopback"),
    # Trailing dots.
    ("http://localhost.:8080", "must not end with a dot"),
    ("http://127.0.0.1.:8080", "must not end with a dot"),
    # Names other than the exact loopback name.
    ("http://LOCALHOST:8080", "host 'LOCALHOST' is not loopback"),
    ("http://localhost.localdomain:8080", "is not loopback"),
    ("http://localhost.example.com:8080", "is not loopback"),
    ("http://example.com:8080", "host 'example.com' is not loopback"),
    ("http://\uff4c\uff4f\uff43\uff41\uff4c\uff48\uff4f\uff53\uff54:8080", "printable ASCII"),
    ("http://0.0.0.0:8080", "host '0.0.0.0' is not loopback"),
    ("http://10.0.0.1:8080", "host '10.0.0.1' is not loopback"),
    # IPv6.
    ("http://[::2]:8080", "host '::2' is not loopback"),
    ("http://[::]:8080", "host '::' is not loopback"),
    ("http://[::ffff:127.0.0.1]:8080", "IPv6 host is not in canonical form"),
    ("http://[::ffff:7f00:1]:8080", "host '::ffff:7f00:1' is not loopback"),
    ("http://[0:0:0:0:0:0:0:1]:8080", "IPv6 host is not in canonical form"),
    ("http://[::1%25lo]:8080", "IPv6 host must not carry a zone"),
    ("http://[::1]x:8080", "has text after the IPv6 host"),
    ("http://[::1:8080", "not a valid IPv6 literal"),
    ("http://[127.0.0.1]:8080", "not a valid IPv6 literal"),
    ("http://::1:8080", "is not loopback"),
    # Ports.
    ("http://127.0.0.1", "must name its port"),
    ("http://127.0.0.1/", "must name its port"),
    ("http://127.0.0.1:", "must name its port"),
    ("http://[::1]", "must name its port"),
    ("http://localhost", "must name its port"),
    ("http://127.0.0.1:0", "port must be a number from 1 to 65535"),
    ("http://127.0.0.1:08080", "port must be a number from 1 to 65535"),
    ("http://127.0.0.1:65536", "port must be a number from 1 to 65535"),
    ("http://127.0.0.1:+80", "port must be a number from 1 to 65535"),
    ("http://127.0.0.1:80a", "port must be a number from 1 to 65535"),
    # Whitespace and control characters (some parsers silently strip them).
    ("http://127.0.0.1:8080 ", "printable ASCII without spaces"),
    ("http://127.0.0.1\t:8080", "printable ASCII without spaces"),
    ("http://127.0.0.1:80\n80", "printable ASCII without spaces"),
    ("http://127.0.0.1:8080\x00", "printable ASCII without spaces"),
    ("", "must be an absolute http:// URL"),
    ("http://", "must name a host"),
    ("http://:8080", "must name a host"),
]


@pytest.mark.parametrize(("endpoint", "reason"), REFUSED_ENDPOINTS)
def test_unsafe_endpoints_are_refused(endpoint: str, reason: str) -> None:
    with pytest.raises(errors.BoundaryViolation) as info:
        loopback.check_endpoint(endpoint)
    message = str(info.value)
    assert reason in message
    assert message.startswith("tool endpoint ")
    assert "secret" not in message
    assert "\n" not in message


def _is_loopback_host(host: str) -> bool:
    return host == "localhost" or ipaddress.ip_address(host).is_loopback


def _piece(good: list[str], bad: list[str]) -> st.SearchStrategy[str]:
    # Good four times in five, so about a third of the endpoints are acceptable.
    return st.sampled_from([*good * (4 * len(bad)), *bad * len(good)])


endpoints = st.builds(
    "{}{}{}{}{}".format,
    _piece(["http://"], ["https://", "HTTP://", "http:/", "http:\\\\", "", "ftp://"]),
    _piece([""], ["user@", "u:p@", "@", ":@"]),
    _piece(
        ["127.0.0.1", "localhost", "[::1]", "127.0.0.9"],
        [
            "127.1",
            "0x7f.1",
            "2130706433",
            "0177.0.0.1",
            "localhost.",
            "LocalHost",
            "[::ffff:127.0.0.1]",
            "[::1%25lo]",
            "192.0.2.1",
            "[::]",
            "0.0.0.0",  # noqa: S104 (a host that must be refused)
            "127.0.0.1.",
            "::1",
            "",
            "127.0.0.1\\",
            "evil@127.0.0.1",
            "127.0.0.1@evil",
            "127.0.0.1%2f",
        ],
    ),
    _piece([":8080", ":1", ":65535"], [":0", ":65536", ":08080", ":", "", ":8080:1", ":-1"]),
    _piece(["", "/"], ["/x", "?", "?q=1", "#", "#f", "//", "/?", " ", "\t", "\\@evil"]),
)


@given(endpoints)
def test_accepted_endpoints_are_what_httpx_sees_as_loopback(endpoint: str) -> None:
    """Differential check: whatever is accepted, httpx parses the same loopback target."""
    _check_against_httpx(endpoint)


@given(st.text(max_size=40))
def test_arbitrary_text_endpoints(endpoint: str) -> None:
    _check_against_httpx(endpoint)


def _check_against_httpx(endpoint: str) -> None:
    try:
        base = loopback.check_endpoint(endpoint)
    except errors.BoundaryViolation as exc:
        message = str(exc)
        assert message.startswith("tool endpoint ") and message.isprintable()
        event("refused")
        return
    event("accepted")
    url = httpx.URL(endpoint)
    assert url.scheme == "http"
    assert _is_loopback_host(url.host)
    assert not url.userinfo and not url.query and not url.fragment
    assert url.path == "/"
    assert url.port is not None
    normalised = httpx.URL(base)
    assert normalised.port == url.port
    assert normalised.host == ("127.0.0.1" if url.host == "localhost" else url.host)


@given(
    host=st.sampled_from(["127.0.0.1", "localhost", "[::1]", "127.1", "0x7f.1", "2130706433"]),
    port=st.integers(-5, 70_000),
    suffix=st.sampled_from(["", "/", "/x", "?q", "#f", "//"]),
)
def test_endpoint_grid(host: str, port: int, suffix: str) -> None:
    endpoint = f"http://{host}:{port}{suffix}"
    canonical = host in ("127.0.0.1", "localhost", "[::1]")
    ok = canonical and 1 <= port <= 65535 and suffix in ("", "/")
    try:
        base = loopback.check_endpoint(endpoint)
    except errors.BoundaryViolation:
        assert not ok
        return
    assert ok
    assert base == f"http://{'[::1]' if host == '[::1]' else '127.0.0.1'}:{port}"
