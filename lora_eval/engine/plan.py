"""`lora-eval plan` and the memory check before a load: how much device memory a model (and its adapters) needs per
GPU, on one GPU, data parallel and expert parallel over N GPUs — from config.json and file headers alone.

Weights are held in the compute dtype (quantized releases are dequantised on load: MXFP4 and block FP8 take as
much as bf16). Per GPU:
  experts      the routed experts' weights (FusedExperts); expert parallel over N: ceil(E / N) of each layer's E
  replicated   everything else (embeddings, attention, routers, shared experts, dense MLPs, norms, lm_head)
  adapters     every adapter tensor in the compute dtype (expert parallel: per-expert factors split like experts)
  activations  the largest layer's working set at `batch_tokens` tokens: attention (q, k, v, output) or the MoE
               (top-k copies of gate_up, activation, down) — whichever is larger — plus the hidden states and the
               64 MiB of logits a batch computes at a time
  graphs       CUDA graphs' memory pool: the activations of the largest captured bucket (16,384 tokens); none under
               expert parallel, which runs eagerly
  prefixes     the shared-prefix cache's bound (EngineOptions.prefix_cache_memory, 2 GiB) where prefixes are reused:
               not under expert parallel, which turns them off
The figures are estimates for deciding what fits; a run records what it really took.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pandas as pd
import torch

from ..adapters.config import AdapterConfig
from ..adapters.load import LORA_KEY, PREFIX, _renamed, non_float_error, read_config
from ..adapters.targets import Sites, resolve_targets
from ..errors import InputError
from ..models import check_folder_vocab, family_and_args
from ..models.checkpoint import TensorFiles, read_json
from ..models.layers import FusedExperts
from ..runners.graphs import BucketPlan
from .engine import DTYPES, LOGITS_BUDGET
from .prefixes import PREFIX_CACHE_BYTES

GB = 1e9
LAYOUTS = ("one GPU", "data parallel", "expert parallel")


def model_parameters(model_dir: str | Path) -> dict:
    """Parameter counts of the model config.json describes (no weights read): total, routed experts, the rest, and
    those active per token (the rest plus top_k of every MoE layer's experts). Where the folder holds weights (a
    plan may come before the download), their headers are read and their vocabulary checked against config.json."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise InputError(model_dir, "model folder not found")
    path = model_dir / "config.json"
    family, args = family_and_args(read_json(path), path)
    check_folder_vocab(model_dir, args)
    with torch.device("meta"):
        model = family.CausalLM(args)
    experts, seen, moe_inter = 0, set(), 0
    for module in model.modules():
        if isinstance(module, FusedExperts):
            moe_inter = max(moe_inter, module.intermediate_size)
            for param in module.parameters():
                experts += param.numel()
                seen.add(id(param))
    rest = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values() if id(p) not in seen)
    active = rest + (experts * args.top_k // args.num_experts if args.num_experts else 0)
    return dict(model_type=args.model_type, total=experts + rest, experts=experts, replicated=rest, active=active,
                num_experts=args.num_experts, top_k=args.top_k, moe_layers=len(args.sparse_layers), args=args,
                moe_intermediate_size=moe_inter, model=model)


def adapter_parameters(adapters: dict[str, str | Path], model=None) -> tuple[int, int]:
    """(expert factors, other factors) over every adapter, from the safetensors headers (every file error an
    InputError naming the file, as when the adapter loads). With `model` (our CausalLM, on the meta device), each
    adapter_config.json is read and resolved against it as every other command does (read_config,
    resolve_targets), and the dense LoRA factors' shapes and ranks are checked from the headers
    (check_adapter_headers)."""
    experts = other = 0
    for folder in adapters.values():
        folder = Path(folder)
        if not folder.is_dir():
            raise InputError(folder, "adapter folder not found")
        config = None
        if model is not None:
            sites = Sites.of(model)
            config = read_config(folder, sites)
            resolve_targets(config, sites)
        path = folder / "adapter_model.safetensors"
        if not (path.exists() or path.is_symlink()):
            if (folder / "adapter_model.bin").is_file():
                continue  # a .bin adapter: counted when it loads
            raise InputError(folder, "adapter weights file missing: expected adapter_model.safetensors (or "
                             "adapter_model.bin)")
        files = TensorFiles([path])
        if config is not None:
            check_adapter_headers(files, path, config, model, sites.renames)
        for key in files.keys():
            n = math.prod(files.shape(key))
            if ".experts" in key:
                experts += n
            else:
                other += n
    return experts, other


def check_adapter_headers(files: TensorFiles, path: Path, config: AdapterConfig, model, renames=()) -> None:
    """Headers only (no tensor read): every tensor floating point, and each dense LoRA pair A [r, in], B [out, r] of
    the model's projection, r the rank adapter_config.json gives it: the refusals the load would make first, by file
    and key. Expert factors (several layouts, told apart by shape) are left to the load."""
    linear = Sites.of(model).linear
    for key in files.keys():
        dtype = files.dtype(key)
        if dtype is None or not dtype.is_floating_point:
            raise non_float_error(path, key, dtype)
        m = LORA_KEY.match(_renamed(key.removeprefix(PREFIX), renames))
        if not m or m["module"] not in linear:
            continue
        lin, shape = linear[m["module"]], files.shape(key)
        param = f"{m['module']}.weight"  # targeted through target_parameters: its patterns are keyed so (as the load)
        as_param = any(param == t or param.endswith(f".{t}") for t in config.target_parameters)
        r = config.rank_and_scaling(param if as_param else m["module"])[0]
        want = (r, lin.in_features) if m["ab"] == "A" else (lin.out_features, r)
        if shape != want:
            raise InputError(path, f"shape {list(shape)}, expected {list(want)} for this model and r={r} in "
                             "adapter_config.json; was the adapter made for another model?", key=key)


def activation_bytes(counts: dict, tokens: int, dtype_bytes: int) -> int:
    """The largest layer's working set at `tokens` tokens, plus hidden states and the logits chunk."""
    args = counts["args"]
    H, heads, kv, head_dim = args.hidden_size, args.num_heads, args.num_kv_heads, args.head_dim
    attention = tokens * (2 * H + (heads + 2 * kv) * head_dim + heads * head_dim)
    moe = tokens * (args.top_k * 3 * counts["moe_intermediate_size"] + H)
    dense = tokens * (3 * getattr(args, "intermediate_size", 0) + H)
    return max(attention, moe, dense) * dtype_bytes + 2 * tokens * H * dtype_bytes + LOGITS_BUDGET * 4


def plan(model_dir: str | Path, adapters: dict[str, str | Path] | None = None, *, gpus: int = 1,
         batch_tokens: int = 4096, dtype: str = "bfloat16", gpu_memory_gb: float | None = None,
         cuda_graphs: bool = True, prefix_cache_bytes: int = PREFIX_CACHE_BYTES) -> tuple[dict, pd.DataFrame]:
    """(the model's parameter counts, one row per layout: per-GPU GB of experts, replicated weights, adapters,
    activations, graphs, the prefix cache's bound, the total, and whether it fits `gpu_memory_gb`)."""
    if dtype not in DTYPES:
        raise InputError("--dtype", f"'{dtype}' is not one of {', '.join(DTYPES)}")
    if gpus < 1:
        raise InputError("--gpus", f"expected an integer >= 1, found {gpus}")
    if gpu_memory_gb is not None and (isinstance(gpu_memory_gb, bool) or not isinstance(gpu_memory_gb, (int, float))
                                      or not math.isfinite(gpu_memory_gb) or gpu_memory_gb <= 0):
        raise InputError("--gpu-memory", f"expected a finite number of GB > 0, found {gpu_memory_gb!r}")
    counts = model_parameters(model_dir)
    size = torch.empty(0, dtype=DTYPES[dtype]).element_size()
    memory = gpu_memory_gb if gpu_memory_gb is not None else default_gpu_memory_gb()
    adapter_experts, adapter_other = adapter_parameters(adapters or {}, counts["model"])
    acts = activation_bytes(counts, batch_tokens, size)
    graphs = activation_bytes(counts, min(batch_tokens, BucketPlan().max_tokens), size) if cuda_graphs else 0
    rows = []
    for layout in LAYOUTS:
        n = gpus if layout != "one GPU" else 1
        if layout != "one GPU" and gpus < 2 or layout == "expert parallel" and not counts["num_experts"]:
            continue
        share = math.ceil(counts["num_experts"] / n) / counts["num_experts"] if layout == "expert parallel" else 1
        parts = dict(experts=counts["experts"] * share * size, replicated=counts["replicated"] * size,
                     adapters=(adapter_experts * share + adapter_other) * size, activations=acts,
                     graphs=0 if layout == "expert parallel" else graphs,  # expert parallel runs eagerly
                     prefixes=0 if layout == "expert parallel" else prefix_cache_bytes)  # and without prefixes
        total = sum(parts.values())
        rows.append(dict(layout=layout, gpus=n, **{f"{k}_gb": v / GB for k, v in parts.items()},
                         per_gpu_gb=total / GB, gpu_memory_gb=memory, fits=total / GB <= memory))
    return counts, pd.DataFrame(rows)


def default_gpu_memory_gb() -> float:
    """The local GPU's memory, or an H100's 80 GB where there is none."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory / GB
    return 80.0


def check_fits(model_dir: str | Path, adapters: dict, device: str, dtype: str, batch_tokens: int,
               expert_ranks: int = 1, prefix_cache_bytes: int = 0) -> None:
    """Refuse (InputError, before anything loads) a run whose weights, adapters and activations cannot fit the
    device: its free GPU memory, or the host's available memory for a CPU run. `expert_ranks`: the ranks an expert
    parallel run spreads the experts over (1: every rank holds them all); `prefix_cache_bytes`: the bound of the
    shared-prefix cache the run may fill (0: it reuses no prefixes)."""
    counts, rows = plan(model_dir, adapters, gpus=expert_ranks, batch_tokens=batch_tokens, dtype=dtype,
                        cuda_graphs=device.startswith("cuda") and expert_ranks == 1,
                        prefix_cache_bytes=prefix_cache_bytes)
    need = float(rows.iloc[-1 if expert_ranks > 1 else 0]["per_gpu_gb"])
    if device.startswith("cuda"):
        free = torch.cuda.mem_get_info(torch.device(device))[0] / GB
        where = f"{free:.1f} GB free on {device}"
    else:
        free = host_memory_available() / GB
        where = f"{free:.1f} GB of host memory available"
    if need > free:
        raise InputError(Path(model_dir) / "config.json", f"{counts['total'] / 1e9:.1f} B parameters need about "
                         f"{need:.1f} GB in {dtype} with --batch-tokens {batch_tokens}, and {where}; see "
                         "`lora-eval plan` for data and expert parallel layouts")


def host_memory_available() -> int:
    """Bytes of host memory available (Linux MemAvailable: free plus reclaimable cache)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def plan_text(counts: dict, rows: pd.DataFrame) -> str:
    """The plan for the terminal."""
    head = (f"{counts['model_type']}: {counts['total'] / 1e9:.2f} B parameters ({counts['experts'] / 1e9:.2f} B in "
            f"routed experts, {counts['num_experts']} per MoE layer in {counts['moe_layers']} layers), "
            f"{counts['active'] / 1e9:.2f} B active per token")
    shown = rows.assign(fits=rows["fits"].map({True: "fits", False: "does not fit"}))
    with pd.option_context("display.width", 200, "display.float_format", "{:.1f}".format):
        text = head + "\n" + shown.to_string(index=False)
    return text

