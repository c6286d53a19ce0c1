"""Writes the varied-traffic workload: records of every shape, as users send them.

    python bench/varied_records.py --n 10000 --out bench/.cache/records/varied-10k.jsonl

Each record's state is a stretch of natural text with numbers and code (the repository's own
docs and sources, which hold prose, tables, figures and Rust/Python/shell code) whose token count,
under the given tokenizer, is drawn log-uniformly from --min-state to --max-state (a few tokens to
a few thousand); 1-6 questions, each a sentence-length prompt and 2-6 options of 1-12 tokens
from the same text. Lengths are approximate (the state is cut at a word boundary at most its
target, counted as the sum of its words' tokens). The corpus is read from the checkout, so a commit defines the workload; seeded: a rerun
writes the same file. A summary of the token counts goes to stderr and to OUT's `.lengths.json`.

With --same-questions every record asks the first record's questions (one application's question
set over varied states); the states are those of the records without it.
"""

import argparse
import json
import math
import random
import re
import sys
from pathlib import Path

from tokenizers import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import QWEN_TOKENIZER, REPO, encode  # noqa: E402

CORPUS_GLOBS = ["docs/*.md", "README.md", "bench/README.md", "kev-core/src/*.rs", "src/score/*.rs",
                "bench/*.py", "scripts/*.sh", "tests/fixtures/records.jsonl"]


def corpus_words(tok):
    """The corpus as words (split on single spaces, so newlines stay inside them) and each word's
    token count with the space before it: a stretch's tokens are about the sum of its words'."""
    text = "\n".join(p.read_text(encoding="utf-8") for g in CORPUS_GLOBS for p in sorted(REPO.glob(g)))
    words = [w for w in text.split(" ") if w]
    counts = [len(e.ids) for e in tok.encode_batch([" " + w for w in words], add_special_tokens=False)]
    return words, counts


def stretch(corpus, rng, target):
    """Words from a random place whose tokens add up to at most `target` (one word at least)."""
    words, counts = corpus
    start = rng.randrange(len(words))
    end, total = start + 1, counts[start]
    while end < len(words) and total + counts[end] <= target:
        total += counts[end]
        end += 1
    return " ".join(words[start:end])


def clean(text):
    """Kev refuses its own markers in user text; the corpus names them."""
    return re.sub(r"<\|kev_(option|decide)\|>", "<kev marker>", text)


def record(corpus, rng, i, args):
    state_tokens = round(math.exp(rng.uniform(math.log(args.min_state), math.log(args.max_state))))
    state = stretch(corpus, rng, state_tokens)
    questions = []
    for j in range(rng.randint(1, 6)):
        prompt = stretch(corpus, rng, rng.randint(6, 40))
        n_options = rng.randint(2, 6)
        options = [clean(stretch(corpus, rng, rng.randint(1, 12))) for _ in range(n_options)]
        questions.append({"id": f"q{j + 1}", "prompt": clean(prompt), "options": options,
                          "answer": rng.randrange(n_options)})
    return {"id": f"v{i}", "state": clean(state), "questions": questions}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=10000)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokenizer", type=Path, default=QWEN_TOKENIZER)
    ap.add_argument("--min-state", type=int, default=4)
    ap.add_argument("--max-state", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=43)
    ap.add_argument("--same-questions", action="store_true")
    args = ap.parse_args()
    if not args.tokenizer.is_file():
        raise SystemExit(f"{args.tokenizer} is missing: python scripts/make_qwen_tokenizer.py "
                         f"--out {args.tokenizer.parent}")
    tok = Tokenizer.from_file(str(args.tokenizer))
    corpus = corpus_words(tok)
    rng = random.Random(args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    states, branches, totals = [], [], []
    with args.out.open("w", encoding="utf-8") as f:
        first = None
        for i in range(args.n):
            r = record(corpus, rng, i, args)
            first = first or r["questions"]
            if args.same_questions:
                r["questions"] = first
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
            s, rows = encode(tok, r)
            states.append(len(s))
            branches.extend(len(x["ids"]) for x in rows)
            totals.append(len(s) + sum(len(x["ids"]) for x in rows))
    q = lambda v, p: sorted(v)[min(len(v) - 1, int(p * len(v)))]
    summary = {"records": args.n, "tokens": sum(totals), "tokens_per_record": sum(totals) / args.n,
               "state_tokens": {"min": min(states), "median": q(states, 0.5), "p90": q(states, 0.9),
                                "max": max(states), "mean": sum(states) / len(states)},
               "branch_tokens": {"min": min(branches), "median": q(branches, 0.5), "max": max(branches),
                                 "mean": sum(branches) / len(branches)},
               "questions_per_record": len(branches) / args.n, "tokenizer": str(args.tokenizer)}
    args.out.with_suffix(".lengths.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary), file=sys.stderr)


if __name__ == "__main__":
    main()
