#!/usr/bin/env python3
"""Scores a JSONL dataset of Kev records on a Ray cluster with Ray Data.

Records are read from local paths or any filesystem Ray reads (s3://, gs://, abfs://, hdfs://,
a folder of files, globs), scored by `map_batches` over a pool of actors, each holding one
`kev.DecisionModel` (one GPU per actor on GPU clusters, CPU actors elsewhere), and written as one
JSONL file in input order. Every input record has an output line: the `score` example's line
for a scored record (`{"id", "questions": [{"id", "probs", "argmax", "option"}]}`), or
`{"id", "error", "error_type"}` for an invalid one, each with the record's `line` in its input
file (and `path`, when reading several files).

    # on this machine (a local Ray cluster), the shipped checkpoint and records
    python examples/ray_score.py --out scored.jsonl --actors 2
    # on a cluster: every node has `kev` installed (see README.md for the recipe)
    python examples/ray_score.py --address auto --checkpoint /models/my-kev \\
        --records s3://bucket/records/ --out s3://bucket/scored.jsonl --actors 16 --gpus-per-actor 1

As a library: `score_dataset(read_records(paths), checkpoint, ...)` returns the scored dataset
(columns `path`, `line`, `json`, `invalid`) to fit into a larger pipeline.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import numpy as np
import pyarrow as pa
import pyarrow.fs
import ray
from ray.data.datasource import FileBasedDatasource

ROOT = Path(__file__).resolve().parents[1]

#: What Rust's `str::trim` removes (Unicode White_Space): a line of only these is blank, and is
#: an error for its line as the Rust reader makes it (Python's `str.strip` also strips \x1c-\x1f).
WHITESPACE = (
    "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008"
    "\u2009\u200a\u2028\u2029\u202f\u205f\u3000"
)


def is_blank(raw: bytes) -> bool:
    try:
        return raw.decode("utf-8").strip(WHITESPACE) == ""
    except UnicodeDecodeError:
        return False


class JsonlLines(FileBasedDatasource):
    """Each line of JSONL files, with its 1-based line number in its file.

    The numbering is the Rust reader's (`kev::JsonlRecords`): every line is a record or an error
    for that line (blank ones too), a UTF-8 byte order mark at the start of a file is ignored. Lines stay bytes, so
    one that is not UTF-8 reaches the model, which reports it as the Rust reader does.
    Blocks hold `records_per_block` lines each (the last of a file fewer).
    """

    def __init__(self, paths, *, records_per_block: int = 1024, **kwargs):
        super().__init__(paths, **kwargs)
        self.records_per_block = records_per_block

    def _read_stream(self, f: "pa.NativeFile", path: str) -> Iterator[pa.Table]:
        paths: List[str] = []
        numbers: List[int] = []
        texts: List[bytes] = []
        number = 0
        rest = b""

        def block() -> pa.Table:
            table = pa.table(
                {
                    "path": pa.array(paths, pa.string()),
                    "line": pa.array(numbers, pa.int64()),
                    "text": pa.array(texts, pa.binary()),
                }
            )
            paths.clear()
            numbers.clear()
            texts.clear()
            return table

        def add(raw: bytes) -> None:
            nonlocal number
            number += 1
            if number == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]
            paths.append(path)
            numbers.append(number)
            texts.append(raw)

        while True:
            chunk = f.read(1 << 20)
            if not chunk:
                break
            lines = (rest + chunk).split(b"\n")
            rest = lines.pop()
            for raw in lines:
                add(raw)
                if len(texts) >= self.records_per_block:
                    yield block()
        if rest:
            add(rest)
        if texts:
            yield block()


def read_records(
    paths,
    filesystem: Optional["pyarrow.fs.FileSystem"] = None,
    records_per_block: int = 1024,
    cpus: float = 0,
) -> ray.data.Dataset:
    """A dataset of the records' lines (`path`, `line`, `text`) of JSONL `paths`, one read task
    per file. Blocks are not split further, so with `records_per_block` a multiple of the
    batch size every batch is a run of consecutive records from a batch-size boundary, as
    `score --batch-size` batches them (the same numbers, bit for bit, where no record is invalid). Reading
    is I/O: by default its tasks take no CPU slot, which the scoring actors hold."""
    source = JsonlLines(paths, filesystem=filesystem, records_per_block=records_per_block)
    return ray.data.read_datasource(source, num_cpus=cpus, override_num_blocks=len(source._paths()))


def f32_list(probs: np.ndarray) -> List[float]:
    """Each float32 as the float of its shortest decimal text: what `score` writes, and reads
    back as the same float32."""
    return [float(str(p)) for p in probs]


class Scorer:
    """One DecisionModel per actor; scores a batch of lines, reporting invalid ones."""

    def __init__(self, checkpoint: str, backend: str, dtype: str, lora_scale: float, paths: bool):
        import kev

        self.kev = kev
        self.model = kev.DecisionModel.load(
            checkpoint, backend=backend, dtype=dtype, lora_scale=lora_scale
        )
        self.paths = paths

    def __call__(self, batch: Dict[str, np.ndarray]) -> Dict[str, Any]:
        n = len(batch["line"])
        out: List[Optional[str]] = [None] * n
        invalid = np.zeros(n, dtype=bool)
        valid: List[int] = []
        for i, (text, line) in enumerate(zip(batch["text"], batch["line"])):
            if is_blank(text):
                message = f"record at line {int(line)}: blank line: every line must be a record"
                error = {"id": None, "error": message, "error_type": "RecordError"}
                out[i] = self.line(batch, i, error)
                invalid[i] = True
                continue
            try:
                # Checked with its line, so that an error names it as `score` does.
                self.model.encode(text, line=int(line))
            except self.kev.KevError as e:
                error = {"id": record_id(text), "error": str(e), "error_type": type(e).__name__}
                out[i] = self.line(batch, i, error)
                invalid[i] = True
            else:
                valid.append(i)
        texts = [batch["text"][i] for i in valid]
        for i, probs in zip(valid, self.model.probs_batch(texts) if texts else []):
            record = json.loads(batch["text"][i])
            questions = []
            for q, p in zip(record["questions"], probs):
                argmax = int(np.argmax(p))
                questions.append(
                    {"id": q.get("id"), "probs": f32_list(p), "argmax": argmax, "option": q["options"][argmax]}
                )
            out[i] = self.line(batch, i, {"id": record.get("id"), "questions": questions})
        return {"path": batch["path"], "line": batch["line"], "json": out, "invalid": invalid}

    def line(self, batch: Dict[str, np.ndarray], i: int, fields: dict) -> str:
        where = {"path": str(batch["path"][i])} if self.paths else {}
        return json.dumps({**where, "line": int(batch["line"][i]), **fields}, ensure_ascii=False)


def record_id(text: bytes) -> Optional[str]:
    """The id of an invalid record, where it can be read."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    rid = value.get("id") if isinstance(value, dict) else None
    return rid if isinstance(rid, str) else None


def score_dataset(
    lines: ray.data.Dataset,
    checkpoint: str,
    *,
    actors: int = 1,
    gpus_per_actor: float = 0,
    cpus_per_actor: float = 1,
    batch_size: int = 8,
    backend: str = "auto",
    dtype: str = "auto",
    lora_scale: float = 1.0,
    paths: bool = False,
) -> ray.data.Dataset:
    """`lines` (from `read_records`) scored by a pool of `actors` actors, each with one model:
    rows `path`, `line`, `json` (the output line) and `invalid`. A CPU actor's model computes
    on as many threads as the actor has CPUs (else each would use every core of its node)."""
    env = {} if gpus_per_actor else {"env_vars": {"RAYON_NUM_THREADS": str(max(1, int(cpus_per_actor)))}}
    return lines.map_batches(
        Scorer,
        fn_constructor_kwargs=dict(
            checkpoint=checkpoint, backend=backend, dtype=dtype, lora_scale=lora_scale, paths=paths
        ),
        batch_size=batch_size,
        batch_format="numpy",
        concurrency=actors,
        num_gpus=gpus_per_actor or None,
        num_cpus=cpus_per_actor,
        runtime_env=env or None,
    )


def open_output(out: str):
    """The output's filesystem and path (a URI Ray reads, or a local path)."""
    try:
        return pyarrow.fs.FileSystem.from_uri(out)
    except (pa.ArrowInvalid, ValueError):
        return pyarrow.fs.LocalFileSystem(), str(Path(out).resolve())


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", default=str(ROOT / "tests/fixtures/kev-small"),
                   help="checkpoint folder (holding kev.json), on every node (default: the shipped small one)")
    p.add_argument("--records", nargs="+", default=[str(ROOT / "tests/fixtures/records.jsonl")],
                   help="JSONL files, folders or URIs (default: the shipped sample records)")
    p.add_argument("--out", required=True, help="output JSONL file: a local path or a URI")
    p.add_argument("--address", default=None, help="Ray cluster to join (`auto`); default: a local one")
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs of the local Ray cluster")
    p.add_argument("--actors", type=int, default=1, help="actors (models) in the pool")
    p.add_argument("--gpus-per-actor", type=float, default=0, help="1 on GPU clusters")
    p.add_argument("--cpus-per-actor", type=float, default=1,
                   help="CPUs per actor; a CPU actor's model computes on this many threads")
    p.add_argument("--batch-size", type=int, default=8, help="records per probs_batch call")
    p.add_argument("--batches-per-block", type=int, default=128,
                   help="batches per block of the dataset (what one actor call takes at least)")
    p.add_argument("--backend", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--lora-scale", type=float, default=1.0)
    args = p.parse_args(argv)

    ray.init(address=args.address, num_cpus=args.num_cpus, include_dashboard=False,
             log_to_driver=False, configure_logging=False)
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True
    ctx.enable_progress_bars = False

    started = time.perf_counter()
    scored = score_dataset(
        read_records(args.records, records_per_block=args.batch_size * args.batches_per_block),
        args.checkpoint,
        actors=args.actors,
        gpus_per_actor=args.gpus_per_actor,
        cpus_per_actor=args.cpus_per_actor,
        batch_size=args.batch_size,
        backend=args.backend,
        dtype=args.dtype,
        lora_scale=args.lora_scale,
        paths=len(args.records) > 1,
    )
    fs, out = open_output(args.out)
    partial = out + ".partial"
    counts = {"records": 0, "invalid": 0}
    with fs.open_output_stream(partial) as f:
        for batch in scored.iter_batches(batch_format="numpy", batch_size=None):
            counts["records"] += len(batch["json"])
            counts["invalid"] += int(batch["invalid"].sum())
            f.write("".join(text + "\n" for text in batch["json"]).encode("utf-8"))
    fs.move(partial, out)
    elapsed = time.perf_counter() - started
    print(
        f"records: {counts['records']} ({counts['invalid']} invalid), "
        f"{counts['records'] / elapsed:.2f} records/s ({elapsed:.2f} s with the actors' start)",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
