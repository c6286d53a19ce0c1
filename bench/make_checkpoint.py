"""Writes a random-weight Kev checkpoint with the published Qwen3.5 shapes (issue 5).

    python bench/make_checkpoint.py --size 0.8b --out bench/.cache/kev-0.8b          # CPU, ~1.6 GB
    python bench/make_checkpoint.py --size 4b --out bench/.cache/kev-4b --device cuda # ~8.5 GB
    python bench/make_checkpoint.py --size 35b-a3b --layers 8 --out bench/.cache/kev-35b-a3b-8l --device cuda
                                                    # the MoE's shapes, 8 of its 40 layers, ~14 GB

Layout (docs/CONTRACT.md §4, docs/BACKBONE.md §1-2):
  DIR/kev.json                  base "base", adapter "adapter", head dim 256 (tiny: 16), the
                                template of reference/generate.py, max_tokens 8192
  DIR/head.safetensors          q/k weight [dim, H] and bias [dim], f32
  DIR/adapter/                  PEFT LoRA, r=16 (alpha 32) on every linear module, written in
                                PEFT's file format (adapter_config.json + adapter_model.safetensors,
                                keys base_model.model.layers.{i}.{module}.lora_A/B.weight, f32)
  DIR/base/config.json          multimodal (Qwen3_5ForConditionalGeneration, text_config with
                                layer_types and rope_parameters), tied embeddings
  DIR/base/model*.safetensors   model.language_model.* (+ small model.visual.* / mtp.* tensors to
                                be ignored), bf16 except A_log and linear_attn.norm.weight (F32);
                                a MoE size (qwen3_5_moe) stores its routed experts per expert
                                (mlp.experts.{e}.gate_proj / up_proj / down_proj), as published;
                                shards of --shard-gb with model.safetensors.index.json
  DIR/base/tokenizer.json       Qwen3.5's real tokenizer with the Kev markers (248,079 ids of the
                                248,320 embedding rows; bench/.cache/qwen-tokenizer, made by
                                scripts/make_qwen_tokenizer.py), or --tokenizer

Weights are seeded normal(0, 0.02) (zero-centred norm weights: small; the gated norm weight
around 1; A_log = log U(1, 16); conv std 0.2; head std 1/sqrt(H); LoRA A and B std 0.02), generated a tensor (and, for big ones, a slice) at
a time, one shard in memory at most. Needs torch and safetensors only.
"""

import argparse
import hashlib
import json
import shutil
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import QWEN_TOKENIZER, TEMPLATE  # noqa: E402

SIZES = {
    # A small config with every asymmetry of the family (fast end-to-end check).
    "tiny": dict(hidden_size=64, num_hidden_layers=8, intermediate_size=112, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                 linear_key_head_dim=32, linear_value_head_dim=16, vocab_size=1024, head_dim_kev=16),
    "0.8b": dict(hidden_size=1024, num_hidden_layers=24, intermediate_size=3584, num_attention_heads=8,
                 num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
                 linear_key_head_dim=128, linear_value_head_dim=128, vocab_size=248320, head_dim_kev=256),
    "4b": dict(hidden_size=2560, num_hidden_layers=32, intermediate_size=9216, num_attention_heads=16,
               num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
               linear_key_head_dim=128, linear_value_head_dim=128, vocab_size=248320, head_dim_kev=256),
    # The larger dense ones (../shared/docs/QWEN35.md §1.2; untied, which Kev never reads).
    "9b": dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=12288, num_attention_heads=16,
               num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
               linear_key_head_dim=128, linear_value_head_dim=128, vocab_size=248320, head_dim_kev=256),
    "27b": dict(hidden_size=5120, num_hidden_layers=64, intermediate_size=17408, num_attention_heads=24,
                num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48,
                linear_key_head_dim=128, linear_value_head_dim=128, vocab_size=248320, head_dim_kev=256),
    # Qwen3.5-35B-A3B (../shared/docs/QWEN35.md §1.2): 256 routed experts, top 8, and a shared one.
    "35b-a3b": dict(hidden_size=2048, num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2,
                    head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                    linear_value_head_dim=128, vocab_size=248320, head_dim_kev=256, num_experts=256,
                    num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512),
}
MOE_FIELDS = ["num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size"]


def is_moe(tc):
    return "num_experts" in tc


def text_config(size, layers=None):
    s = SIZES[size]
    n = layers or s["num_hidden_layers"]
    tc = {
        "model_type": "qwen3_5_moe_text" if "num_experts" in s else "qwen3_5_text",
        "architectures": None,
        "hidden_size": s["hidden_size"],
        "num_hidden_layers": n,
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)],
        "full_attention_interval": 4,
        "vocab_size": s["vocab_size"],
        "num_attention_heads": s["num_attention_heads"],
        "num_key_value_heads": s["num_key_value_heads"],
        "head_dim": s["head_dim"],
        "linear_num_key_heads": s["linear_num_key_heads"],
        "linear_num_value_heads": s["linear_num_value_heads"],
        "linear_key_head_dim": s["linear_key_head_dim"],
        "linear_value_head_dim": s["linear_value_head_dim"],
        "linear_conv_kernel_dim": 4,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_output_gate": True,
        "max_position_embeddings": 262144,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                            "partial_rotary_factor": 0.25,
                            "mrope_section": [11, 11, 10] if s["head_dim"] == 256 else [2, 1, 1],
                            "mrope_interleaved": True},
        "initializer_range": 0.02,
        "dtype": "bfloat16",
        "mamba_ssm_dtype": "float32",
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "pad_token_id": None,
        "tie_word_embeddings": True,
        "use_cache": True,
    }
    if "num_experts" in s:
        tc.update({k: s[k] for k in MOE_FIELDS})
        tc["router_aux_loss_coef"] = 0.001
    else:
        tc["intermediate_size"] = s["intermediate_size"]
    return tc


def full_config(tc):
    tc = dict(tc)
    tc.pop("architectures")
    moe = is_moe(tc)
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5_moe" if moe else "qwen3_5",
        "text_config": tc,
        # Not used by Kev nor by bench/peers.py (text model only); a placeholder for the layout.
        "vision_config": {"model_type": "qwen3_5", "depth": 1, "hidden_size": 16},
        "image_token_id": 248056,
        "video_token_id": 248057,
        "vision_start_token_id": 248053,
        "vision_end_token_id": 248054,
        "tie_word_embeddings": True,
        "transformers_version": "5.17.0",
    }


def plan(tc):
    """[(name, shape, dtype, init)] in file order. init: (kind, value)."""
    h, v = tc["hidden_size"], tc["vocab_size"]
    hq, hkv, hd = tc["num_attention_heads"], tc["num_key_value_heads"], tc["head_dim"]
    hk, hv, dk, dv = (tc["linear_num_key_heads"], tc["linear_num_value_heads"],
                      tc["linear_key_head_dim"], tc["linear_value_head_dim"])
    kconv = tc["linear_conv_kernel_dim"]
    bf, f32 = torch.bfloat16, torch.float32
    w = ("normal", 0.02)
    small = ("normal", 0.02)  # zero-centred norm weights: (1 + w)
    p = "model.language_model."
    out = [(p + "embed_tokens.weight", (v, h), bf, w)]
    for i, t in enumerate(tc["layer_types"]):
        L = f"{p}layers.{i}."
        out += [(L + "input_layernorm.weight", (h,), bf, small),
                (L + "post_attention_layernorm.weight", (h,), bf, small)]
        if t == "linear_attention":
            conv_dim = 2 * hk * dk + hv * dv
            a = L + "linear_attn."
            out += [(a + "in_proj_qkv.weight", (conv_dim, h), bf, w),
                    (a + "in_proj_z.weight", (hv * dv, h), bf, w),
                    (a + "in_proj_b.weight", (hv, h), bf, w),
                    (a + "in_proj_a.weight", (hv, h), bf, w),
                    (a + "conv1d.weight", (conv_dim, 1, kconv), bf, ("normal", 0.2)),
                    (a + "dt_bias", (hv,), bf, ("around", 1.0, 0.1)),
                    (a + "A_log", (hv,), f32, ("a_log",)),
                    (a + "norm.weight", (dv,), f32, ("around", 1.0, 0.02)),
                    (a + "out_proj.weight", (h, hv * dv), bf, w)]
        else:
            a = L + "self_attn."
            out += [(a + "q_proj.weight", (2 * hq * hd, h), bf, w),
                    (a + "k_proj.weight", (hkv * hd, h), bf, w),
                    (a + "v_proj.weight", (hkv * hd, h), bf, w),
                    (a + "o_proj.weight", (h, hq * hd), bf, w),
                    (a + "q_norm.weight", (hd,), bf, small),
                    (a + "k_norm.weight", (hd,), bf, small)]
        out += mlp_plan(tc, L + "mlp.", w)
    out.append((p + "norm.weight", (h,), bf, small))
    # Stand-ins for the parts of the published files that a text runtime skips.
    out += [("model.visual.patch_embed.proj.weight", (16, 3, 2, 4, 4), bf, w),
            ("mtp.fc.weight", (h, 2 * h), bf, w),
            ("mtp.norm.weight", (h,), bf, small)]
    return out


def mlp_plan(tc, m, w):
    """A layer's MLP tensors: dense SwiGLU, or the router, per-expert routed SwiGLUs and the gated
    shared expert of a MoE."""
    h, bf = tc["hidden_size"], torch.bfloat16

    def swiglu(p, inter):
        return [(p + "gate_proj.weight", (inter, h), bf, w), (p + "up_proj.weight", (inter, h), bf, w),
                (p + "down_proj.weight", (h, inter), bf, w)]
    if not is_moe(tc):
        return swiglu(m, tc["intermediate_size"])
    out = [(m + "gate.weight", (tc["num_experts"], h), bf, w)]
    for e in range(tc["num_experts"]):
        out += swiglu(f"{m}experts.{e}.", tc["moe_intermediate_size"])
    return out + swiglu(m + "shared_expert.", tc["shared_expert_intermediate_size"]) + [
        (m + "shared_expert_gate.weight", (1, h), bf, w)]


def seed_of(name, seed):
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & (2**63 - 1)


@torch.no_grad()
def make_tensor(name, shape, dtype, init, seed, device, chunk=1 << 24):
    g = torch.Generator(device=device).manual_seed(seed_of(name, seed))
    out = torch.empty(shape, dtype=dtype, device=device)
    flat = out.view(-1)
    n = flat.numel()
    for start in range(0, n, chunk):
        m = min(chunk, n - start)
        if init[0] == "normal":
            x = torch.randn(m, generator=g, device=device, dtype=torch.float32) * init[1]
        elif init[0] == "around":
            x = init[1] + torch.randn(m, generator=g, device=device, dtype=torch.float32) * init[2]
        elif init[0] == "a_log":
            x = torch.log(torch.rand(m, generator=g, device=device, dtype=torch.float32) * 15.0 + 1.0)
        else:
            raise ValueError(init)
        flat[start:start + m] = x.to(dtype)
    return out.cpu()


def write_base(tc, base, seed, device, shard_bytes):
    items = plan(tc)
    shards, cur, cur_bytes = [], [], 0
    for it in items:
        nbytes = torch.Size(it[1]).numel() * (2 if it[2] == torch.bfloat16 else 4)
        if cur and cur_bytes + nbytes > shard_bytes:
            shards.append(cur)
            cur, cur_bytes = [], 0
        cur.append(it)
        cur_bytes += nbytes
    shards.append(cur)
    total = 0
    weight_map = {}
    for k, shard in enumerate(shards):
        file = "model.safetensors" if len(shards) == 1 else f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name, shape, dtype, init in shard:
            tensors[name] = make_tensor(name, shape, dtype, init, seed, device)
            total += tensors[name].numel() * tensors[name].element_size()
            weight_map[name] = file
        save_file(tensors, str(base / file), metadata={"format": "pt"})
        print(f"  {file}: {len(tensors)} tensors", file=sys.stderr)
        del tensors
    if len(shards) > 1:
        (base / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    return total


def lora_shapes(tc):
    """[(peft module path, in, out)] for every linear module of every layer (of a MoE: the
    shared expert's; its routed experts are 3-D parameters, not modules)."""
    h = tc["hidden_size"]
    hq, hkv, hd = tc["num_attention_heads"], tc["num_key_value_heads"], tc["head_dim"]
    hk, hv, dk, dv = (tc["linear_num_key_heads"], tc["linear_num_value_heads"],
                      tc["linear_key_head_dim"], tc["linear_value_head_dim"])
    out = []
    for i, t in enumerate(tc["layer_types"]):
        if t == "linear_attention":
            a = f"layers.{i}.linear_attn."
            out += [(a + "in_proj_qkv", h, 2 * hk * dk + hv * dv), (a + "in_proj_z", h, hv * dv),
                    (a + "in_proj_b", h, hv), (a + "in_proj_a", h, hv), (a + "out_proj", hv * dv, h)]
        else:
            a = f"layers.{i}.self_attn."
            out += [(a + "q_proj", h, 2 * hq * hd), (a + "k_proj", h, hkv * hd),
                    (a + "v_proj", h, hkv * hd), (a + "o_proj", hq * hd, h)]
        m = f"layers.{i}.mlp." + ("shared_expert." if is_moe(tc) else "")
        inter = tc["shared_expert_intermediate_size"] if is_moe(tc) else tc["intermediate_size"]
        out += [(m + "gate_proj", h, inter), (m + "up_proj", h, inter), (m + "down_proj", inter, h)]
    return out


def adapter_config(r, alpha, modules, moe=False):
    """What PEFT 0.21 writes for a LoRA on Qwen3_5TextModel (cf. tests/fixtures/kev-small/adapter),
    targeting `modules` (the linear modules the layers have)."""
    family = "qwen3_5_moe" if moe else "qwen3_5"
    return {
        "alora_invocation_tokens": None, "alpha_pattern": {}, "arrow_config": None,
        "auto_mapping": {"base_model_class": "Qwen3_5MoeTextModel" if moe else "Qwen3_5TextModel",
                         "parent_library": f"transformers.models.{family}.modeling_{family}"},
        "base_model_name_or_path": None, "bias": "none", "corda_config": None,
        "ensure_weight_tying": False, "eva_config": None, "exclude_modules": None,
        "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
        "kasa_config": None, "layer_replication": None, "layers_pattern": None,
        "layers_to_transform": None, "loftq_config": {}, "lora_alpha": alpha, "lora_bias": False,
        "lora_dropout": 0.0, "lora_ga_config": None, "megatron_config": None,
        "megatron_core": "megatron.core", "modules_to_save": None, "monteclora_config": None,
        "peft_type": "LORA", "peft_version": "0.21.2", "qalora_group_size": 16, "r": r,
        "rank_pattern": {}, "revision": None, "target_modules": sorted(modules),
        "target_parameters": None, "task_type": None, "trainable_token_indices": None,
        "use_bdlora": None, "use_dora": False, "use_qalora": False, "use_rslora": False,
        "velora_config": None,
    }


def write_adapter(tc, out, seed, device, r=16, alpha=32):
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for path, fan_in, fan_out in lora_shapes(tc):
        key = f"base_model.model.{path}"
        tensors[key + ".lora_A.weight"] = make_tensor(key + "A", (r, fan_in), torch.float32, ("normal", 0.02), seed, device)
        tensors[key + ".lora_B.weight"] = make_tensor(key + "B", (fan_out, r), torch.float32, ("normal", 0.02), seed, device)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps(adapter_config(r, alpha, {p.rsplit(".", 1)[1] for p, _, _ in lora_shapes(tc)}, is_moe(tc)), indent=2, sort_keys=True) + "\n")
    return len(tensors)


def write_head(h, dim, path, seed, device):
    # std 1/sqrt(H): q and k of unit scale, logits of order 1, so the probabilities are far from
    # uniform and a parity check between runtimes means something.
    std = h ** -0.5
    head = {"q.weight": make_tensor("head.q.weight", (dim, h), torch.float32, ("normal", std), seed, device),
            "q.bias": make_tensor("head.q.bias", (dim,), torch.float32, ("normal", 0.01), seed, device),
            "k.weight": make_tensor("head.k.weight", (dim, h), torch.float32, ("normal", std), seed, device),
            "k.bias": make_tensor("head.k.bias", (dim,), torch.float32, ("normal", 0.01), seed, device)}
    save_file(head, str(path))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(SIZES), required=True)
    ap.add_argument("--out", required=True, help="checkpoint folder to write (replaced if present)")
    ap.add_argument("--device", default="cpu", help="where to draw the random numbers (cpu, cuda)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=0, help="the first N layers only (a full attention layer "
                    "every fourth), where the whole model does not fit the GPU")
    ap.add_argument("--shard-gb", type=float, default=2.0, help="base shard size (GB)")
    ap.add_argument("--tokenizer", default=str(QWEN_TOKENIZER))
    args = ap.parse_args()

    started = time.time()
    out = Path(args.out)
    tmp = out.with_name(out.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    (tmp / "base").mkdir(parents=True)
    tc = text_config(args.size, args.layers)
    dim = SIZES[args.size]["head_dim_kev"]

    (tmp / "base" / "config.json").write_text(json.dumps(full_config(tc), indent=2) + "\n")
    shutil.copy(args.tokenizer, tmp / "base" / "tokenizer.json")
    total = write_base(tc, tmp / "base", args.seed, args.device, int(args.shard_gb * 1e9))
    n_lora = write_adapter(tc, tmp / "adapter", args.seed + 1, args.device)
    write_head(tc["hidden_size"], dim, tmp / "head.safetensors", args.seed + 2, args.device)
    kev = {"format": "kev/1", "base": "base", "adapter": "adapter",
           "head": {"file": "head.safetensors", "dim": dim, "temperature": 1.0},
           "template": TEMPLATE, "max_tokens": 8192}
    (tmp / "kev.json").write_text(json.dumps(kev, indent=2) + "\n")

    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    print(f"wrote {out}: {args.size}, base {total / 1e9:.2f} GB, {n_lora} LoRA tensors, head dim {dim} "
          f"({time.time() - started:.1f} s)", file=sys.stderr)


if __name__ == "__main__":
    main()
