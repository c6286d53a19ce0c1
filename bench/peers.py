"""The transformers peer of examples/bench.rs: same checkpoint, records, forms and figures.

    python bench/peers.py --checkpoint bench/.cache/kev-0.8b --records bench/.cache/records/one.jsonl \
        --device cpu --dtype f32 --form both --repeats 3 --threads 2

Loads the base's text model (`Qwen3_5TextModel`) from the multimodal files by hand (config from
`text_config`, weights `model.language_model.*` renamed, vision / MTP tensors skipped), applies the
PEFT adapter and merges it, and reads a torch pointer head (f32), scoring with Kev's encoding
(docs/CONTRACT.md §2). Forms (`--form`, comma-separated, `both` = row,prefix, `all` = row,prefix,batch):

  row     per question, the causal row `state ++ branch_j` alone (batch 1): the reference form
  prefix  per record, the state once with a cache, the cache replicated per question
          (`reorder_cache` with repeated indices: conv + recurrent states and K/V), then the
          record's branches as one batch
  batch   all records of the file: states as one batch, the cache replicated per question, then
          all branches as one batch (states must have equal lengths: no left padding here)

One JSON line per (records file, form) on stdout: latency median / min over --repeats after
--warmup, records/s, tokens/s (encoded tokens: state + branches), computed tokens/s (row form
recomputes the state per question), model FLOPs (bench/common.py) and TFLOP/s, peak memory
(GPU: torch's max allocated; CPU: VmHWM, reset per workload where the kernel allows), load time,
and the first record's probabilities (a parity check against Kev). `fla` says whether
transformers' Qwen3.5 took flash-linear-attention's chunked delta-rule kernel (it does when
`fla.ops.gated_delta_rule` imports, which needs a GPU with Triton), `fla_installed` whether the
package is there at all.
"""

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import encode, flops, peak_rss_mib, read_jsonl, reset_peak_rss, segments  # noqa: E402


def available(name):
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def transformers_uses_fla():
    """Whether transformers' Qwen3.5 bound fla's chunk_gated_delta_rule (its choice is made at import:
    the package's kernel if it imports, else the torch reference); None if that cannot be told."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    stack, seen = [m.torch_chunk_gated_delta_rule], set()
    while stack:
        f = stack.pop()
        if id(f) in seen:
            continue
        seen.add(id(f))
        code, cells = getattr(f, "__code__", None), getattr(f, "__closure__", None)
        for name, cell in zip(code.co_freevars if code else (), cells or ()):
            try:
                value = cell.cell_contents
            except ValueError:
                continue
            if name == "is_new_implementation":
                return bool(value)
            if callable(value):
                stack.append(value)
        if hasattr(f, "__wrapped__"):
            stack.append(f.__wrapped__)
    return None


def resolve_base(ckpt, kev):
    base = kev.get("base", "base")
    if base.startswith("hf:"):
        raise SystemExit("peers.py reads local bases only (kev.json `base` must be a folder)")
    p = Path(base)
    return p if p.is_absolute() else ckpt / p


def load_text_weights(base, device, dtype):
    """Text-model tensors named as in Qwen3_5TextModel, cast to `dtype` (as from_pretrained does)."""
    from safetensors import safe_open

    index = base / "model.safetensors.index.json"
    if (base / "model.safetensors").is_file():
        files = [base / "model.safetensors"]
    elif index.is_file():
        files = sorted({base / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(base.glob("*.safetensors"))
    sd = {}
    for f in files:
        with safe_open(str(f), framework="pt", device=str(device)) as st:
            for k in st.keys():
                if k.startswith("model.language_model."):
                    name = k[len("model.language_model."):]
                elif k.startswith("model.") and not k.startswith("model.visual."):
                    name = k[len("model."):]
                else:
                    continue  # model.visual.*, mtp.*, lm_head.weight
                sd[name] = st.get_tensor(k).to(dtype)
    return fuse_experts(sd)


def fuse_experts(sd):
    """A MoE's per-expert tensors (`mlp.experts.{e}.gate_proj.weight`, as published) as the fused
    parameters transformers holds (`mlp.experts.gate_up_proj: [E, 2I, H]`, `down_proj: [E, H, I]`),
    as its checkpoint conversion does in from_pretrained."""
    stems = sorted({k.split("experts.")[0] for k in sd if ".mlp.experts.0.gate_proj.weight" in k})
    for stem in stems:
        n = sum(1 for k in sd if k.startswith(stem + "experts.") and k.endswith(".down_proj.weight"))
        gate_up, down = [], []
        for e in range(n):
            p = f"{stem}experts.{e}."
            gate_up.append(torch.cat([sd.pop(p + "gate_proj.weight"), sd.pop(p + "up_proj.weight")]))
            down.append(sd.pop(p + "down_proj.weight"))
        sd[stem + "experts.gate_up_proj"] = torch.stack(gate_up)
        sd[stem + "experts.down_proj"] = torch.stack(down)
        del gate_up, down
    return sd


def load(ckpt, device, dtype, attn, experts=None):
    kev = json.loads((ckpt / "kev.json").read_text())
    base = resolve_base(ckpt, kev)
    cfg_json = json.loads((base / "config.json").read_text())
    tc = dict(cfg_json.get("text_config", cfg_json))
    tc.pop("architectures", None)
    if "num_experts" in tc:
        from transformers import Qwen3_5MoeTextConfig as Config
        from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as m
        Model, Rotary = m.Qwen3_5MoeTextModel, m.Qwen3_5MoeTextRotaryEmbedding
    else:
        from transformers import Qwen3_5TextConfig as Config
        from transformers.models.qwen3_5 import modeling_qwen3_5 as m
        Model, Rotary = m.Qwen3_5TextModel, m.Qwen3_5TextRotaryEmbedding
    cfg = Config(**tc)
    cfg._attn_implementation = attn
    if experts:
        cfg._experts_implementation = experts
    with torch.device("meta"):
        model = Model(cfg)
    sd = load_text_weights(base, device, dtype)
    missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    if missing or unexpected:
        raise SystemExit(f"weights do not match {Model.__name__}: missing {missing[:5]}, unexpected {unexpected[:5]}")
    del sd
    model.rotary_emb = Rotary(config=cfg).to(device)  # non-persistent buffers
    model.eval()
    if kev.get("adapter"):
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(ckpt / kev["adapter"])).merge_and_unload()
        model.eval()
    from safetensors.torch import load_file

    head = {k: v.to(device=device, dtype=torch.float32)
            for k, v in load_file(str(ckpt / kev["head"]["file"])).items()}
    from tokenizers import Tokenizer

    # As Kev: the checkpoint folder's own tokenizer, else the adapter's, else the base's.
    cands = [ckpt / "tokenizer.json"] + ([ckpt / kev["adapter"] / "tokenizer.json"] if kev.get("adapter") else [])
    tok = Tokenizer.from_file(str(next((c for c in cands if c.is_file()), base / "tokenizer.json")))
    return model, head, kev, tok, tc


def head_probs(head, kev, h, decide, opts):
    """h: [T, H]; docs/CONTRACT.md §3 pointer head in f32."""
    dim, temp = kev["head"]["dim"], kev["head"].get("temperature", 1.0)
    hd = h[decide].float()
    ho = h[opts].float()
    q = head["q.weight"] @ hd + head["q.bias"]
    k = ho @ head["k.weight"].T + head["k.bias"]
    return torch.softmax((k @ q) / (dim ** 0.5 * temp), -1)


def replicate(cache, index):
    """Each cache row -> the rows in `index` (conv and recurrent states, K and V)."""
    cache.reorder_cache(index)
    return cache


class Scorer:
    def __init__(self, model, head, kev, device):
        self.model, self.head, self.kev, self.device = model, head, kev, device

    def ids(self, rows):
        return torch.tensor(rows, dtype=torch.long, device=self.device)

    def row(self, enc):
        out = []
        for state, rows in enc:
            probs = []
            for r in rows:
                h = self.model(input_ids=self.ids([state + r["ids"]]), use_cache=False).last_hidden_state[0]
                off = len(state)
                probs.append(head_probs(self.head, self.kev, h, off + r["decide"], [off + o for o in r["opts"]]))
            out.append(probs)
        return out

    def branches(self, cache, owners, rows):
        width = max(len(r["ids"]) for r in rows)
        ids = self.ids([r["ids"] + [0] * (width - len(r["ids"])) for r in rows])  # right pad: causal, never read
        cache = replicate(cache, torch.tensor(owners, device=self.device))
        h = self.model(input_ids=ids, past_key_values=cache, use_cache=True).last_hidden_state
        return [head_probs(self.head, self.kev, h[i], r["decide"], r["opts"]) for i, r in enumerate(rows)]

    def prefix(self, enc):
        out = []
        for state, rows in enc:
            cache = self.model(input_ids=self.ids([state]), use_cache=True).past_key_values
            out.append(self.branches(cache, [0] * len(rows), rows))
        return out

    def batch(self, enc):
        if len({len(s) for s, _ in enc}) != 1:
            raise SystemExit("--form batch needs states of equal length (no left padding here)")
        cache = self.model(input_ids=self.ids([s for s, _ in enc]), use_cache=True).past_key_values
        owners = [i for i, (_, rows) in enumerate(enc) for _ in rows]
        probs = self.branches(cache, owners, [r for _, rows in enc for r in rows])
        out, at = [], 0
        for _, rows in enc:
            out.append(probs[at:at + len(rows)])
            at += len(rows)
        return out


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--records", required=True, action="append", help="JSONL workload (repeatable)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="f32", choices=["f32", "bf16"])
    ap.add_argument("--form", default="both", help="row, prefix, batch (comma-separated), both, all")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--attn", default="sdpa", help="transformers attention implementation")
    ap.add_argument("--experts", default="", help="a MoE's experts implementation (eager, grouped_mm, "
                    "batched_mm; default: transformers' choice, reported as `experts`)")
    ap.add_argument("--label", default="", help="free text copied into every line")
    ap.add_argument("--compile", default="", choices=["", "default", "reduce-overhead", "max-autotune"],
                    help="torch.compile the text model (reduce-overhead: with CUDA graphs); compiling and "
                         "graph recording happen in the warm-up runs, so give --warmup 3 or more")
    args = ap.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    forms = {"both": ["row", "prefix"], "all": ["row", "prefix", "batch"]}.get(args.form, args.form.split(","))
    device = torch.device(args.device)
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    ckpt = Path(args.checkpoint)
    fla = transformers_uses_fla()
    common = {"impl": "transformers", "fla": {True: "yes", False: "no", None: "unknown"}[fla],
              "fla_installed": "yes" if available("fla") else "no",
              "causal_conv1d": "yes" if available("causal_conv1d") else "no",
              "checkpoint": ckpt.name, "device": args.device, "dtype": args.dtype, "attn": args.attn,
              "threads": torch.get_num_threads(), "torch": torch.__version__}
    import transformers

    common["transformers"] = transformers.__version__
    if args.label:
        common["label"] = args.label
    if args.compile:
        common["compile"] = args.compile
    print(f"transformers peer: fla: {common['fla']} (installed: {common['fla_installed']}), causal_conv1d: {common['causal_conv1d']}, "
          f"{args.device} {args.dtype}, {common['threads']} threads", file=sys.stderr)

    import peft  # noqa: F401  (imports are not load time)
    from transformers.models.qwen3_5 import modeling_qwen3_5  # noqa: F401

    torch.set_grad_enabled(False)
    sync(device)
    t0 = time.perf_counter()
    model, head, kev, tok, tc = load(ckpt, device, dtype, args.attn, args.experts or None)
    if "num_experts" in tc:
        common["experts"] = getattr(model.config, "_experts_implementation", None) or "eager"
    sync(device)
    load_s = time.perf_counter() - t0
    print(f"loaded {ckpt} in {load_s:.2f} s", file=sys.stderr)
    if args.compile:
        model = torch.compile(model, mode=args.compile)
    scorer = Scorer(model, head, kev, device)

    for path in args.records:
        recs = read_jsonl(path)
        enc = [encode(tok, r, kev["template"]) for r in recs]
        tokens = sum(len(s) + sum(len(r["ids"]) for r in rows) for s, rows in enc)
        questions = sum(len(rows) for _, rows in enc)
        for form in forms:
            run = getattr(scorer, form)
            segs = segments(enc, form)
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            rss_reset = reset_peak_rss()
            times = []
            with torch.inference_mode():
                for i in range(args.warmup + args.repeats):
                    sync(device)
                    t = time.perf_counter()
                    probs = run(enc)
                    sync(device)
                    if i >= args.warmup:
                        times.append(time.perf_counter() - t)
                    if args.compile:  # where a compiled run's minutes go (compiling, recording)
                        print(f"{Path(path).stem} {form} pass {i}: {time.perf_counter() - t:.1f} s",
                              file=sys.stderr, flush=True)
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
                "peak_rss_mib": round(peak_rss_mib(), 1), "peak_rss_reset": rss_reset,
                "load_s": load_s,
                "first_probs": [[round(float(x), 6) for x in p] for p in probs[0]],
            })
            if device.type == "cuda":
                line["peak_gpu_mib"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
                line["peak_gpu_reserved_mib"] = round(torch.cuda.max_memory_reserved(device) / 2**20, 1)
            print(json.dumps(line), flush=True)
            print(f"{Path(path).stem} {form}: median {med * 1e3:.1f} ms, min {min(times) * 1e3:.1f} ms",
                  file=sys.stderr)


if __name__ == "__main__":
    main()
