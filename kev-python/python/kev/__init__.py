"""Kev decision models from Python, on the Rust runtime.

A Kev model answers multiple-choice questions about a shared state: a Qwen3.5 backbone read
out by a pointer head, giving one probability distribution per question of a record.

    >>> import kev
    >>> model = kev.DecisionModel.load("path/to/my-kev")
    >>> record = {"state": "It rains.",
    ...           "questions": [{"prompt": "Umbrella?", "options": ["yes", "no"]}]}
    >>> model.probs(record)                  # one float32 array per question
    >>> probs, prefix = model.probs_and_prefix(record)
    >>> model.probs_with_prefix(record, prefix)   # the state's cache reused
    >>> model.probs_batch([record, record])  # many records at once

Records are dicts in the Kev record schema or their JSON text; errors are subclasses of
`kev.KevError` carrying the library's message. Methods release the GIL while computing, and
one model may be shared by several threads.
"""

from ._errors import (
    ArgumentError,
    BackendError,
    CheckpointError,
    ConfigError,
    DeviceError,
    KevError,
    PrefixError,
    RecordError,
    TooLongError,
)
from ._kev import DecisionModel, Encoding, Prefix, PrefixCache, __version__

for _cls in (KevError, RecordError, TooLongError, PrefixError, ConfigError, ArgumentError,
             CheckpointError, DeviceError, BackendError):
    _cls.__module__ = __name__
del _cls

__all__ = [
    "DecisionModel",
    "Prefix",
    "PrefixCache",
    "Encoding",
    "KevError",
    "RecordError",
    "TooLongError",
    "PrefixError",
    "ConfigError",
    "ArgumentError",
    "CheckpointError",
    "DeviceError",
    "BackendError",
    "__version__",
]
