"""The error every configuration reader raises: it names the file, the key and the problem."""

from __future__ import annotations

from ..core.errors import LLMHealthError


class ConfigError(LLMHealthError, ValueError):
    """A configuration value is wrong (the config room's branch of the error tree,
    core.errors). The message names the file and the key."""

    def __init__(self, where: str, key: str, problem: str):
        self.where, self.key, self.problem = where, key, problem
        super().__init__(f"{where}: {key}: {problem}")
