"""llm-health: tell busy from hung LLM inference servers from the engine's own counters."""

__version__ = "0.1.0"
