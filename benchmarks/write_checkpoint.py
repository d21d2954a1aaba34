"""A random-weight checkpoint of a published config written to disk, with a rank-16 all-linear PEFT adapter and a
reference of random samples: the inputs of the multi-GPU runs (benchmarks/multi_gpu.sh), as a user has them.

    python benchmarks/write_checkpoint.py --config benchmarks/configs/Qwen3-30B-A3B.json --out DIR \
        [--layers N] [--samples 4096] [--device cuda]
writes DIR/model (config.json, safetensors shards), DIR/adapter (PEFT) and DIR/reference.parquet (half the
samples under the adapter; lengths 128-2048; random logprobs: this measures time, not agreement).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from lora_eval.bench import make_peft_adapters, random_hf_model, random_reference, read_model_config


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="benchmarks/configs/Qwen3-30B-A3B.json")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = read_model_config(args.config, args.layers)
    hf = random_hf_model(config, torch.bfloat16, torch.device(args.device), seed=0)
    hf.save_pretrained(out / "model", max_shard_size="5GB")
    (out / "model" / "config.json").write_text(json.dumps({**json.loads((out / "model" / "config.json").read_text()),
                                                            "num_hidden_layers": config["num_hidden_layers"]}))
    peft_model, _ = make_peft_adapters(hf, ["adapter"], 16, "all", seed=0)
    peft_model.save_pretrained(out / "peft")
    random_reference(out / "reference.parquet", args.samples, config["vocab_size"], seed=1)
    print(f"wrote {out}/model ({config['num_hidden_layers']} layers), {out}/peft/adapter, {out}/reference.parquet")


if __name__ == "__main__":
    main()
