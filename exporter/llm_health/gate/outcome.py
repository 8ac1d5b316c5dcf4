"""What the one decision (`gate.decision`) hands a door: an `Outcome`, and for an admitted
request the `Attempt` the door finishes once the upstream answered."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from ..config.gate import Route

# An engine that sheds load answers these (a queue cap or a queue timeout of its own: 503;
# some routers 529; docs/admission.md names them): a refusal with no token spent, never work done.
UPSTREAM_REFUSALS = (503, 529)


def spent_units(status: int | None, units: int) -> int:
    """The token units an attempt spent: none for an upstream's refusal (UPSTREAM_REFUSALS),
    whatever its body reported."""
    return 0 if status in UPSTREAM_REFUSALS else units


@dataclass
class Attempt:
    """An admitted request, to be finished once its upstream answered."""

    request_id: str
    queue_id: str  # `<tenant>/<request id>`
    route: str
    tenant: str
    retry_count: int | None
    recorded: bool  # False: admitted while Redis was down, nothing to finish (unless late)
    attempt_id: str = field(default_factory=lambda: os.urandom(8).hex())
    # Admitted unrecorded because the enqueue timed out: it was sent, and a stalled Redis
    # may run it when it resumes, after the answer. Finished like a recorded attempt, and
    # once more after Redis answered again (`finish`): no record is left `running`.
    late: bool = False
    deadline_ms: int | None = None  # the record's deadline (Unix ms): tokens of an answer ended past it are late


@dataclass
class Outcome:
    admitted: bool
    status: int  # 200 when admitted
    decision: str  # core.admission's vocabulary, or bad_request / not_forwarded / internal
    headers: dict[str, str]  # to the client; when admitted, to the upstream too
    body: dict[str, Any] | None = None  # the refusal's JSON body
    route: Route | None = None
    attempt: Attempt | None = None

    def body_bytes(self) -> bytes:
        return json.dumps(self.body, separators=(",", ":")).encode() if self.body is not None else b""


def error_outcome(status: int, kind: str, message: str, headers: dict[str, str] | None = None, **extra: Any) -> Outcome:
    return Outcome(False, status, kind, headers or {}, {"error": {"type": kind, "message": message, **extra}})
