"""Converts a benchmark checkpoint's base model to GGUF with llama.cpp's own converter, for the
llama.cpp CPU peer (bench/run_cpu_llamacpp.sh).

    python bench/llamacpp_convert.py LLAMA_CPP_DIR BASE_DIR --outtype f32 --outfile OUT.gguf

The random-weight checkpoints carry the repository's fixture tokenizer (a small byte-level BPE)
instead of Qwen3.5's, so the converter cannot recognise its pre-tokenizer by hash. Prefill speed
does not depend on the vocabulary (llama-bench feeds token ids), so the pre-tokenizer is declared
as Qwen3.5's and everything else is the converter's own path.
"""
import runpy
import sys
from pathlib import Path


def main():
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    llama = Path(sys.argv[1]).resolve()
    sys.path.insert(0, str(llama))
    sys.path.insert(1, str(llama / "gguf-py"))
    from conversion import base

    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen35"
    sys.argv = [str(llama / "convert_hf_to_gguf.py")] + sys.argv[2:]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
