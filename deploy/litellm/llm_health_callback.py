"""llm-health's admission for a LiteLLM proxy: put this file beside your config.yaml and
name it in `litellm_settings.callbacks` (deploy/litellm/config.yaml). The gate's
configuration file (routes, admission, redis) is named by LLM_HEALTH_GATE_CONFIG;
llm-health (`pip install 'llm-health[gate]'`) must be importable by LiteLLM's Python."""

from llm_health.gate.litellm_hook import handler

proxy_handler_instance = handler()
