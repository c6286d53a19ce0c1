"""Parity at the exact widths of the large dense Qwen3.5 models, on a few layers: a random base of
the 9B or 27B widths (four layers, [D, D, D, A]; the fixture tokenizer's vocabulary), a Kev
checkpoint on it (LoRA r=4 on every linear module), the reference's probabilities for the fixture
records (transformers + PEFT + the torch head, f32, CPU), then `score` on the same records, and
the largest |Δp| and argmax flips between them. Nothing is committed: the checkpoint is GBs.

    python reference/wide_parity.py --size 27b --score target/release/examples/score

Needs the reference's packages (reference/requirements.txt) and about 3x the f32 weights in
memory (27B widths, four layers: ~5.3 GB of weights).
"""

import argparse
import gc
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import generate as g  # noqa: E402

# Widths of the published dense models (docs/BACKBONE.md §1.2; 27B: shared/docs/QWEN35.md).
SIZES = {
    "9b": {"hidden_size": 4096, "intermediate_size": 12288, "num_attention_heads": 16,
           "num_key_value_heads": 4, "head_dim": 256, "linear_num_key_heads": 16,
           "linear_num_value_heads": 32, "linear_key_head_dim": 128, "linear_value_head_dim": 128},
    "27b": {"hidden_size": 5120, "intermediate_size": 17408, "num_attention_heads": 24,
            "num_key_value_heads": 4, "head_dim": 256, "linear_num_key_heads": 16,
            "linear_num_value_heads": 48, "linear_key_head_dim": 128, "linear_value_head_dim": 128},
}


def max_delta(ours, theirs):
    """Largest |Δp| over all questions and the number of argmax flips."""
    worst, flips = 0.0, 0
    for a, b in zip(ours, theirs, strict=True):
        worst = max(worst, max(abs(x - y) for x, y in zip(a, b, strict=True)))
        flips += int(max(range(len(a)), key=a.__getitem__) != max(range(len(b)), key=b.__getitem__))
    return worst, flips


@torch.no_grad()
def f64_reference(model, ckpt, head, kev, tok, recs):
    """The reference's probabilities per question with the model, adapter and head in f64 (the
    model converted in place and wrapped without a copy: its last use)."""
    from peft import PeftModel

    torch.set_default_dtype(torch.float64)
    try:
        text = PeftModel.from_pretrained(model.double().model, str(ckpt / "adapter")).eval().get_base_model()
        head = {k: v.double() for k, v in head.items()}
        out = []
        for rec in recs:
            state, rows = g.encode(tok, rec)
            for row in rows:
                h = text(input_ids=torch.tensor([state + row["ids"]]), use_cache=False).last_hidden_state[0]
                off = len(state)
                logits = g.head_logits(head, h[off + row["decide"]], h[[off + o for o in row["opts"]]],
                                       kev["head"]["dim"], kev["head"]["temperature"])
                out.append([float(x) for x in torch.softmax(logits, -1)])
        return out
    finally:
        torch.set_default_dtype(torch.float32)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(SIZES), required=True)
    ap.add_argument("--score", required=True, help="the `score` binary")
    ap.add_argument("--records", type=int, default=6, help="the first N fixture records")
    args = ap.parse_args()
    torch.use_deterministic_algorithms(True)
    fixtures = Path(__file__).resolve().parent.parent / "tests" / "fixtures"
    work = Path(tempfile.mkdtemp(prefix=f"kev-wide-{args.size}-"))
    try:
        tok_path = fixtures / "tokenizer.json"
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(str(tok_path))
        cfg = g.text_config(tok.get_vocab_size())
        cfg.update(SIZES[args.size])
        cfg.update({"num_hidden_layers": 4,
                    "layer_types": ["linear_attention"] * 3 + ["full_attention"]})
        started = time.perf_counter()
        model = g.build_model(cfg, seed=11)
        # The fixtures' weight scale is for H = 64: scaled by sqrt(64 / H) (and rounded to bf16
        # again, as the files hold them), activations stay O(1) and the probabilities far from 0
        # and 1, where a difference shows.
        shrink = (64 / cfg["hidden_size"]) ** 0.5
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("proj.weight"):
                    p.copy_((p * shrink).to(torch.bfloat16).float())
        g.save_bases(model, cfg, work, tok_path)
        recs = [json.loads(l) for l in (fixtures / "records.jsonl").read_text().splitlines()][: args.records]
        (work / "records.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs))
        ckpt = work / "kev-wide"
        ckpt.mkdir()
        kev = {"format": "kev/1", "base": "../base-mm", "adapter": "adapter",
               "head": {"file": "head.safetensors", "dim": 16, "temperature": 0.7 * cfg["hidden_size"] / 64},
               "template": g.TEMPLATE, "max_tokens": 1024}
        (ckpt / "kev.json").write_text(json.dumps(kev, indent=2) + "\n")
        head = g.make_head(cfg["hidden_size"], 16, 300, ckpt / "head.safetensors")
        g.make_adapter(model, "lora", 400, ckpt / "adapter", tok.token_to_id(g.OPTION), tok.token_to_id(g.DECIDE))
        g.LORA_SCALES[:] = [1.0]
        want = g.decision_reference(model, ckpt, head, kev, tok, recs, "lora")["1.0"]
        print(f"reference: {time.perf_counter() - started:.0f} s", flush=True)
        # The same in f64, the noise floor: how far the f32 reference itself is from exact.
        exact = f64_reference(model, ckpt, head, kev, tok, recs)
        del model
        gc.collect()

        started = time.perf_counter()
        out = subprocess.run(["/usr/bin/time", "-v", args.score, "--checkpoint", str(ckpt), "--records",
                              str(work / "records.jsonl"), "--backend", "cpu", "--dtype", "f32"],
                             capture_output=True, text=True, check=True)
        took = time.perf_counter() - started
        rss = next((l.split(":")[1].strip() for l in out.stderr.splitlines() if "Maximum resident" in l), "?")
        got = [json.loads(l) for l in out.stdout.splitlines()]
        kev_probs = [q["probs"] for r in got for q in r["questions"]]
        ref_probs = [q["probs"] for r in want for q in r["questions"]]
        worst, flips = max_delta(kev_probs, ref_probs)
        worst_exact, _ = max_delta(kev_probs, exact)
        ref_exact, _ = max_delta(ref_probs, exact)
        questions = len(kev_probs)
        top = [max(q["probs"]) for r in want for q in r["questions"]]
        print(json.dumps({"size": args.size, "reference_mean_top_p": round(sum(top) / len(top), 4), "layers": 4, "widths": SIZES[args.size], "records": len(got),
                          "questions": questions, "max_abs_dp": worst, "argmax_flips": flips,
                          "max_abs_dp_kev_vs_f64": worst_exact, "max_abs_dp_f32_reference_vs_f64": ref_exact,
                          "score_wall_s": round(took, 1), "score_max_rss_kb": rss}))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
