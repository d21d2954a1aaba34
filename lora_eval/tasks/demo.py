"""`lora-eval demo`: a tiny Qwen3-MoE checkpoint with a tokenizer, two adapters of different expert layouts,
prompts, a trainer reference made by dump-reference, and a full compare — all built on the spot, seeded."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from ..engine.engine import EngineOptions
from ..errors import InputError
from ..hf import quiet_libraries
from .compare import compare
from .dump_reference import dump_reference

DEMO_TEXT = """Mixture-of-experts models route every token to a few experts out of many.
A LoRA adapter adds a low-rank update to each projection it targets, experts included.
The trainer computed logprobs for the tokens it saw; the serving engine must compute the same numbers.
When they differ, on-policy reinforcement learning silently becomes off-policy.
The quick brown fox jumps over the lazy dog while the router picks two experts per token.
Evaluation before shipping an adapter: compare logprobs, check multiple-choice accuracy, keep the report.
"""
PROMPTS = [
    ("What does a router do?", " It sends each token to a few experts."),
    ("Why compare logprobs?", " Because the sampler and the trainer must agree."),
    ("Name a low-rank method.", " LoRA adds B times A to a weight."),
    ("What is top-k routing?", " Each token keeps the k experts with the highest scores."),
    ("The quick brown fox", " jumps over the lazy dog."),
    ("When is an adapter ready?", " When its report passes every threshold."),
]
ADAPTERS = ("peft-all-linear", "tinker-shared-outer")
MARKER = "lora-eval-demo.txt"  # in a folder the demo built (claim_folder)


def build_tokenizer(out: Path, vocab_size: int = 320, texts=None):
    """A byte-level BPE tokenizer trained on `texts` (default: DEMO_TEXT's lines), saved in `out` (covers any
    text)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(DEMO_TEXT.splitlines() if texts is None else texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.save_pretrained(str(out))
    return fast


def build_model(out: Path, vocab_size: int, seed: int = 0) -> Path:
    """A 4-layer Qwen3-MoE (8 experts, top-2) with random weights large enough for peaked distributions."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=512,
                            eos_token_id=0, pad_token_id=0)
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.1 * torch.randn_like(param))
            else:
                param.copy_(torch.randn_like(param) / math.sqrt(param.shape[-1]))
    model.save_pretrained(str(out))
    return out


def build_peft_adapter(model_dir: Path, out: Path, seed: int = 1) -> Path:
    """PEFT `all-linear` (attention + router + experts through target_parameters), random non-zero factors."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(0.3 * torch.randn_like(param) / math.sqrt(param.shape[-1]))
    peft_model.save_pretrained(str(out))
    return out


def build_tinker_adapter(model_dir: Path, out: Path, rank: int = 4, seed: int = 2) -> Path:
    """A Tinker-style export: q/v LoRA plus expert LoRA as 3D w1/w3/w2 with shared outer factors."""
    from safetensors.torch import save_file

    config = json.loads((model_dir / "config.json").read_text())
    H, I, E = config["hidden_size"], config["moe_intermediate_size"], config.get("num_experts",
                                                                             config.get("num_local_experts"))
    q_out = config["num_attention_heads"] * config["head_dim"]
    v_out = config["num_key_value_heads"] * config["head_dim"]
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return 0.3 * torch.randn(*shape, generator=g) / math.sqrt(shape[-1])

    tensors = {}
    for i in range(config["num_hidden_layers"]):
        p = f"base_model.model.model.layers.{i}"
        tensors[f"{p}.self_attn.q_proj.lora_A.weight"] = rand(rank, H)
        tensors[f"{p}.self_attn.q_proj.lora_B.weight"] = rand(q_out, rank)
        tensors[f"{p}.self_attn.v_proj.lora_A.weight"] = rand(rank, H)
        tensors[f"{p}.self_attn.v_proj.lora_B.weight"] = rand(v_out, rank)
        for proj in ("w1", "w3"):  # gate, up: shared A, per-expert B
            tensors[f"{p}.mlp.experts.{proj}.lora_A.weight"] = rand(1, rank, H)
            tensors[f"{p}.mlp.experts.{proj}.lora_B.weight"] = rand(E, I, rank)
        tensors[f"{p}.mlp.experts.w2.lora_A.weight"] = rand(E, rank, I)  # down: per-expert A, shared B
        tensors[f"{p}.mlp.experts.w2.lora_B.weight"] = rand(1, H, rank)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps(dict(
        peft_type="LORA", r=rank, lora_alpha=2 * rank, target_modules="all-linear",
        base_model_name_or_path=str(model_dir)), indent=2))
    return out


def write_prompts(path: Path) -> Path:
    """Every prompt once per adapter and once for the base model; masks cover the responses."""
    lines = []
    for adapter in (None, *ADAPTERS):
        for j, (prompt, response) in enumerate(PROMPTS):
            lines.append(json.dumps(dict(sample_id=f"{adapter or 'base'}-{j}", adapter=adapter, prompt=prompt,
                                         response=response)))
    path.write_text("\n".join(lines) + "\n")
    return path


DEMO_OPTIONS = EngineOptions(dtype="float32")  # the GPU where there is one; float32, as the trainer reference


def claim_folder(out: Path) -> None:
    """`out` as the demo's folder: new, empty, or one an earlier demo made (its MARKER file); anything else is the
    user's, which the demo, rebuilding its model and files there on every run, must not write into."""
    if out.exists() and not out.is_dir():
        raise InputError("--out", f"{out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not (out / MARKER).is_file():
        raise InputError("--out", f"{out} holds files that lora-eval demo did not make (no {MARKER}); the demo "
                         "writes its model, adapters and reports there: choose a new or empty folder")
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text("a folder lora-eval demo built; `lora-eval demo --out` here builds it again\n")


def build_demo(out: str | Path, quiet: bool = False, notice=print) -> tuple[Path, dict[str, Path], Path]:
    """The demo's inputs under `out`: the model folder, its two adapters ({name: folder}) and the trainer reference
    (transformers + PEFT in float32); returns (model folder, adapters, reference file)."""
    out = Path(out)
    claim_folder(out)
    model_dir = out / "model"
    with quiet_libraries():
        tokenizer = build_tokenizer(model_dir)
        build_model(model_dir, vocab_size=len(tokenizer))
        adapters = {ADAPTERS[0]: build_peft_adapter(model_dir, out / "adapters" / ADAPTERS[0]),
                    ADAPTERS[1]: build_tinker_adapter(model_dir, out / "adapters" / ADAPTERS[1])}
    prompts = write_prompts(out / "prompts.jsonl")
    reference = out / "reference.parquet"
    dump_reference(model_dir, adapters, prompts, reference, options=EngineOptions(dtype="float32"), quiet=quiet,
                   overwrite=True, notice=notice)  # (the demo's own file, rebuilt with its inputs on every run)
    return model_dir, adapters, reference


def run_demo(out: str | Path, quiet: bool = False, options: EngineOptions = DEMO_OPTIONS, notice=print):
    """Build the demo's inputs under `out` (`build_demo`) and run compare as `options` say (by default float32 on
    this machine's GPU, or its CPU: the tiny random demo model's peaked distributions move by more than the default
    k2 threshold in bfloat16 — k2 > 5e-3 for the shared-outer adapter on an H100); returns the CompareResult."""
    model_dir, adapters, reference = build_demo(out, quiet, notice)
    return compare(model_dir, adapters, [reference], out=Path(out) / "report", options=options, quiet=quiet,
                   overwrite=True, notice=notice)  # (the demo's own run: computed again, as its inputs are)
