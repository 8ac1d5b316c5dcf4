"""Simulated vLLM servers for tests and the demo (`servers`, rendered by `render`), the
simulated-time replay of a day of watchdogs (`replay`), the drills and the demo."""
