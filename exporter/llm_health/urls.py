"""URLs as the package handles them: backend and `/probe` target URLs parsed strictly,
a backend's base URL, and URLs made safe to show."""

from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

from .core.errors import LLMHealthError

# What a path prefix may hold: RFC 3986 path characters, nothing that starts a query or
# a fragment, no backslash, no whitespace or control character.
_PATH = re.compile(r"^[A-Za-z0-9._~!$&'()*+,;=:@%/-]*$")


class BadTarget(LLMHealthError, ValueError):
    """A URL the exporter will not read: the message says what is wrong with it."""


def parse_target(raw: str, what: str = "target") -> str:
    """`http(s)://host[:port][/path prefix]` and nothing else, normalised.

    Refused: another scheme, no host, a bad port, credentials (they would show in labels
    and on /status; give an API key file instead), a query or a fragment (they would
    swallow the path llm-health appends), `..` in the path."""
    text = raw.strip()
    if not text or any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in text):
        raise BadTarget(f"{what} {raw[:200]!r} is not an http(s) URL (spaces or control characters)")
    try:
        parts = urlsplit(text)
        port = parts.port
        host = parts.hostname
    except ValueError as exc:
        raise BadTarget(f"{what} {raw[:200]!r} is not a valid URL: {exc}") from None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise BadTarget(f"{what} {raw[:200]!r} is not an http(s) URL")
    if parts.username is not None or parts.password is not None or "@" in parts.netloc:
        raise BadTarget(f"{what} must not carry credentials (user:password@): use an API key file or variable instead")
    if not host:
        raise BadTarget(f"{what} {raw[:200]!r} has no host")
    if "?" in text or "#" in text:
        raise BadTarget(f"{what} must not have a query (?) or a fragment (#): llm-health appends the path it reads")
    if not _PATH.match(parts.path) or any(seg in (".", "..") for seg in parts.path.split("/")):
        raise BadTarget(f"{what} path {parts.path[:200]!r} is not a plain path prefix")
    netloc = f"[{host}]" if ":" in host else host
    if port is not None:
        netloc += f":{port}"
    return urlunsplit((scheme, netloc, parts.path.rstrip("/"), "", ""))


def base_url(url: str) -> str:
    """The server's base URL; a trailing `/v1` (what OpenAI clients are given) is accepted."""
    url = url.strip().rstrip("/")
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    return url


def redact_url(url: str) -> str:
    """The URL with any password replaced by `***` (for status pages and logs)."""
    parts = urlsplit(url)
    if parts.password:
        netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
        return urlunsplit(parts._replace(netloc=netloc))
    return url
