"""The mlx-lm peer of examples/bench.rs on Apple Silicon: same checkpoint, records, forms and figures.

    python bench/mlx_peer.py --checkpoint bench/.cache/kev-0.8b --records bench/.cache/records/one.jsonl \
        --dtype bf16 --form all --repeats 5 --warmup 2

Builds mlx-lm's Qwen3.5 (`mlx_lm.models.qwen3_5`, the model `mlx_lm.load` builds for these
checkpoints) from the base folder of a Kev checkpoint, folds the PEFT LoRA adapter into its weights
(docs/CONTRACT.md §5: in f32, rounded once), and reads the final-norm hidden states (the text model
without its lm_head) with the f32 pointer head of docs/CONTRACT.md §3, on Kev's encoding (§2, the
encoder of bench/common.py). Forms, as in bench/peers.py (`--form`, comma-separated, `both` =
row,prefix, `all` = row,prefix,batch):

  row     per question, the causal row `state ++ branch_j` alone (batch 1)
  prefix  per record, the state once into mlx-lm's caches (KV caches and the DeltaNet conv and
          recurrent states), their rows replicated per question, then the record's branches as
          one right-padded batch
  batch   all records: states as one batch (equal lengths), caches replicated per question, then
          all branches as one batch

mlx is lazy: a timed pass builds the whole pass and evaluates it at its end (`mx.eval` of every
question's logits), then the softmax runs on the host in f64, as Kev's does. One JSON line per
(records file, form) on stdout, with bench/peers.py's fields; peak memory is mlx's allocator peak
(`peak_gpu_mib`). `--device cpu` runs mlx on the CPU (how the logic is checked on Linux, with
`pip install "mlx[cpu]"`).

Everything that does not need mlx (configuration, adapter, head, record handling) takes plain arrays
and is unit-tested with numpy in bench/tests/test_mlx_peer.py.
"""

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import encode, flops, peak_rss_mib, read_jsonl, segments  # noqa: E402

# docs/CONTRACT.md §5: the three wrappers PEFT writes adapter keys under, longest first.
ADAPTER_PREFIXES = ("base_model.model.model.language_model.", "base_model.model.model.", "base_model.model.")
TOKEN_ROWS = "embed_tokens.token_adapter.trainable_tokens_delta"
# mlx-lm's name of the text model inside `mlx_lm.models.qwen3_5.Model`, after its `sanitize`.
MLX_TEXT_MODEL = "language_model.model."


class PeerError(Exception):
    """A checkpoint this peer cannot run as Kev would (the message names the file and field)."""


# ---------------------------------------------------------------------------------------------
# Configuration


def mlx_config(config):
    """config.json of a Qwen3.5 base -> the dict mlx-lm's `qwen3_5.ModelArgs.from_dict` takes.

    Kev reads RoPE settings from `rope_parameters`, else from the top level (defaults 1e7 and 0.25,
    docs/BACKBONE.md §1); mlx-lm reads only `rope_parameters` and otherwise uses its own defaults
    (a base of 1e5), so the top-level values are moved there. mlx-lm places full attention by
    `full_attention_interval` alone, so `layer_types` must follow that pattern."""
    tc = dict(config.get("text_config", config))
    tc.pop("architectures", None)
    rope = dict(tc.get("rope_parameters") or {})
    rope.setdefault("rope_type", "default")
    rope.setdefault("rope_theta", tc.get("rope_theta", 1e7))
    rope.setdefault("partial_rotary_factor", tc.get("partial_rotary_factor", 0.25))
    tc["rope_parameters"] = rope
    interval = tc.get("full_attention_interval", 4)
    tc["full_attention_interval"] = interval
    types = tc.get("layer_types")
    if types is not None:
        pattern = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(len(types))]
        if list(types) != pattern or len(types) != tc["num_hidden_layers"]:
            raise PeerError(f"config.json: layer_types {types} is not the full_attention_interval={interval} "
                            "pattern mlx-lm builds")
    return {"model_type": "qwen3_5", "text_config": tc}


# ---------------------------------------------------------------------------------------------
# Adapter (docs/CONTRACT.md §5)


def adapter_scale(cfg, lora_scale=1.0):
    """The factor of B·A: lora_alpha / r (use_rslora: / √r), times `lora_scale`. Settings that change
    the math and that this peer does not implement are refused, naming the key."""
    if cfg.get("peft_type", "LORA") != "LORA":
        raise PeerError(f"adapter_config.json: peft_type {cfg['peft_type']!r} is not LORA")
    for key in ("use_dora", "fan_in_fan_out", "lora_bias"):
        if cfg.get(key):
            raise PeerError(f"adapter_config.json: {key} is not supported")
    if cfg.get("bias", "none") != "none":
        raise PeerError(f"adapter_config.json: bias {cfg['bias']!r} is not supported")
    for key in ("rank_pattern", "alpha_pattern", "modules_to_save"):
        if cfg.get(key):
            raise PeerError(f"adapter_config.json: {key} is not supported by this peer")
    r = cfg["r"]
    if not isinstance(r, int) or r <= 0:
        raise PeerError(f"adapter_config.json: r must be a positive integer, not {r!r}")
    alpha = cfg.get("lora_alpha", 8)
    return alpha / (math.sqrt(r) if cfg.get("use_rslora") else r) * lora_scale


def split_adapter(tensors):
    """Adapter tensors -> ({module path `layers.{i}.{block}.{name}`: (A, B)}, trained token rows or None).
    A lone A or B, or a key of no known form, is refused."""
    pairs, rows = {}, None
    for key, value in tensors.items():
        prefix = next((p for p in ADAPTER_PREFIXES if key.startswith(p)), None)
        if prefix is None:
            raise PeerError(f"adapter: tensor {key!r} has none of the PEFT prefixes {ADAPTER_PREFIXES}")
        name = key[len(prefix):]
        if name == TOKEN_ROWS:
            rows = value
            continue
        for part, slot in ((".lora_A.weight", 0), (".lora_B.weight", 1)):
            if name.endswith(part) and name.startswith("layers."):
                pairs.setdefault(name[: -len(part)], [None, None])[slot] = value
                break
        else:
            raise PeerError(f"adapter: tensor {key!r} is neither lora_A, lora_B nor {TOKEN_ROWS}")
    for module, (a, b) in pairs.items():
        if a is None or b is None:
            raise PeerError(f"adapter: {module} has lora_{'A' if a is None else 'B'} missing")
    return {m: (a, b) for m, (a, b) in pairs.items()}, rows


def token_row_ids(cfg):
    """The embedding ids whose rows the adapter replaces (`trainable_token_indices`), or []."""
    spec = cfg.get("trainable_token_indices")
    if not spec:
        return []
    if isinstance(spec, list):
        return list(spec)
    if set(spec) != {"embed_tokens"}:
        raise PeerError(f"adapter_config.json: trainable_token_indices for {sorted(spec)}: only embed_tokens")
    return list(spec["embed_tokens"])


def weight_name(module):
    """An adapter module path -> the weight's name in mlx-lm's sanitized Qwen3.5."""
    return f"{MLX_TEXT_MODEL}{module}.weight"


def merge_lora(weight, a, b, scale, f32):
    """W + (B·A)·scale, computed in f32 and rounded once to W's dtype (numpy or mlx arrays)."""
    if b.shape[1] != a.shape[0] or (b.shape[0], a.shape[1]) != tuple(weight.shape):
        raise PeerError(f"adapter: B {tuple(b.shape)} · A {tuple(a.shape)} does not fit weight {tuple(weight.shape)}")
    return (weight.astype(f32) + (b.astype(f32) @ a.astype(f32)) * scale).astype(weight.dtype)


def replaced_rows(embed_rows, new_rows, lora_scale, f32):
    """Trained token rows interpolated by `lora_scale`: (1 − s)·row + s·new_row (0: the base)."""
    return ((1.0 - lora_scale) * embed_rows.astype(f32) + lora_scale * new_rows.astype(f32)).astype(embed_rows.dtype)


# ---------------------------------------------------------------------------------------------
# Records and head (docs/CONTRACT.md §2-3)


def pointer_logits(h_decide, h_opts, head, dim, temperature, f32):
    """h_decide [H], h_opts [n, H] (any float dtype) -> the n logits, in f32 (numpy or mlx arrays)."""
    q = head["q.weight"] @ h_decide.astype(f32) + head["q.bias"]
    k = h_opts.astype(f32) @ head["k.weight"].T + head["k.bias"]
    return (k @ q) / (math.sqrt(dim) * temperature)


def softmax64(logits):
    """Softmax over one question's options in f64, rounded to f32 (Kev does it on the host so)."""
    x = np.asarray(logits, dtype=np.float64)
    e = np.exp(x - x.max())
    return (e / e.sum()).astype(np.float32)


def head_positions(offset, row):
    """(decide, opts) positions of a branch whose first token sits at `offset`."""
    return offset + row["decide"], [offset + o for o in row["opts"]]


def right_padded(rows, pad=0):
    """Branch ids as one right-padded matrix: every layer is causal, so what follows a row's last
    token never reaches its positions."""
    width = max(len(r["ids"]) for r in rows)
    return [r["ids"] + [pad] * (width - len(r["ids"])) for r in rows]


def owners(encoded):
    """Per branch of the file (record order, then question order), the index of its record."""
    return [i for i, (_, rows) in enumerate(encoded) for _ in rows]


def per_record(flat, encoded):
    """A flat per-branch list back into one list per record."""
    out, at = [], 0
    for _, rows in encoded:
        out.append(flat[at:at + len(rows)])
        at += len(rows)
    return out


# ---------------------------------------------------------------------------------------------
# mlx


def load(ckpt, dtype_name, lora_scale):
    """(model, head, kev): mlx-lm's Qwen3.5 with the adapter merged, the f32 head, kev.json."""
    import mlx.core as mx
    from mlx_lm.models import qwen3_5

    kev = json.loads((ckpt / "kev.json").read_text())
    base_name = kev.get("base", "base")
    if base_name.startswith("hf:"):
        raise PeerError("kev.json: base: mlx_peer.py reads local bases only")
    base = Path(base_name) if Path(base_name).is_absolute() else ckpt / base_name
    config = mlx_config(json.loads((base / "config.json").read_text()))
    model = qwen3_5.Model(qwen3_5.ModelArgs.from_dict(config))

    index = base / "model.safetensors.index.json"
    if (base / "model.safetensors").is_file():
        files = [base / "model.safetensors"]
    elif index.is_file():
        files = sorted({base / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(base.glob("*.safetensors"))
    weights = {}
    for f in files:
        weights.update(mx.load(str(f)))
    floating = lambda v: mx.issubdtype(v.dtype, mx.floating)  # noqa: E731
    if dtype_name == "f32":  # before sanitize, so that its 1 + w of the norms is an f32 sum
        weights = {k: v.astype(mx.float32) if floating(v) else v for k, v in weights.items()}
    weights = model.sanitize(weights)  # drops vision/MTP/lm_head, adds 1 to zero-centred norms
    if dtype_name == "bf16":  # as mlx-lm's own conversion: every float weight but A_log
        keep = model.cast_predicate
        weights = {k: v.astype(mx.bfloat16) if floating(v) and keep(k) else v for k, v in weights.items()}

    if kev.get("adapter"):
        adir = ckpt / kev["adapter"]
        cfg = json.loads((adir / "adapter_config.json").read_text())
        scale = adapter_scale(cfg, lora_scale)
        pairs, rows = split_adapter(mx.load(str(adir / "adapter_model.safetensors")))
        for module, (a, b) in pairs.items():
            name = weight_name(module)
            if name not in weights:
                raise PeerError(f"adapter: {module} matches no base weight ({name})")
            weights[name] = merge_lora(weights[name], a, b, scale, mx.float32)
            mx.eval(weights[name])  # one weight at a time: the unmerged one is freed now (4B: 8.5 GB)
        ids = token_row_ids(cfg)
        if (rows is None) != (not ids):
            raise PeerError("adapter: trainable_token_indices and trainable_tokens_delta must come together")
        if ids:
            name = f"{MLX_TEXT_MODEL}embed_tokens.weight"
            embed, index = weights[name], mx.array(ids)
            embed[index] = replaced_rows(embed[index], rows, lora_scale, mx.float32)
            weights[name] = embed

    model.eval()
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())

    head = {k: v.astype(mx.float32) for k, v in mx.load(str(ckpt / kev["head"]["file"])).items()}
    mx.eval(head)
    return model, head, kev


class Scorer:
    """The three forms on mlx-lm's model; every method returns, per record, per question, the
    lazy f32 logits (evaluated by the caller)."""

    def __init__(self, model, head, kev):
        import mlx.core as mx
        from mlx_lm.models.cache import ArraysCache, KVCache

        self.mx, self.ArraysCache, self.KVCache = mx, ArraysCache, KVCache
        self.model, self.head = model, head
        self.text = model.language_model.model  # final norm included, no lm_head
        self.dim, self.temperature = kev["head"]["dim"], kev["head"].get("temperature", 1.0)

    def logits(self, h, offset, row):
        mx = self.mx
        decide, opts = head_positions(offset, row)
        return pointer_logits(h[decide], h[mx.array(opts)], self.head, self.dim, self.temperature, mx.float32)

    def row(self, enc):
        out = []
        for state, rows in enc:
            out.append([self.logits(self.text(self.mx.array([state + r["ids"]]))[0], len(state), r) for r in rows])
        return out

    def replicate(self, caches, index):
        """Each cache row -> the rows in `index`: K/V (with their offset), conv and recurrent states."""
        mx = self.mx
        idx = mx.array(index)
        out = []
        for c in caches:
            if isinstance(c, self.KVCache):
                n = self.KVCache()
                if c.keys is not None:
                    n.keys, n.values, n.offset = c.keys[idx], c.values[idx], c.offset
            elif isinstance(c, self.ArraysCache):
                n = self.ArraysCache(len(c.cache))
                n.cache = [None if a is None else a[idx] for a in c.cache]
            else:
                raise PeerError(f"unexpected mlx-lm cache type {type(c).__name__}")
            out.append(n)
        return out

    def branches(self, caches, index, rows):
        h = self.text(self.mx.array(right_padded(rows)), self.replicate(caches, index))
        return [self.logits(h[i], 0, r) for i, r in enumerate(rows)]

    def prefix(self, enc):
        out = []
        for state, rows in enc:
            caches = self.model.make_cache()
            if state:
                self.text(self.mx.array([state]), caches)
            out.append(self.branches(caches, [0] * len(rows), rows))
        return out

    def batch(self, enc):
        if len({len(s) for s, _ in enc}) != 1:
            raise PeerError("--form batch needs states of equal length (no left padding here)")
        caches = self.model.make_cache()
        if enc[0][0]:
            self.text(self.mx.array([s for s, _ in enc]), caches)
        return per_record(self.branches(caches, owners(enc), [r for _, rows in enc for r in rows]), enc)


def evaluate(mx, logits):
    """Runs the lazy pass and returns per record, per question, the probabilities (host f64 softmax)."""
    mx.eval([x for rec in logits for x in rec])
    return [[softmax64(np.array(x)) for x in rec] for rec in logits]


def memory_api(mx):
    """(reset, peak bytes) of mlx's allocator: top-level in current mlx, under mx.metal before."""
    reset = getattr(mx, "reset_peak_memory", None) or mx.metal.reset_peak_memory
    peak = getattr(mx, "get_peak_memory", None) or mx.metal.get_peak_memory
    return reset, peak


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--records", required=True, action="append", help="JSONL workload (repeatable)")
    ap.add_argument("--dtype", default="bf16", choices=["f32", "bf16"])
    ap.add_argument("--device", default="gpu", choices=["gpu", "cpu"], help="mlx's device (gpu: Metal)")
    ap.add_argument("--form", default="all", help="row, prefix, batch (comma-separated), both, all")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--lora-scale", type=float, default=1.0)
    ap.add_argument("--label", default="", help="free text copied into every line")
    args = ap.parse_args()
    if args.repeats < 1:
        raise SystemExit("--repeats must be at least 1")

    import mlx.core as mx
    import mlx_lm
    from tokenizers import Tokenizer

    mx.set_default_device(mx.gpu if args.device == "gpu" else mx.cpu)
    forms = {"both": ["row", "prefix"], "all": ["row", "prefix", "batch"]}.get(args.form, args.form.split(","))
    ckpt = Path(args.checkpoint)
    common = {"impl": "mlx-lm", "checkpoint": ckpt.name, "device": "metal" if args.device == "gpu" else "cpu",
              "dtype": args.dtype, "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__}
    if args.label:
        common["label"] = args.label

    t0 = time.perf_counter()
    model, head, kev = load(ckpt, args.dtype, args.lora_scale)
    load_s = time.perf_counter() - t0
    print(f"mlx-lm peer: loaded {ckpt} on {common['device']} ({args.dtype}) in {load_s:.2f} s", file=sys.stderr)
    base = Path(kev.get("base", "base"))
    base = base if base.is_absolute() else ckpt / base
    tc = mlx_config(json.loads((base / "config.json").read_text()))["text_config"]
    # As Kev: the checkpoint folder's own tokenizer, else the adapter's, else the base's.
    cands = [ckpt / "tokenizer.json"] + ([ckpt / kev["adapter"] / "tokenizer.json"] if kev.get("adapter") else [])
    tok = Tokenizer.from_file(str(next((c for c in cands if c.is_file()), base / "tokenizer.json")))
    scorer = Scorer(model, head, kev)
    reset_peak, peak_bytes = memory_api(mx)

    for path in args.records:
        recs = read_jsonl(path)
        enc = [encode(tok, r, kev["template"]) for r in recs]
        tokens = sum(len(s) + sum(len(r["ids"]) for r in rows) for s, rows in enc)
        questions = sum(len(rows) for _, rows in enc)
        for form in forms:
            run = getattr(scorer, form)
            segs = segments(enc, form)
            reset_peak()
            times, probs = [], None
            for i in range(args.warmup + args.repeats):
                t = time.perf_counter()
                probs = evaluate(mx, run(enc))
                if i >= args.warmup:
                    times.append(time.perf_counter() - t)
            med = statistics.median(times)
            fl = flops(tc, segs)
            line = dict(common)
            line.update({
                "workload": Path(path).stem, "form": form, "records": len(recs), "questions": questions,
                "tokens": tokens, "computed_tokens": sum(n for _, n in segs),
                "warmup": args.warmup, "repeats": args.repeats,
                "latency_ms_median": med * 1e3, "latency_ms_min": min(times) * 1e3,
                "records_per_s": len(recs) / med, "tok_per_s": tokens / med,
                "computed_tok_per_s": sum(n for _, n in segs) / med,
                "gflop": fl / 1e9, "tflop_per_s": fl / med / 1e12,
                "peak_gpu_mib": round(peak_bytes() / 2**20, 1), "peak_rss_mib": round(peak_rss_mib(), 1),
                "load_s": load_s,
                "first_probs": [[round(float(x), 6) for x in p] for p in probs[0]],
            })
            print(json.dumps(line), flush=True)
            print(f"{Path(path).stem} {form}: median {med * 1e3:.1f} ms, min {min(times) * 1e3:.1f} ms",
                  file=sys.stderr)


if __name__ == "__main__":
    main()
