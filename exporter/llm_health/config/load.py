"""Reading a YAML configuration file, with errors that name the file and the line."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from .errors import ConfigError


def load_yaml(path: str | os.PathLike[str]) -> Any:
    """A YAML file's data; a ConfigError naming the file and the line where it is not YAML.
    Every configuration the package reads (exporter, gate, restarter) goes through here."""
    where = str(path)
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(where, "(file)", f"cannot read: {exc.strerror}") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "(parse)"
        raise ConfigError(where, at, f"not valid YAML: {getattr(exc, 'problem', exc)}") from None
