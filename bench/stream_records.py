"""Writes N records for the streaming measurements of `score` (issue 23): the fixture records
(tests/fixtures/records.jsonl) repeated in order, each copy's id suffixed with its index so that
every output line is distinct.

    python3 bench/stream_records.py --n 1000000 --out bench/.cache/stream-1m.jsonl

The output goes under bench/.cache/ (ignored by git); 1M records are about 470 MB.
"""

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--records", type=Path, default=ROOT / "tests/fixtures/records.jsonl")
    args = ap.parse_args()
    base = [json.loads(l) for l in args.records.read_text(encoding="utf-8").splitlines() if l.strip()]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", encoding="utf-8") as f:
        for i in range(args.n):
            r = dict(base[i % len(base)])
            r["id"] = f"{r.get('id') or 'r'}-{i}"
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
