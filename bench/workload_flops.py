"""Tokens and model FLOPs of a records file under a benchmark checkpoint (its tokenizer in
`base/`, its text config), counted in the prefix form's segments as examples/bench.rs counts
them: what a `score` run's FLOP rate divides by its scoring seconds.

    python bench/workload_flops.py --checkpoint bench/.cache/kev-0.8b --records FILE
"""

import argparse
import json
import sys
from pathlib import Path

from tokenizers import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import encode, flops, segments, text_config  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", type=Path, required=True)
    ap.add_argument("--records", type=Path, required=True)
    args = ap.parse_args()
    base = args.checkpoint / "base"
    tok = Tokenizer.from_file(str(base / "tokenizer.json"))
    with args.records.open(encoding="utf-8") as f:
        encoded = [encode(tok, json.loads(line)) for line in f if line.strip()]
    tokens = sum(len(s) + sum(len(r["ids"]) for r in rows) for s, rows in encoded)
    print(json.dumps({"workload": args.records.stem, "records": len(encoded), "tokens": tokens,
                      "gflop": flops(text_config(base), segments(encoded, "prefix")) / 1e9}))


if __name__ == "__main__":
    main()
