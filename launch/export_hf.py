"""Export a model to a Hugging Face `transformers` checkpoint (MLA -> DeepseekV3ForCausalLM, GQA -> Glm4MoeForCausalLM).

python launch/export_hf.py --config configs/tiny.yaml --out exports/tiny-hf            # random init
python launch/export_hf.py --weights model.pt --config configs/tiny.yaml --out DIR     # a saved state_dict
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe_lm.config import load_config  # noqa: E402
from moe_lm.interop.hf import export_hf  # noqa: E402
from moe_lm.model import Transformer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="YAML preset of the model")
    ap.add_argument("--weights", help="a torch state_dict of moe_lm.model.Transformer (default: random init)")
    ap.add_argument("--out", required=True, help="output directory (safetensors + config.json)")
    ap.add_argument("overrides", nargs="*", help="config overrides, e.g. model.dim=256")
    args = ap.parse_args()
    cfg = load_config(args.config, args.overrides)
    torch.manual_seed(cfg.seed)
    model = Transformer(cfg.model)
    if args.weights:
        path = Path(args.weights)
        if not path.is_file():
            sys.exit(f"error: weights file not found: {path}")
        model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    out = export_hf(model.eval(), args.out)
    print(f"wrote {out} (load it with transformers.AutoModelForCausalLM.from_pretrained('{out}'))")


if __name__ == "__main__":
    main()
