"""Bytes of a checkpoint's backbone layers (`layers.*` of the base, as stored: the embedding,
vision and MTP tensors left out), read from the safetensors headers:

    python bench/weight_bytes.py --checkpoint bench/.cache/kev-35b-a3b-8l

Prints one JSON line {"impl": "weights", "checkpoint", "layer_bytes", "expert_bytes"}: a forward
reads every layer weight at least once where its tokens touch every expert (a MoE request of a
few hundred tokens does), so layer_bytes / latency is a floor on the bytes it moves per second.
"""

import argparse
import json
import struct
from pathlib import Path


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True)
    args = ap.parse_args()
    ckpt = Path(args.checkpoint)
    base = ckpt / json.loads((ckpt / "kev.json").read_text()).get("base", "base")
    layers = experts = 0
    for f in sorted(base.glob("*.safetensors")):
        with open(f, "rb") as fh:
            header = json.loads(fh.read(struct.unpack("<Q", fh.read(8))[0]))
        for name, meta in header.items():
            if name == "__metadata__" or ".layers." not in name or name.startswith("mtp."):
                continue
            size = meta["data_offsets"][1] - meta["data_offsets"][0]
            layers += size
            experts += size if ".mlp.experts." in name else 0
    print(json.dumps({"impl": "weights", "checkpoint": ckpt.name, "layer_bytes": layers,
                      "expert_bytes": experts}))


if __name__ == "__main__":
    main()
