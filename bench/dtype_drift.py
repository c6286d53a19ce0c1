"""How far one `score` output is from another of the same records (a dtype's drift from f32).

    python bench/dtype_drift.py F32.jsonl OTHER.jsonl [--label int8]

Both files are `score`'s output lines (one per record, in input order). Prints one JSON line:
the records and questions compared, the largest |Δp| over every option, the mean over questions
of each question's largest |Δp|, and the questions whose argmax differs. Records or questions
that do not pair up (a different id, count or option count) are an error, not skipped.
"""

import argparse
import json


def records(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("reference")
    ap.add_argument("other")
    ap.add_argument("--label", default="")
    args = ap.parse_args()
    ref, other = records(args.reference), records(args.other)
    if len(ref) != len(other):
        raise SystemExit(f"{len(ref)} records against {len(other)}")
    worst, per_question, flips = 0.0, [], 0
    for i, (a, b) in enumerate(zip(ref, other)):
        if a.get("id") != b.get("id") or len(a["questions"]) != len(b["questions"]):
            raise SystemExit(f"record {i + 1} does not pair up: {a.get('id')} / {b.get('id')}")
        for qa, qb in zip(a["questions"], b["questions"]):
            if len(qa["probs"]) != len(qb["probs"]):
                raise SystemExit(f"record {i + 1}: question {qa.get('id')} option counts differ")
            d = max(abs(x - y) for x, y in zip(qa["probs"], qb["probs"]))
            worst = max(worst, d)
            per_question.append(d)
            flips += qa["argmax"] != qb["argmax"]
    print(json.dumps({
        "label": args.label,
        "records": len(ref),
        "questions": len(per_question),
        "max_abs_dp": worst,
        "mean_question_max_abs_dp": sum(per_question) / max(len(per_question), 1),
        "argmax_flips": flips,
    }))


if __name__ == "__main__":
    main()
