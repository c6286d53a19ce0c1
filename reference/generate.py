"""Regenerates everything under tests/fixtures/ from scratch (the Kev PyTorch reference).

    python reference/generate.py            # writes tests/fixtures/ (CPU, f32, ~1 minute)

What it writes (see tests/fixtures/README.md):
  tokenizer.json          a small byte-level BPE trained here, with the chat and Kev markers
  base-mm/                a tiny Qwen3.5 in the published multimodal layout (untied, one file)
  base-text/              the same text weights in the text-only layout (tied, two shards + index)
  backbone.safetensors    transformers' f32 hidden states: every layer and the final norm, for
                          several lengths, and prefix-then-continuation runs through its cache
  records.jsonl           a dozen Kev records covering the cases of docs/CONTRACT.md §1
  kev-small/              Kev checkpoint: LoRA on every linear module (r=4), head, kev.json
  kev-rslora/             Kev checkpoint on base-text: rsLoRA, PEFT prefix `base_model.model.model.`
  kev-tokens/             Kev checkpoint: LoRA + trained marker embeddings (trainable_token_indices)
  base-moe/               a tiny Qwen3.5 MoE (qwen3_5_moe) in the published multimodal layout, its
                          routed experts stored per expert as the published files store them
  kev-moe/                Kev checkpoint on base-moe: LoRA on every linear module, the shared
                          expert's and its gate's included, and on the fused routed experts'
                          parameters (PEFT's target_parameters)
  base-fp8/               the dense base's weights block-quantized to FP8 (e4m3, 16x16 blocks, f32
                          scales) as Qwen's FP8 releases store them, in the text-only layout
  kev-fp8/                Kev checkpoint on base-fp8; its reference is transformers' own FP8 load
                          with dequantize=True, in f32
  base-ratios/            a tiny dense Qwen3.5 with the 27B's head ratios (6 query heads a KV head,
                          3 DeltaNet value heads a key head), text-only layout
  kev-ratios/             Kev checkpoint on base-ratios: LoRA on every linear module
  kev-*/reference.json    row-form logits and probabilities per question, lora_scale 1.0/0.5/0.0

The numbers come from transformers' own Qwen3.5 (eager attention, its torch delta-rule paths:
flash-linear-attention and causal-conv1d must NOT be installed), PEFT, and a torch pointer head,
all in float32 on the CPU. Everything is seeded, so a rerun reproduces the files.
"""

import argparse
import copy
import json
import math
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

OPTION = "<|kev_option|>"
DECIDE = "<|kev_decide|>"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", OPTION, DECIDE]
TEMPLATE = {
    "state": "<|im_start|>user\n{state}\n",
    "question": "{prompt}\n",
    "option": "- {option}",
    "option_marker": OPTION,
    "decide_marker": DECIDE,
}
LINEAR_MODULES = ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj",
                  "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LENGTHS = [1, 2, 3, 63, 64, 65, 200]
# (prefix length, total length) for "prefix then continuation" through transformers' cache.
CONTINUATIONS = [(1, 3), (63, 65), (64, 130), (100, 200)]
LORA_SCALES = [1.0, 0.5, 0.0]

CORPUS = """
The quick brown fox jumps over the lazy dog. A decision model reads a state and answers questions.
Which move is best? Should we open the door or keep it closed? The market rose by three percent.
Players choose between attack, defend, retreat and wait. The patient reports a mild headache.
Weather: rain in the morning, sun after noon. Pick the safest route through the old city.
yes no maybe always never sometimes red green blue left right up down first second third
Les élèves lisent un livre. Der Hund läuft schnell. 数字 1 2 3 4 5 6 7 8 9 10 and symbols + - * / =
"""


def text_config(vocab_size):
    """A tiny Qwen3.5 text config with every asymmetry of the real family."""
    return {
        "model_type": "qwen3_5_text",
        "hidden_size": 64,
        "num_hidden_layers": 8,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3
        + ["full_attention"],
        "full_attention_interval": 4,
        "intermediate_size": 112,
        "vocab_size": vocab_size,
        "num_attention_heads": 4,   # GQA 4 / 2, head_dim 32 != 64 / 4
        "num_key_value_heads": 2,
        "head_dim": 32,
        "linear_num_key_heads": 2,  # value heads = 2 x key heads
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 32,  # Dk != Dv so a transposed state shows
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "attn_output_gate": True,
        "max_position_embeddings": 4096,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                            "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1],
                            "mrope_interleaved": True},
        "initializer_range": 0.05,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "pad_token_id": 0,
        "tie_word_embeddings": False,
    }


def ratios_text_config(vocab_size):
    """The dense tiny config with the head ratios of the 27B: six query heads a key/value head
    (24 / 4 there) and three DeltaNet value heads a key head (48 / 16), dk = dv as published."""
    cfg = text_config(vocab_size)
    cfg.update({"num_attention_heads": 6, "num_key_value_heads": 1, "linear_num_key_heads": 2,
                "linear_num_value_heads": 6, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
                "num_hidden_layers": 4, "layer_types": ["linear_attention"] * 3 + ["full_attention"]})
    return cfg


def moe_text_config(vocab_size):
    """A tiny Qwen3.5 MoE text config: the dense one's mixers, 4 routed experts (top 2) and a
    shared expert of another width in every layer."""
    cfg = {k: v for k, v in text_config(vocab_size).items() if k != "intermediate_size"}
    cfg.update({
        "model_type": "qwen3_5_moe_text",
        "num_hidden_layers": 4,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48,
        "router_aux_loss_coef": 0.001,
    })
    return cfg


def train_tokenizer(out: Path) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([line for line in CORPUS.splitlines() if line] * 4, trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    return Tokenizer.from_file(str(out / "tokenizer.json"))


def build_model(cfg_dict, seed, moe=False):
    if moe:
        from transformers import Qwen3_5MoeForCausalLM as Model, Qwen3_5MoeTextConfig as Config
    else:
        from transformers import Qwen3_5ForCausalLM as Model, Qwen3_5TextConfig as Config

    torch.manual_seed(seed)
    cfg = Config(**cfg_dict)
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"   # the experts one by one, in index order
    model = Model(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("embed_tokens.weight") or name == "lm_head.weight":
                p.normal_(0.0, 1.0)
            elif name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))      # plain weight, around 1
            elif name.endswith("norm.weight"):
                p.copy_(0.3 * torch.randn_like(p))            # zero-centred: (1 + w)
            elif name.endswith("A_log"):
                p.copy_(torch.log(torch.empty_like(p).uniform_(0.5, 8.0)))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn_like(p))
            elif name.endswith("conv1d.weight"):
                p.normal_(0.0, 0.3)
            else:
                p.normal_(0.0, 0.08)
    # The published files are bf16 except A_log and linear_attn.norm.weight (F32): round the
    # others so the f32 reference runs on exactly the values the files hold.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not (name.endswith("A_log") or name.endswith("linear_attn.norm.weight")):
                p.copy_(p.to(torch.bfloat16).float())
    return model


def file_tensors(model):
    """The text weights as stored: bf16 except A_log and the gated norm weight (F32)."""
    out = {}
    for name, t in model.state_dict().items():
        t = t.detach().contiguous()
        keep_f32 = name.endswith("A_log") or name.endswith("linear_attn.norm.weight")
        out[name] = t.clone() if keep_f32 else t.to(torch.bfloat16)
    return out


def write_multimodal(base: Path, tensors, cfg_dict, tokenizer_path: Path, architecture, model_type):
    """A base in the published multimodal layout: one file, the text config under `text_config`
    beside a stub vision config, untied."""
    base.mkdir()
    save_file(tensors, str(base / "model.safetensors"), metadata={"format": "pt"})
    cfg = {
        "architectures": [architecture],
        "model_type": model_type,
        "text_config": dict(cfg_dict),
        "vision_config": {"model_type": model_type, "depth": 1, "hidden_size": 16},
        "tie_word_embeddings": False,
        "image_token_id": 1,
        "video_token_id": 2,
    }
    (base / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    shutil.copy(tokenizer_path, base / "tokenizer.json")


def save_bases(model, cfg_dict, root: Path, tokenizer_path: Path):
    tensors = file_tensors(model)
    lm_head = tensors.pop("lm_head.weight")

    # Multimodal layout, untied (lm_head stored), one file, with vision and MTP tensors to ignore.
    mm_tensors = {k.replace("model.", "model.language_model.", 1): v for k, v in tensors.items()}
    mm_tensors["lm_head.weight"] = lm_head
    g = torch.Generator().manual_seed(7)
    mm_tensors["model.visual.patch_embed.proj.weight"] = torch.randn(8, 3, 2, 2, generator=g).to(torch.bfloat16)
    mm_tensors["mtp.fc.weight"] = torch.randn(64, 128, generator=g).to(torch.bfloat16)
    write_multimodal(root / "base-mm", mm_tensors, cfg_dict, tokenizer_path,
                     "Qwen3_5ForConditionalGeneration", "qwen3_5")

    # Text-only layout, tied (no lm_head), older top-level RoPE fields and no layer_types, sharded.
    tx = root / "base-text"
    tx.mkdir()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    weight_map = {}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(tx / file), metadata={"format": "pt"})
        weight_map.update({k: file for k in keys})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (tx / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    tx_cfg = {k: v for k, v in cfg_dict.items() if k not in ("layer_types", "rope_parameters")}
    tx_cfg.update({"architectures": ["Qwen3_5ForCausalLM"], "rope_theta": 10000000.0,
                   "partial_rotary_factor": 0.25, "tie_word_embeddings": True})
    (tx / "config.json").write_text(json.dumps(tx_cfg, indent=2) + "\n")
    shutil.copy(tokenizer_path, tx / "tokenizer.json")


def save_moe_base(model, cfg_dict, root: Path, tokenizer_path: Path):
    """The MoE base in the published multimodal layout: the routed experts' fused tensors
    (`experts.gate_up_proj: [E, 2I, H]`, `experts.down_proj: [E, H, I]`) stored per expert as
    `experts.{e}.gate_proj`, `up_proj` and `down_proj`, as the published checkpoints hold them."""
    tensors = file_tensors(model)
    lm_head = tensors.pop("lm_head.weight")
    out = {}
    for name, t in tensors.items():
        name = name.replace("model.", "model.language_model.", 1)
        if name.endswith("mlp.experts.gate_up_proj"):
            stem, inner = name[: -len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{stem}{e}.gate_proj.weight"] = t[e, :inner].contiguous()
                out[f"{stem}{e}.up_proj.weight"] = t[e, inner:].contiguous()
        elif name.endswith("mlp.experts.down_proj"):
            stem = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{stem}{e}.down_proj.weight"] = t[e].contiguous()
        else:
            out[name] = t
    out["lm_head.weight"] = lm_head
    write_multimodal(root / "base-moe", out, cfg_dict, tokenizer_path,
                     "Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe")


FP8_BLOCK = [16, 16]
FP8_MAX = 448.0   # the largest finite float8_e4m3fn


def fp8_quantize(w: torch.Tensor, block):
    """Block-wise e4m3 quantization as Qwen's FP8 releases hold it: per block, scale = amax / 448
    (1 for an all-zero block) stored in f32 as `weight_scale_inv`, values w / scale in e4m3."""
    rows, cols = w.shape
    bm, bn = block
    blocks = w.float().reshape(rows // bm, bm, cols // bn, bn)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale[:, None, :, None]).reshape(rows, cols).to(torch.float8_e4m3fn)
    return q, scale.contiguous()


def save_fp8_base(model, cfg_dict, root: Path, tokenizer_path: Path):
    """The dense base in the text-only layout with every layer projection whose sides are whole
    blocks stored in FP8 (the DeltaNet's small in_proj_b / in_proj_a, the conv, norms, A_log,
    dt_bias and the embeddings stay as they are, as in the published FP8 files)."""
    tensors = file_tensors(model)
    tensors.pop("lm_head.weight")
    out, kept = {}, []
    for name, t in tensors.items():
        linear = name.startswith("model.layers.") and name.split(".")[-2] in LINEAR_MODULES
        quantize = (linear and t.dim() == 2
                    and t.shape[0] % FP8_BLOCK[0] == 0 and t.shape[1] % FP8_BLOCK[1] == 0)
        if quantize:
            q, scale = fp8_quantize(t, FP8_BLOCK)
            out[name], out[name + "_scale_inv"] = q, scale
        else:
            out[name] = t
            if linear:
                kept.append(name[len("model."): -len(".weight")])
    quantization = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                    "weight_block_size": FP8_BLOCK, "modules_to_not_convert": sorted(kept)}
    write_text_only(root / "base-fp8", out, cfg_dict, tokenizer_path, quantization_config=quantization)


def write_text_only(base: Path, tensors, cfg_dict, tokenizer_path: Path, **extra):
    """A base in the text-only layout as `Qwen3_5ForCausalLM` saves it: one file, tied (no
    lm_head), the config at the top level with `extra` fields."""
    base.mkdir()
    save_file(tensors, str(base / "model.safetensors"), metadata={"format": "pt"})
    cfg = dict(cfg_dict)
    cfg.update({"architectures": ["Qwen3_5ForCausalLM"], "tie_word_embeddings": True, **extra})
    (base / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    shutil.copy(tokenizer_path, base / "tokenizer.json")


def load_fp8_base(root: Path):
    """transformers' own load of base-fp8, dequantized (FineGrainedFP8Config(dequantize=True)) in
    f32: the reference's dequantized weights."""
    from transformers import FineGrainedFP8Config, Qwen3_5ForCausalLM

    model = Qwen3_5ForCausalLM.from_pretrained(
        str(root / "base-fp8"), dtype=torch.float32, attn_implementation="eager",
        quantization_config=FineGrainedFP8Config(dequantize=True, weight_block_size=tuple(FP8_BLOCK)))
    return model.float().eval()


@torch.no_grad()
def backbone_reference(model, vocab_size, out_file: Path):
    """Hidden states per layer and after the final norm, from transformers itself."""
    text = model.model
    outs = {}
    g = torch.Generator().manual_seed(1234)
    longest = max(LENGTHS)
    ids_all = torch.randint(0, vocab_size, (1, longest), generator=g)
    for n in LENGTHS:
        ids = ids_all[:, :n]
        layer_outs = []
        hooks = [layer.register_forward_hook(lambda _m, _i, o: layer_outs.append(o[0] if isinstance(o, tuple) else o))
                 for layer in text.layers]
        final = text(input_ids=ids, use_cache=False).last_hidden_state
        for h in hooks:
            h.remove()
        outs[f"len{n}.ids"] = ids[0].to(torch.int64).clone()
        for i, h in enumerate(layer_outs):
            outs[f"len{n}.layer{i}"] = h[0].float().contiguous()
        outs[f"len{n}.final"] = final[0].float().contiguous()
    for p, n in CONTINUATIONS:
        ids = ids_all[:, :n]
        first = text(input_ids=ids[:, :p], use_cache=True)
        second = text(input_ids=ids[:, p:], past_key_values=first.past_key_values, use_cache=True)
        whole = text(input_ids=ids, use_cache=False).last_hidden_state
        cont = second.last_hidden_state
        err = (cont - whole[:, p:]).abs().max().item()
        print(f"transformers prefix {p} + continuation {n - p}: max |cont - whole| = {err:.2e}")
        if err > 1e-4:
            raise SystemExit("transformers' own cache continuation disagrees with the whole run")
        outs[f"cont{p}_{n}.ids"] = ids[0].to(torch.int64).clone()
        outs[f"cont{p}_{n}.final"] = cont[0].float().contiguous()
    # No metadata: safetensors writes it from a hash map, in an order that changes between runs.
    save_file(outs, str(out_file))


def records():
    long_state = " ".join(f"step {i}: the fox moves {['left', 'right', 'up', 'down'][i % 4]}." for i in range(40))
    shared = "Weather: rain in the morning, sun after noon."
    return [
        {"id": "r1", "state": "The market rose by three percent.",
         "questions": [{"id": "q1", "prompt": "Which move?", "options": ["buy", "sell", "hold"], "answer": 2},
                       {"id": "q2", "prompt": "Is it risky?", "options": ["yes", "no"], "answer": 0}]},
        {"id": "r2", "state": shared,
         "questions": [{"prompt": "Take an umbrella?", "options": ["yes", "no", "maybe"], "answer": 0}]},
        {"id": "r3", "state": shared,  # same state as r2: prefix reuse
         "questions": [{"id": "q1", "prompt": "Pick the safest route.", "options": ["old city", "river", "hill", "tunnel"]},
                       {"id": "q2", "prompt": "When to leave?", "options": ["morning", "after noon"], "answer": 1}]},
        {"state": "", "questions": [{"prompt": "Empty state: first or second?", "options": ["first", "second"]}]},
        {"id": "r5", "state": "Players choose between attack, defend, retreat and wait.",
         "questions": [{"id": "only", "prompt": "One option only.", "options": ["wait"], "answer": 0}]},
        {"id": "r6", "state": "Les élèves lisent un livre. 数字 1 2 3.",
         "questions": [{"prompt": "Langue?", "options": ["français", "deutsch", "中文"], "answer": 0},
                       {"prompt": "Count?", "options": ["1", "2", "3", "4", "5"], "answer": 2},
                       {"prompt": "Sure?", "options": ["yes", "no"]}]},
        {"id": "r7", "state": long_state,
         "questions": [{"prompt": "Where does the fox end?", "options": ["left", "right", "up", "down"], "answer": 3},
                       {"prompt": "How many steps?", "options": ["ten", "forty"], "answer": 1}]},
        {"id": "r8", "state": "The patient reports a mild headache.",
         "questions": [{"prompt": "Severity?", "options": ["mild", "moderate", "severe"], "answer": 0}]},
        {"id": "r9", "state": "Should we open the door or keep it closed?",
         "questions": [{"prompt": "Door?", "options": ["open it", "keep it closed"], "answer": 1},
                       {"prompt": "", "options": ["", "empty option text"]}]},
        {"id": "r10", "state": "Pick the safest route through the old city.",
         "questions": [{"prompt": "Route " + str(i), "options": ["first", "second", "third"], "answer": i % 3}
                       for i in range(4)]},
        {"id": "r11", "state": "red green blue",
         "questions": [{"prompt": "Which colour is a primary of light?", "options": ["red", "green", "blue", "all of them"]}]},
        {"id": "r12", "state": "A decision model reads a state and answers questions.",
         "questions": [{"prompt": "Is this a test?", "options": ["yes", "no"], "answer": 0}]},
    ]


def encode(tok: Tokenizer, rec):
    """docs/CONTRACT.md §2: each piece tokenized alone (no special tokens), then concatenated."""
    piece = lambda s: tok.encode(s, add_special_tokens=False).ids
    opt_id, dec_id = tok.token_to_id(OPTION), tok.token_to_id(DECIDE)
    state = piece(TEMPLATE["state"].format(state=rec["state"]))
    rows = []
    for q in rec["questions"]:
        ids = piece(TEMPLATE["question"].format(prompt=q["prompt"]))
        opts = []
        for o in q["options"]:
            ids += piece(TEMPLATE["option"].format(option=o))
            opts.append(len(ids))
            ids.append(opt_id)
        rows.append({"ids": ids + [dec_id], "decide": len(ids), "opts": opts})
    return state, rows


def make_head(hidden, dim, seed, path: Path):
    g = torch.Generator().manual_seed(seed)
    head = {"q.weight": torch.randn(dim, hidden, generator=g) * 0.3,
            "q.bias": torch.randn(dim, generator=g) * 0.1,
            "k.weight": torch.randn(dim, hidden, generator=g) * 0.3,
            "k.bias": torch.randn(dim, generator=g) * 0.1}
    save_file(head, str(path))
    return head


def head_logits(head, h_decide, h_opts, dim, temperature):
    q = head["q.weight"] @ h_decide + head["q.bias"]
    k = h_opts @ head["k.weight"].T + head["k.bias"]
    return (k @ q) / (math.sqrt(dim) * temperature)


def make_adapter(base_model, variant, seed, out_dir: Path, opt_id, dec_id):
    """A PEFT LoRA adapter with non-zero B (and new marker rows for the `tokens` variant)."""
    from peft import LoraConfig, get_peft_model

    model = copy.deepcopy(base_model)
    if variant == "rslora":
        # Wrapping the causal-LM gives keys under `base_model.model.model.`.
        target, kwargs = model, {"use_rslora": True, "lora_alpha": 6, "target_modules": LINEAR_MODULES}
    elif variant == "tokens":
        target, kwargs = model.model, {"lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "in_proj_qkv", "down_proj"],
                                       "trainable_token_indices": {"embed_tokens": [opt_id, dec_id]}}
    elif variant == "moe":
        # The shared expert's projections are gate_proj, up_proj, down_proj; its gate a linear
        # module of its own. The fused routed experts are parameters, which PEFT wraps through
        # `target_parameters` (the router it does not adapt).
        target, kwargs = model.model, {"lora_alpha": 8, "target_modules": LINEAR_MODULES + ["shared_expert_gate"],
                                       "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}
    else:
        target, kwargs = model.model, {"lora_alpha": 8, "target_modules": LINEAR_MODULES}
    cfg = LoraConfig(r=4, lora_dropout=0.0, bias="none", **kwargs)
    peft_model = get_peft_model(target, cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            elif "trainable_tokens_delta" in name:
                p.copy_(torch.randn(p.shape, generator=g))
    peft_model.save_pretrained(str(out_dir))
    # PEFT keeps target_modules as a set: sort it so reruns write identical files.
    cfg_path = out_dir / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["target_modules"] = sorted(cfg["target_modules"])
    # A base loaded from disk (base-fp8) would leave its path here and in PEFT's model card: the
    # files name no base, as for a model built in memory.
    cfg["base_model_name_or_path"] = None
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    card = out_dir / "README.md"
    lines = card.read_text().splitlines(keepends=True)
    card.write_text("".join("base_model: ''\n" if l.startswith("base_model:") else
                            "- 'base_model:adapter:'\n" if l.startswith("- base_model:adapter:") else l
                            for l in lines))


def scaled_adapter(adapter_dir: Path, scale: float, tmp: Path, base_embed):
    """A copy of the adapter whose effect is `scale` times the original (WiSE-FT interpolation):
    lora_B scaled by `scale`; trained token rows blended as (1 - s)·row + s·new_row."""
    if tmp.exists():
        shutil.rmtree(tmp)
    shutil.copytree(adapter_dir, tmp)
    tensors = load_file(str(tmp / "adapter_model.safetensors"))
    cfg = json.loads((tmp / "adapter_config.json").read_text())
    ids = (cfg.get("trainable_token_indices") or {}).get("embed_tokens", [])
    for k in list(tensors):
        if "lora_B" in k:
            tensors[k] = tensors[k] * scale
        elif "trainable_tokens_delta" in k:
            tensors[k] = (1 - scale) * base_embed[ids] + scale * tensors[k]
    save_file(tensors, str(tmp / "adapter_model.safetensors"))
    return tmp


@torch.no_grad()
def decision_reference(base_model, ckpt: Path, head, kev, tok, recs, variant):
    from peft import PeftModel

    results = {}
    base_embed = base_model.model.embed_tokens.weight.detach().clone()
    for scale in LORA_SCALES:
        model = copy.deepcopy(base_model)
        tmp = scaled_adapter(ckpt / "adapter", scale, ckpt.parent / f".tmp-{ckpt.name}", base_embed)
        target = model if variant == "rslora" else model.model
        peft_model = PeftModel.from_pretrained(target, str(tmp)).eval()
        shutil.rmtree(tmp)
        text = peft_model.get_base_model()
        text = text.model if variant == "rslora" else text
        out = []
        for rec in recs:
            state, rows = encode(tok, rec)
            qs = []
            for q, row in zip(rec["questions"], rows):
                ids = torch.tensor([state + row["ids"]])
                h = text(input_ids=ids, use_cache=False).last_hidden_state[0]
                off = len(state)
                logits = head_logits(head, h[off + row["decide"]], h[[off + o for o in row["opts"]]],
                                     kev["head"]["dim"], kev["head"]["temperature"])
                qs.append({"logits": [float(x) for x in logits],
                           "probs": [float(x) for x in torch.softmax(logits, -1)]})
            out.append({"id": rec.get("id"), "state_ids": state, "rows": rows, "questions": qs})
        results[str(scale)] = out
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "tests" / "fixtures"))
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    torch.use_deterministic_algorithms(True)
    out = Path(args.out)
    for name in ["base-mm", "base-text", "kev-small", "kev-rslora", "kev-tokens", "base-moe", "kev-moe",
                 "base-fp8", "kev-fp8", "base-ratios", "kev-ratios"]:
        if (out / name).exists():
            shutil.rmtree(out / name)
    out.mkdir(parents=True, exist_ok=True)

    tok = train_tokenizer(out)
    vocab = tok.get_vocab_size()
    cfg = text_config(vocab)
    model = build_model(cfg, seed=0)
    save_bases(model, cfg, out, out / "tokenizer.json")
    backbone_reference(model, vocab, out / "backbone.safetensors")

    recs = records()
    with open(out / "records.jsonl", "w") as f:
        for r in recs:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")

    opt_id, dec_id = tok.token_to_id(OPTION), tok.token_to_id(DECIDE)
    moe_cfg = moe_text_config(vocab)
    moe = build_model(moe_cfg, seed=3, moe=True)
    save_moe_base(moe, moe_cfg, out, out / "tokenizer.json")
    save_fp8_base(model, cfg, out, out / "tokenizer.json")
    fp8 = load_fp8_base(out)
    ratios = build_model(ratios_text_config(vocab), seed=5)
    tensors = file_tensors(ratios)
    tensors.pop("lm_head.weight")
    write_text_only(out / "base-ratios", tensors, ratios_text_config(vocab), out / "tokenizer.json")
    variants = [("kev-small", "lora", "../base-mm", 0.7, model), ("kev-rslora", "rslora", "../base-text", 1.0, model),
                ("kev-tokens", "tokens", "../base-mm", 1.3, model), ("kev-moe", "moe", "../base-moe", 0.9, moe),
                ("kev-fp8", "lora", "../base-fp8", 0.8, fp8), ("kev-ratios", "lora", "../base-ratios", 1.1, ratios)]
    for i, (name, variant, base, temperature, model) in enumerate(variants):
        ckpt = out / name
        ckpt.mkdir()
        kev = {"format": "kev/1", "base": base, "adapter": "adapter",
               "head": {"file": "head.safetensors", "dim": 16, "temperature": temperature},
               "template": TEMPLATE, "max_tokens": 1024}
        (ckpt / "kev.json").write_text(json.dumps(kev, indent=2) + "\n")
        head = make_head(cfg["hidden_size"], 16, 100 + i, ckpt / "head.safetensors")
        make_adapter(model, variant, 200 + i, ckpt / "adapter", opt_id, dec_id)
        ref = decision_reference(model, ckpt, head, kev, tok, recs, variant)
        (ckpt / "reference.json").write_text(json.dumps(ref) + "\n")
        print(f"{name}: {sum(len(r['questions']) for r in ref['1.0'])} questions x {len(LORA_SCALES)} scales")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
