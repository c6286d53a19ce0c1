"""The exceptions of the `kev` package.

Each carries the library's message (with the causes it wraps, joined by ": "), and, as
attributes, what locates the fault; attributes that do not apply are None.
"""

from __future__ import annotations

from typing import Optional


class KevError(Exception):
    """Base class of every error the Kev runtime raises."""


class RecordError(KevError, ValueError):
    """A record is not valid (KEV.md §1): wrong type, missing or unknown field, empty list,
    out-of-range answer, a marker string inside its text, or not JSON at all.

    `line` is the record's line when one was given, `record_id` its id when it could be read,
    `field` the path of the faulty field inside the record (None for the record as a whole).
    """

    line: Optional[int] = None
    record_id: Optional[str] = None
    field: Optional[str] = None


class TooLongError(RecordError):
    """A record's state plus its longest branch is longer than the checkpoint's `max_tokens`
    (records are never truncated): `tokens` needed, `max_tokens` allowed."""

    tokens: Optional[int] = None
    max_tokens: Optional[int] = None


class PrefixError(KevError, ValueError):
    """A prefix was used with a record whose state is not the prefix's."""


class ConfigError(KevError, ValueError):
    """A configuration file (`kev.json`, `adapter_config.json`, `config.json`) is not valid
    JSON, or a value in it is missing, ill-typed, out of range or unsupported; or a marker of
    `kev.json` is not a single token. `path` is the file, `field` the value's dotted path."""

    path: Optional[str] = None
    field: Optional[str] = None
    marker: Optional[str] = None


class ArgumentError(KevError, ValueError):
    """An argument is invalid (a backend or dtype name, a non-finite `lora_scale`, ...);
    `name` is the argument's."""

    name: Optional[str] = None


class CheckpointError(KevError, OSError):
    """A checkpoint cannot be used: a file is missing or unreadable, a weight, adapter or
    head tensor is missing, mis-shaped or unknown (`name`), an adapter or tokenizer is
    unusable. `path` is the file involved when known."""

    path: Optional[str] = None
    name: Optional[str] = None


class DeviceError(KevError, RuntimeError):
    """The requested device is not built into this package or not on this machine."""


class BackendError(KevError, RuntimeError):
    """The tensor backend failed while the model ran (the message says at which step)."""


__all__ = [
    "KevError",
    "RecordError",
    "TooLongError",
    "PrefixError",
    "ConfigError",
    "ArgumentError",
    "CheckpointError",
    "DeviceError",
    "BackendError",
]
