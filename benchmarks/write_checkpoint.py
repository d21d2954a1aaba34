"""A random-weight checkpoint of a published config written to disk, with a rank-16 all-linear PEFT adapter and a
reference of random samples: the inputs of the multi-GPU runs (benchmarks/multi_gpu.sh), as a user has them.

    python benchmarks/write_checkpoint.py --config benchmarks/configs/Qwen3-30B-A3B.json --out DIR \
        [--layers N] [--samples 4096] [--device cuda] [--mxfp4]
writes DIR/model (config.json, safetensors shards), DIR/peft/adapter (PEFT, rank 16 on every linear and the
experts) and DIR/reference.parquet (half the samples under the adapter; lengths 128-2048; random logprobs: this
measures time, not agreement). `--mxfp4` (gpt-oss configs): the experts stored as the release stores them,
`*_blocks` / `*_scales` (the model's own random values rounded to MXFP4), with the config's quantization_config.
`--as-released`: the model class the config's `architectures` names (Qwen3.5: the vision-language
Qwen3_5MoeForConditionalGeneration, text weights under `model.language_model.` beside the vision tower, as released;
its adapter made on that model as a trainer of it makes one) instead of the text model AutoModelForCausalLM builds.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from lora_eval.tasks.bench import (make_peft_adapters, random_hf_model, random_reference, randomise_weights,
                                   read_model_config, text_config)
from lora_eval.tasks.demo import build_tokenizer


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="benchmarks/configs/Qwen3-30B-A3B.json")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", required=True)
    parser.add_argument("--mxfp4", action="store_true", help="experts in MXFP4 as gpt-oss releases them")
    parser.add_argument("--as-released", action="store_true",
                        help="the class config.json's architectures names (a vision-language wrapper and all)")
    parser.add_argument("--streamed", action="store_true",
                        help="draw and write one decoder layer at a time (models larger than the device)")
    parser.add_argument("--fp8", action="store_true",
                        help="with --streamed: block-FP8 as Qwen's FP8 releases store Qwen3-MoE (per-expert keys)")
    parser.add_argument("--tokenizer-from", default=None, metavar="MMLU_DIR",
                        help="also a 32k byte-level BPE trained on this MMLU release's text (for lora-eval mmlu)")
    parser.add_argument("--first-layers-of", default=None, metavar="DIR",
                        help="instead: DIR (written by --streamed) cut to its first --layers layers, shards linked")
    args = parser.parse_args()
    if args.first_layers_of:
        return first_layers(Path(args.first_layers_of), Path(args.out), args.layers)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = read_model_config(args.config, args.layers)
    quantization = config.pop("quantization_config", None)
    if args.mxfp4 and (quantization or {}).get("quant_method") != "mxfp4":
        parser.error(f"--mxfp4 needs a config with an mxfp4 quantization_config; {args.config} has {quantization}")
    if args.streamed:
        save_streamed(config, out, torch.device(args.device), fp8=args.fp8)
    else:
        hf = (released_model if args.as_released else random_hf_model)(config, torch.bfloat16,
                                                                       torch.device(args.device), seed=0)
        if args.mxfp4:
            save_mxfp4(hf, out / "model", quantization)
        else:
            hf.save_pretrained(out / "model", max_shard_size="5GB")
        peft_model, _ = make_peft_adapters(hf, ["adapter"], 16, "all", seed=0)
        peft_model.save_pretrained(out / "peft")
    written = json.loads((out / "model" / "config.json").read_text())
    layers = text_config(config)["num_hidden_layers"]
    text_config(written)["num_hidden_layers"] = layers
    (out / "model" / "config.json").write_text(json.dumps(written))
    if args.tokenizer_from:
        texts = [line for f in sorted(Path(args.tokenizer_from).glob("*/*.csv")) for line in f.read_text().splitlines()]
        build_tokenizer(out / "model", vocab_size=32768, texts=texts)
    random_reference(out / "reference.parquet", args.samples, text_config(config)["vocab_size"], seed=1)
    print(f"wrote {out}/model ({layers} layers), {out}/peft/adapter, {out}/reference.parquet")


def released_model(config: dict, dtype: torch.dtype, device: torch.device, seed: int):
    """bench.random_hf_model for the class config.json's `architectures` names, made in `dtype` on `device`."""
    import transformers
    from transformers import AutoConfig

    cls = getattr(transformers, config["architectures"][0])
    with torch.device(device):
        model = cls._from_config(AutoConfig.for_model(**config), dtype=dtype)
    randomise_weights(model, seed)
    return model.eval()


E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # the magnitudes of the 4-bit codes 0..7 (bit 3 the sign)
SHARD_BYTES = 5 << 30


def mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [rows, cols] (cols a multiple of 32) -> blocks uint8 [rows, cols/32, 16] (two codes a byte, low nibble
    first) and scales uint8 [rows, cols/32] (E8M0, bias 127): per 32 values the smallest power-of-two scale that
    fits their largest magnitude in 6, each value the nearest E2M1 one (tests/builders.py quantize_mxfp4, in
    float32 on w's device)."""
    rows, cols = w.shape
    groups = w.float().reshape(rows, cols // 32, 32)  # [rows, G, 32]
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1, keepdim=True).clamp_min(2.0**-100) / 6.0))  # [rows, G, 1]
    grid = torch.tensor(E2M1, device=w.device)
    codes = (groups.abs() / torch.exp2(exponent)).unsqueeze(-1).sub(grid).abs().argmin(-1)  # [rows, G, 32]
    codes |= (groups < 0).long() << 3
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)  # [rows, G, 16]
    return blocks, (exponent[..., 0] + 127).to(torch.uint8)


def save_mxfp4(hf, out: Path, quantization: dict) -> None:
    """The model's tensors as gpt-oss's release holds them: each layer's expert stacks gate_up_proj [E, H, 2I] and
    down_proj [E, I, H] as `{key}_blocks` / `{key}_scales` of the transposed [E, out, in], the rest in bf16, in
    shards of about 5 GiB behind model.safetensors.index.json, with the config's quantization_config."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    shard, shards, weight_map = {}, [], {}

    def flush():
        if shard:
            name = f"model-{len(shards) + 1:05d}.safetensors"
            save_file(shard, str(out / name), metadata={"format": "pt"})
            weight_map.update({key: name for key in shard})
            shards.append(name)
            shard.clear()

    for key, w in hf.state_dict().items():
        if key.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            pairs = [mxfp4(w[e].T) for e in range(w.shape[0])]  # per expert: [out, in/32, 16], [out, in/32]
            tensors = {f"{key}_blocks": torch.stack([b for b, _ in pairs]), f"{key}_scales": torch.stack([s for _, s in pairs])}
        else:
            tensors = {key: w}
        for name, t in tensors.items():
            shard[name] = t.contiguous().cpu()
        if sum(t.numel() * t.element_size() for t in shard.values()) >= SHARD_BYTES:
            flush()
    flush()
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps({**hf.config.to_dict(), "quantization_config": quantization}))


def save_streamed(config: dict, out: Path, device: torch.device, fp8: bool = False) -> None:
    """The checkpoint and adapter of `config` without ever holding the model: a one-layer model gives the tensors
    outside the layers, each layer's names and shapes and the PEFT adapter's; each decoder layer is then drawn on
    `device` (bench.randomise_weights' distributions) and written as its own shard, and the adapter's layer-0
    factors are drawn again for every layer. Every layer must have the same tensors (all-MoE configs).
    `fp8`: as Qwen's block-FP8 releases store a Qwen3-MoE — experts per expert (`experts.{e}.gate_proj.weight` ...),
    every projection's weight float8_e4m3fn with a float32 `weight_scale_inv` per 128 x 128 block; embeddings,
    norms, routers and lm_head in bf16; the release's quantization_config."""
    from safetensors.torch import load_file, save_file

    layers = config["num_hidden_layers"]
    hf = random_hf_model({**config, "num_hidden_layers": 1}, torch.bfloat16, device, seed=0)
    model_dir = out / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    state = hf.state_dict()
    first = {k: v for k, v in state.items() if k.startswith("model.layers.0.")}
    weight_map = {k: "model-outside-layers.safetensors" for k in state if k not in first}
    save_file({k: state[k].contiguous().cpu() for k in weight_map}, str(model_dir / "model-outside-layers.safetensors"),
              metadata={"format": "pt"})
    generator = torch.Generator(device=device).manual_seed(1)
    for i in range(layers):
        name = f"model-layer-{i:03d}.safetensors"
        shard = {key.replace("model.layers.0.", f"model.layers.{i}.", 1): redraw(key, value, generator)
                 for key, value in first.items()}
        shard = {k: v.cpu() for k, v in (fp8_layer(shard) if fp8 else shard).items()}
        save_file(shard, str(model_dir / name), metadata={"format": "pt"})
        weight_map.update({key: name for key in shard})
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config_json = {**hf.config.to_dict(), "num_hidden_layers": layers}
    if fp8:
        config_json["quantization_config"] = dict(
            quant_method="fp8", fmt="e4m3", activation_scheme="dynamic", weight_block_size=[FP8_BLOCK, FP8_BLOCK],
            modules_to_not_convert=["lm_head"] + [f"model.layers.{i}.mlp.gate" for i in range(layers)])
    (model_dir / "config.json").write_text(json.dumps(config_json))
    peft_model, _ = make_peft_adapters(hf, ["adapter"], 16, "all", seed=0)
    peft_model.save_pretrained(out / "peft")
    del peft_model, hf
    adapter_file = out / "peft" / "adapter" / "adapter_model.safetensors"
    factors = load_file(str(adapter_file))
    layer_factors = {k: v for k, v in factors.items() if ".layers.0." in k}
    for i in range(1, layers):
        factors.update({k.replace(".layers.0.", f".layers.{i}.", 1): (torch.randn(v.shape, generator=generator,
                        device=device) * v.float().std()).to(v.dtype).cpu() for k, v in layer_factors.items()})
    save_file(factors, str(adapter_file), metadata={"format": "pt"})


def first_layers(src: Path, out: Path, layers: int) -> None:
    """src (model/, peft/adapter/, reference.parquet as --streamed writes them) cut to its first `layers` decoder
    layers in out: the same weights (shards linked, an index and a config of that many layers) and the adapter's
    factors of those layers; the agreement run of a model that fits one GPU."""
    from safetensors.torch import load_file, save_file

    index = json.loads((src / "model" / "model.safetensors.index.json").read_text())
    keep = {k: f for k, f in index["weight_map"].items()
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    (out / "model").mkdir(parents=True, exist_ok=True)
    (out / "peft" / "adapter").mkdir(parents=True, exist_ok=True)
    for name in set(keep.values()) | {f.name for f in (src / "model").iterdir() if f.name.startswith("tokenizer")}:
        (out / "model" / name).unlink(missing_ok=True)
        (out / "model" / name).symlink_to((src / "model" / name).resolve())
    (out / "model" / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": keep}))
    config = json.loads((src / "model" / "config.json").read_text())
    (out / "model" / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers}))
    adapter = src / "peft" / "adapter"
    factors = load_file(str(adapter / "adapter_model.safetensors"))
    save_file({k: v for k, v in factors.items() if ".layers." not in k or int(k.split(".layers.")[1].split(".")[0]) < layers},
              str(out / "peft" / "adapter" / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out / "peft" / "adapter" / "adapter_config.json").write_bytes((adapter / "adapter_config.json").read_bytes())
    (out / "reference.parquet").unlink(missing_ok=True)
    (out / "reference.parquet").symlink_to((src / "reference.parquet").resolve())
    print(f"wrote {out}/model: the first {layers} layers of {src}/model")


FP8_BLOCK, FP8_MAX = 128, 448.0


def fp8_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] (multiples of FP8_BLOCK) -> float8_e4m3fn [out, in] and float32 weight_scale_inv [out/128, in/128]:
    each block divided by its largest magnitude / 448 (tests/builders.py quantize_fp8_blocks, vectorised)."""
    out, inp = w.shape
    b = FP8_BLOCK
    blocks = w.float().reshape(out // b, b, inp // b, b)  # [out/b, b, in/b, b]
    scale = blocks.abs().amax(dim=(1, 3), keepdim=True).clamp_min(1e-12) / FP8_MAX  # [out/b, 1, in/b, 1]
    q = (blocks / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).reshape(out, inp)
    return q, scale.reshape(out // b, inp // b)


def fp8_layer(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One Qwen3-MoE layer's tensors (transformers 5's names) as a block-FP8 release stores them: the fused experts
    split per expert (gate_up [E, 2I, H]: gate rows first), every projection weight quantized; the rest as given."""
    stored = {}
    for key, w in tensors.items():
        if key.endswith("mlp.experts.gate_up_proj"):
            half = w.shape[1] // 2
            stored.update({f"{key.removesuffix('gate_up_proj')}{e}.{name}.weight": part
                           for e in range(w.shape[0]) for name, part in (("gate_proj", w[e, :half]),
                                                                        ("up_proj", w[e, half:]))})
        elif key.endswith("mlp.experts.down_proj"):
            stored.update({f"{key.removesuffix('down_proj')}{e}.down_proj.weight": w[e] for e in range(w.shape[0])})
        else:
            stored[key] = w
    for key in [k for k, w in stored.items() if k.endswith("proj.weight") and w.ndim == 2]:
        stored[key], stored[key.removesuffix("weight") + "weight_scale_inv"] = fp8_blocks(stored[key])
    return stored


def redraw(name: str, like: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """A fresh tensor of `like`'s shape and dtype on its device, drawn as bench.randomise_weights draws `name`."""
    if like.ndim == 1:
        mean = 1.0 if "norm" in name else 0.0
        return torch.empty_like(like).normal_(mean, 0.1, generator=generator)
    return torch.empty_like(like).normal_(0.0, like.shape[-1] ** -0.5, generator=generator)


if __name__ == "__main__":
    main()
