"""URLs as the package handles them: a backend's base URL, and URLs made safe to show."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit


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
