"""The LiteLLM door: a LiteLLM `CustomLogger` that asks `gate.decision` before each call
(`async_pre_call_hook`: a refusal is raised as LiteLLM's `ProxyException`, with the
gate's status and `Retry-After`, the gate's error fields in the OpenAI-shaped body's
`provider_specific_fields`) and finishes the attempt after it: the
upstream's status and the usage tokens (`async_post_call_success_hook`, the failure hook,
and for streams the iterator hook, which also sees a client leave).

Installed the way LiteLLM users install callbacks, from a file beside their config.yaml
(deploy/litellm/llm_health_callback.py):

    litellm_settings:
      callbacks: llm_health_callback.proxy_handler_instance

The gate's configuration file is named by `LLM_HEALTH_GATE_CONFIG`. litellm is imported
only by `handler()`, in LiteLLM's own process.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping
from typing import Any
from urllib.parse import urlsplit

from multidict import CIMultiDict

from ..config.gate import parse_gate_config
from ..config.load import load_yaml
from .decision import Admission, Attempt, Outcome

# The request fields of the OpenAI API a client sends (chat, completions, embeddings,
# responses): what a retry re-sends unchanged, and tells one request from another.
CLIENT_FIELDS = frozenset(
    [
        "model",
        "messages",
        "prompt",
        "input",
        "instructions",
        "suffix",
        "stream",
        "stream_options",
        "temperature",
        "top_p",
        "n",
        "stop",
        "max_tokens",
        "max_completion_tokens",
        "max_output_tokens",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        "logprobs",
        "top_logprobs",
        "user",
        "seed",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "functions",
        "function_call",
        "response_format",
        "modalities",
        "audio",
        "reasoning_effort",
        "echo",
        "best_of",
        "encoding_format",
        "dimensions",
    ]
)
MAX_OPEN_ATTEMPTS = 10_000  # admitted calls awaiting their end; the oldest is dropped past it


def request_of(data: Mapping[str, Any], caller: str | None = None) -> tuple[str, str, CIMultiDict[str], bytes]:
    """(method, path, headers, body) from LiteLLM's call data: the request fields the client
    sent, in a canonical JSON (sorted keys), for routing by model and for the fingerprint
    that matches a retry sent without an id to its first copy; ``caller``, the hashed
    LiteLLM key of the caller, stands in for the credentials LiteLLM strips from the
    headers it hands over (`Api-Key`, hashed into that fingerprint, never kept)."""
    psr = data.get("proxy_server_request") or {}
    url = urlsplit(str(psr.get("url") or "/v1/chat/completions"))
    path = url.path if url.path.startswith("/v1/") else "/v1" + url.path  # LiteLLM serves both forms
    raw = path + ("?" + url.query if url.query else "")
    headers: CIMultiDict[str] = CIMultiDict((str(k), str(v)) for k, v in (psr.get("headers") or {}).items())
    # LiteLLM's snapshot of the body (and `data`) carries fields of its own per call (call
    # ids, metadata, times): only the fields of the OpenAI request the client sent count.
    sent = {k: v for k, v in data.items() if k in CLIENT_FIELDS}
    try:
        body = json.dumps(sent, sort_keys=True, separators=(",", ":"), default=str).encode()
    except (TypeError, ValueError):
        body = json.dumps({"model": data.get("model")}).encode()
    if caller:
        headers["Api-Key"] = caller
    return str(psr.get("method") or "POST"), raw, headers, body


def usage_units(response: Any) -> int:
    usage = getattr(response, "usage", None)
    if usage is None and isinstance(response, Mapping):
        usage = response.get("usage")
    if usage is None:
        return 0
    get = usage.get if isinstance(usage, Mapping) else lambda k: getattr(usage, k, None)
    total = get("total_tokens")
    if total is None:
        total = (get("prompt_tokens") or 0) + (get("completion_tokens") or 0)
    return int(total) if isinstance(total, int | float) else 0


class Hook:
    """The decision and the record for one LiteLLM process (its event loop makes the
    Redis client, on the first call)."""

    def __init__(self, config_file: str):
        self.config_file = config_file
        self._admission: Admission | None = None
        self._open: OrderedDict[str, Attempt] = OrderedDict()

    @property
    def admission(self) -> Admission:
        if self._admission is None:
            self._admission = Admission(parse_gate_config(load_yaml(self.config_file), self.config_file))
        return self._admission

    async def decide(self, data: dict[str, Any], caller: str | None = None) -> Outcome:
        method, raw, headers, body = request_of(data, caller)
        outcome = await self.admission.decide(method, raw, headers, body)
        call_id = str(data.get("litellm_call_id") or "")
        if outcome.admitted and outcome.attempt is not None and call_id:
            self._open[call_id] = outcome.attempt
            while len(self._open) > MAX_OPEN_ATTEMPTS:
                self._open.popitem(last=False)
        return outcome

    def finish(self, data: Mapping[str, Any], status: int | None, units: int) -> None:
        attempt = self._open.pop(str(data.get("litellm_call_id") or ""), None)
        if attempt is not None:
            self.admission.finish_later(attempt, status, units)


def handler(config_file: str | None = None) -> Any:
    """The CustomLogger instance for `litellm_settings.callbacks`."""
    from litellm.integrations.custom_logger import CustomLogger  # type: ignore[import-not-found]
    from litellm.proxy._types import ProxyException  # type: ignore[import-not-found]

    hook = Hook(config_file or os.environ["LLM_HEALTH_GATE_CONFIG"])

    class LLMHealthAdmission(CustomLogger):
        async def async_pre_call_hook(self, user_api_key_dict: Any, cache: Any, data: dict, call_type: Any) -> Any:
            outcome = await hook.decide(data, str(getattr(user_api_key_dict, "token", "") or "") or None)
            if outcome.admitted:
                return data
            err = (outcome.body or {}).get("error", {})
            raise ProxyException(
                message=str(err.get("message", outcome.decision)),
                type=str(err.get("type", "admission_rejected")),
                param=None,
                code=outcome.status,
                headers=dict(outcome.headers),
                # LiteLLM's error body is OpenAI's (`code` is the status): the gate's fields,
                # decision code first, go in provider_specific_fields.
                provider_specific_fields={**err, "code": outcome.decision},
            )

        async def async_post_call_success_hook(self, data: dict, user_api_key_dict: Any, response: Any) -> Any:
            hook.finish(data, 200, usage_units(response))
            return response

        async def async_post_call_failure_hook(
            self, request_data: dict, original_exception: Exception, user_api_key_dict: Any, traceback_str: Any = None
        ) -> Any:
            status = str(getattr(original_exception, "status_code", None) or getattr(original_exception, "code", None))
            hook.finish(request_data, int(status) if status.isdigit() else 502, 0)
            return None

        async def async_post_call_streaming_iterator_hook(self, user_api_key_dict: Any, response: Any, request_data: dict) -> AsyncIterator[Any]:
            units, status = 0, 499  # 499 unless the stream ran to its end (a client gone, as nginx names it)
            try:
                async for chunk in response:
                    units = usage_units(chunk) or units
                    yield chunk
                status = 200
            finally:
                hook.finish(request_data, status, units)

    return LLMHealthAdmission()
