"""Type stubs of the native module `kev._kev` (re-exported by `kev`)."""

from __future__ import annotations

import os
import pathlib
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple, Union

import numpy as np
import numpy.typing as npt

__version__: str

#: A record: a mapping in the Kev record schema, or its JSON text (str, or UTF-8 bytes).
RecordLike = Union[Mapping[str, Any], str, bytes]
#: One float32 array per question, one value per option.
PerQuestion = List[npt.NDArray[np.float32]]

class Prefix:
    """A state run once through the backbone, reusable by `DecisionModel.probs_with_prefix`
    for any record with the same state. Immutable; threads may share it."""

    @property
    def state(self) -> str:
        """The state text this prefix was computed from."""
    @property
    def model_id(self) -> str:
        """The `model_id` of the model that computed it: only that model accepts it."""
    def __len__(self) -> int:
        """Number of state tokens."""

class PrefixCache:
    """Prefixes of states seen before, least recently used out first under a byte budget;
    keyed by model and state tokens. Threads may share it."""

    def __init__(self, budget_bytes: int) -> None: ...
    def stats(self) -> Dict[str, int]:
        """hits, misses, evictions, rejected, entries, bytes, budget."""
    def clear(self) -> None:
        """Drops every entry (the counters stay)."""

class Encoding:
    """A record encoded (KEV.md §2)."""

    @property
    def ids(self) -> List[int]:
        """State ids, then each branch's ids in question order."""
    @property
    def segments(self) -> List[int]:
        """Segment of each id: 0 for the state, j + 1 for question j's branch."""
    @property
    def state_len(self) -> int:
        """Number of state tokens."""
    @property
    def state_ids(self) -> List[int]:
        """The state's ids."""
    @property
    def branches(self) -> List[Dict[str, Any]]:
        """Per question: {"start", "len", "decide", "opts"} (positions relative to the branch)."""
    def rows(self) -> Tuple[List[int], List[Dict[str, Any]]]:
        """The state's ids and one row {"ids", "decide", "opts"} per question."""
    def __len__(self) -> int: ...

class DecisionModel:
    """A Kev checkpoint loaded for scoring. Every method releases the GIL while computing;
    one model may be used by several threads at once."""

    @staticmethod
    def load(
        path: Union[str, os.PathLike[str]],
        backend: str = "auto",
        dtype: str = "auto",
        lora_scale: float = 1.0,
        *,
        prefill_chunk: Optional[int] = None,
        cuda_graphs: bool = True,
    ) -> DecisionModel:
        """Loads the checkpoint folder `path` (holding kev.json).

        backend: "auto", "cpu", "cuda[:i]" or "metal[:i]"; dtype: "auto", "f32", "bf16", "f16"
        or "int8" (x86-64 CPU with AVX2 and FMA; approximate); lora_scale: 0 = base model,
        1 = fine-tune."""
    def encode(self, record: RecordLike, *, line: Optional[int] = None) -> Encoding:
        """Token ids, segments and head positions; `line` is named by any error."""
    def forward(self, record: RecordLike) -> PerQuestion:
        """Logits per question (prefix form)."""
    def forward_rows(self, record: RecordLike) -> PerQuestion:
        """Logits per question in row form (the reference; slower)."""
    def probs(self, record: RecordLike) -> PerQuestion:
        """Probabilities per question."""
    def probs_and_prefix(self, record: RecordLike) -> Tuple[PerQuestion, Prefix]:
        """Probabilities per question and the state's prefix for reuse."""
    def probs_with_prefix(self, record: RecordLike, prefix: Prefix) -> PerQuestion:
        """Probabilities per question, reusing `prefix` (of the same state, else PrefixError)."""
    def prefix(self, state: str) -> Prefix:
        """Runs the state text once into a Prefix."""
    def probs_batch(self, records: Iterable[RecordLike]) -> List[PerQuestion]:
        """Probabilities for many records at once, in order: run in batches of the device's token
        budget, Ctrl-C interrupting between batches; the first invalid record raises before any runs."""
    def probs_cached(self, records: Iterable[RecordLike], cache: PrefixCache) -> List[PerQuestion]:
        """Probabilities for the records as one batch (no token-budget split), reusing the
        prefixes `cache` holds for their states and keeping the new ones there."""
    @property
    def head(self) -> Dict[str, npt.NDArray[np.float32]]:
        """The pointer head's weights: q.weight [dim, hidden], q.bias [dim], k.weight, k.bias."""
    @property
    def head_dim(self) -> int: ...
    @property
    def temperature(self) -> float: ...
    @property
    def model_id(self) -> str:
        """Fingerprint of the loaded model (32 hex digits): equal for two loads of the same
        files with the same settings; a `Prefix` made by a model with another id is refused."""
    @property
    def dtype(self) -> str:
        """The weights' dtype: "f32", "bf16", "f16" or "int8"."""
    @property
    def activation_dtype(self) -> str: ...
    @property
    def device(self) -> str:
        """"cpu", "cuda:i" or "metal:i"."""
    @property
    def path(self) -> pathlib.Path:
        """The checkpoint folder."""
    @property
    def max_tokens(self) -> int: ...
