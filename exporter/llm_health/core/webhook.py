"""The Alertmanager webhook body (version 4), validated completely before anything acts on
any of it. Pure: no I/O."""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass, field

from .errors import CoreError

WEBHOOK_VERSION = "4"
# What one notification may hold. Past MAX_ALERTS alerts a notification is not refused (a
# 4xx, which Alertmanager does not retry, would drop a hung alert inside it): only the
# alerts the receiver watches are read, at most MAX_ALERTS of them; the others are left
# unread. The other bounds refuse a body whole.
MAX_ALERTS = 1000
MAX_LABELS_CHARS = 64 * 1024  # characters (not bytes) of one alert's label names and values, and of its annotations'
MAX_FIELD = 1024  # characters of startsAt and fingerprint


class Malformed(CoreError, ValueError):
    """The body is not an Alertmanager webhook (version 4) we can act on."""


def fingerprint(labels: dict[str, str]) -> str:
    """Alertmanager's fingerprint of a label set (FNV-1a 64 over sorted name, 0xff, value,
    0xff), for bodies from versions that did not send one: the same key either way."""
    h = 14695981039346656037
    for name in sorted(labels):
        for part in (name.encode(), b"\xff", labels[name].encode(), b"\xff"):
            for byte in part:
                h = ((h ^ byte) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


@dataclass(frozen=True)
class Alert:
    alertname: str
    status: str  # firing or resolved
    labels: dict[str, str]
    starts_at: str
    fingerprint: str
    annotations: dict[str, str] = field(default_factory=dict)

    @property
    def key(self) -> tuple[str, str]:
        """Idempotency key: one alert instance (a re-fired alert has a new startsAt)."""
        return (self.fingerprint, self.starts_at)


@dataclass(frozen=True)
class Webhook:
    receiver: str
    status: str
    alerts: tuple[Alert, ...]
    truncated_alerts: int = 0  # Alertmanager's own count of alerts its max_alerts left out
    total: int = 0  # alerts in the body
    unread: int = 0  # of those, left unread (a body of more than MAX_ALERTS)
    unread_watched: int = 0  # of those, watched ones past the MAX_ALERTS read


def _strings(value: object, where: str) -> dict[str, str]:
    """An alert's labels or annotations: an object of strings, bounded in size."""
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise Malformed(f"{where}: expected an object of strings")
    if sum(len(k) + len(v) for k, v in value.items()) > MAX_LABELS_CHARS:
        raise Malformed(f"{where}: more than {MAX_LABELS_CHARS} characters")
    return dict(value)


def _alertname(a: object) -> object:
    labels = a.get("labels") if isinstance(a, dict) else None
    return labels.get("alertname") if isinstance(labels, dict) else None


def parse_webhook(body: bytes | str, watched: Collection[str] | None = None) -> Webhook:
    """Validate a webhook body completely before anything acts on any of it.

    A body of at most MAX_ALERTS alerts is validated whole. Past that, only the alerts
    whose `alertname` is in `watched` (every alert when None) are read and validated, the
    first MAX_ALERTS of them in the body's order; the others are counted as unread and
    never looked at again."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise Malformed(f"not JSON: {exc}") from None
    except RecursionError:
        raise Malformed("not a webhook: JSON nested too deeply") from None
    if not isinstance(data, dict):
        raise Malformed(f"expected a JSON object, got {type(data).__name__}")
    version = data.get("version")
    if version != WEBHOOK_VERSION:
        raise Malformed(f"webhook version {version!r}: expected {WEBHOOK_VERSION!r}")
    group_status = data.get("status")
    if group_status not in ("firing", "resolved"):
        raise Malformed(f"status {group_status!r}: expected firing or resolved")
    raw = data.get("alerts")
    if not isinstance(raw, list) or not raw:
        raise Malformed("alerts: expected a non-empty list")
    picked: list[tuple[int, object]] = list(enumerate(raw))
    unread_watched = 0
    if len(raw) > MAX_ALERTS:
        if watched is not None:
            picked = [(i, a) for i, a in picked if _alertname(a) in watched]
        unread_watched = max(0, len(picked) - MAX_ALERTS)
        picked = picked[:MAX_ALERTS]
    alerts = []
    for i, a in picked:
        if not isinstance(a, dict):
            raise Malformed(f"alerts[{i}]: expected an object")
        labels = _strings(a.get("labels"), f"alerts[{i}].labels")
        annotations = _strings(a.get("annotations", {}), f"alerts[{i}].annotations")
        if not labels.get("alertname"):
            raise Malformed(f"alerts[{i}].labels.alertname: missing")
        starts_at = a.get("startsAt")
        if not isinstance(starts_at, str) or not starts_at or len(starts_at) > MAX_FIELD:
            raise Malformed(f"alerts[{i}].startsAt: missing or longer than {MAX_FIELD} characters")
        status = a.get("status", group_status)  # older bodies carry only the group's status
        if status not in ("firing", "resolved"):
            raise Malformed(f"alerts[{i}].status {status!r}: expected firing or resolved")
        fp = a.get("fingerprint")
        if fp is not None and (not isinstance(fp, str) or not fp or len(fp) > MAX_FIELD):
            raise Malformed(f"alerts[{i}].fingerprint: expected a non-empty string of at most {MAX_FIELD} characters")
        alerts.append(Alert(labels["alertname"], status, labels, starts_at, fp or fingerprint(labels), annotations))
    truncated = data.get("truncatedAlerts", 0)
    return Webhook(
        str(data.get("receiver", "")),
        group_status,
        tuple(alerts),
        truncated if isinstance(truncated, int) and not isinstance(truncated, bool) else 0,
        total=len(raw),
        unread=len(raw) - len(alerts),
        unread_watched=unread_watched,
    )
