"""Where Redis is: a single server, a Sentinel-watched primary or a Cluster, told apart by
the URL alone, so every component (lease library, gate, exporter, restarter) is pointed
at any of them by the one `url` it already has. Pure: no Redis import, so configuration
can check a URL without the `redis` extra installed.

```
redis://[user:pass@]host:6379/0           one server (also rediss://, unix:///path?db=0)
redis+sentinel://[user:pass@]h1:26379,h2:26379,h3:26379/mymaster/0
redis+cluster://[user:pass@]h1:7000,h2:7001,h3:7002
```

The `+sentinel` and `+cluster` forms also come as `rediss+...` (TLS to the data nodes).
The user and password are the data nodes' (Sentinel's own `requirepass`, if any, is
`sentinel_password` in the query). Query parameters every form takes:

- `wait_replicas` (default 0 on one server, `all` on Sentinel, 1 on Cluster): a claim,
  renewal or restart record counts only once this many replicas acknowledged it
  (`WAIT`); `all` is every replica Sentinel lists as up for the service;
- `wait_timeout_ms` (default 500): how long to wait for them before the write is undone
  and reported as failed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from .codes import StoreError

SINGLE_SCHEMES = ("redis", "rediss", "unix")
SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
ALL_SCHEMES = SINGLE_SCHEMES + SENTINEL_SCHEMES + CLUSTER_SCHEMES
KINDS = ("single", "sentinel", "cluster")
ALL_REPLICAS = -1  # wait_replicas=all: every replica Sentinel lists as up
DEFAULT_WAIT_TIMEOUT_MS = 500
_OWN_PARAMS = ("wait_replicas", "wait_timeout_ms", "sentinel_password")


class TargetError(StoreError, ValueError):
    """A Redis URL that cannot be used; the message names the part that is wrong."""


@dataclass(frozen=True)
class RedisTarget:
    kind: str  # one of KINDS
    url: str = field(repr=False)  # as given (may hold a password)
    hosts: tuple[tuple[str, int], ...] = ()  # sentinels or cluster seed nodes
    service: str | None = None  # Sentinel's name of the primary
    db: int = 0
    tls: bool = False
    username: str | None = field(default=None, repr=False)
    password: str | None = field(default=None, repr=False)
    sentinel_password: str | None = field(default=None, repr=False)
    wait_replicas: int = 0
    wait_timeout_ms: int = DEFAULT_WAIT_TIMEOUT_MS

    @property
    def single_url(self) -> str:
        """The URL redis-py's own `from_url` takes (one server), without our parameters."""
        base, _, query = self.url.partition("?")
        kept = [kv for kv in query.split("&") if kv and kv.split("=", 1)[0] not in _OWN_PARAMS]
        return base + ("?" + "&".join(kept) if kept else "")

    @property
    def plain_tcp(self) -> bool:
        """One server over plain TCP (``redis://host:port/db``): no Sentinel, Cluster, TLS or
        unix socket (what the nginx Lua door can reach)."""
        return self.url.partition("://")[0] == "redis"

    def describe(self) -> str:
        """Where it points, never a password: for logs and errors."""
        if self.kind == "single":
            parts = urlsplit(self.url)
            return f"{parts.scheme}://{parts.hostname or ''}{':' + str(parts.port) if parts.port else ''}{parts.path}"
        nodes = ",".join(f"{h}:{p}" for h, p in self.hosts)
        return f"{self.kind} {nodes}" + (f" service {self.service} db {self.db}" if self.service else "")


def redacted(url: str) -> str:
    """``url`` without what may be secret (the ``user:password@`` part, and the query,
    which may hold ``sentinel_password``): for errors and logs."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    at, query = rest.rfind("@"), rest.find("?")
    if at != -1 and query != -1 and query < at:
        # a "?" before the last "@": a password with a raw "?" in it, or an "@" in the query
        # (a sentinel_password): which part is secret cannot be told, so none is shown
        return scheme + sep + "..."
    return scheme + sep + rest.rsplit("@", 1)[-1].partition("?")[0]  # a password may hold a "/"


def _int_param(params: dict[str, list[str]], name: str, default: int, minimum: int, allow_all: bool = False) -> int:
    if name not in params:
        return default
    raw = params[name][-1]
    if allow_all and raw == "all":
        return ALL_REPLICAS
    try:
        value = int(raw)
    except ValueError:
        raise TargetError(f"{name}={raw!r} is not an integer") from None
    if value < minimum:
        raise TargetError(f"{name}={value} must be at least {minimum}")
    return value


def _hosts(netloc: str, scheme: str, default_port: int) -> tuple[tuple[str, int], ...]:
    hostpart = netloc.rsplit("@", 1)[-1]
    if not hostpart:
        raise TargetError(f"{scheme}:// needs at least one host:port")
    out = []
    for item in hostpart.split(","):
        host, sep, port = item.rpartition(":")
        if not sep:
            host, port = item, str(default_port)
        host = host.strip("[]")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise TargetError(f"{scheme}://: {item!r} is not host:port")
        out.append((host, int(port)))
    return tuple(out)


def parse_target(url: str) -> RedisTarget:
    """Parse a Redis URL of any of the three forms; TargetError says what is wrong."""
    scheme = url.split("://", 1)[0] if "://" in url else ""
    if scheme not in ALL_SCHEMES:
        raise TargetError(f"must start with one of {', '.join(s + '://' for s in ALL_SCHEMES)}; got {url.split('://', 1)[0]!r}")
    # urlsplit rejects a netloc with several ports; take the netloc apart ourselves.
    rest = url.split("://", 1)[1]
    netloc, _, tail = rest.partition("/")
    path, _, query = tail.partition("?")
    if "?" in netloc:
        netloc, _, query = netloc.partition("?")
    params = parse_qs(query)
    userinfo = netloc.rsplit("@", 1)[0] if "@" in netloc else ""
    user, _, password = userinfo.partition(":")
    common: dict[str, Any] = {
        "url": url,
        "username": unquote(user) or None,
        "password": unquote(password) or None,
        "sentinel_password": params.get("sentinel_password", [None])[-1],
        "wait_timeout_ms": _int_param(params, "wait_timeout_ms", DEFAULT_WAIT_TIMEOUT_MS, 1),
        "tls": scheme.startswith("rediss"),
    }
    if scheme in SINGLE_SCHEMES:
        db_text = path.strip("/") or params.get("db", ["0"])[-1]
        if scheme == "unix":
            db_text = params.get("db", ["0"])[-1]
        if not db_text.isdigit():
            raise TargetError(f"database {db_text!r} is not a number")
        return RedisTarget("single", db=int(db_text), wait_replicas=_int_param(params, "wait_replicas", 0, 0), **common)
    if scheme in SENTINEL_SCHEMES:
        hosts = _hosts(netloc, scheme, 26379)
        pieces = [p for p in path.split("/") if p]
        if not pieces:
            raise TargetError(f"{scheme}:// needs the service name after the hosts: .../mymaster/0")
        if len(pieces) > 2 or (len(pieces) == 2 and not pieces[1].isdigit()):
            raise TargetError(f"{scheme}://: the path must be /<service>[/<db>], got /{path}")
        db = int(pieces[1]) if len(pieces) == 2 else 0
        return RedisTarget(
            "sentinel", hosts=hosts, service=pieces[0], db=db, wait_replicas=_int_param(params, "wait_replicas", ALL_REPLICAS, 0, allow_all=True), **common
        )
    hosts = _hosts(netloc, scheme, 6379)
    if path.strip("/") not in ("", "0"):
        raise TargetError(f"{scheme}://: Redis Cluster has database 0 only, got /{path}")
    return RedisTarget("cluster", hosts=hosts, wait_replicas=_int_param(params, "wait_replicas", 1, 0), **common)
