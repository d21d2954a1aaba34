"""`lora-eval bench`: our engine against transformers + PEFT on a random-weight model of a real config's shape.

One run builds one transformers model from the config (random weights, made directly on the device) and our
model over the very same weight tensors (`load_model_from_tensors`: no second copy, so a 61 GB Qwen3-30B-A3B fits
once). Adapters are made by PEFT on the transformers model (rank r, random A and B), saved, and read back by our
loader, so both systems run the same adapters on the same batches. Cases, per batch shape:

  base          ours: an engine without adapters; hf: the plain transformers model
  lora-1        every row under the first adapter
  lora-{k}-mixed  row i under adapter i % k (k = min(adapters, rows); only when k >= 2). Ours: one batch. PEFT
                cannot mix adapters in one forward when experts are adapted (its ParamWrapper refuses
                `adapter_names`), so the hf time is the sum of one pass per adapter over that adapter's rows —
                what a user has to do; with attention-only targets PEFT runs one mixed pass (`adapter_names`).
  no-lora-rows  adapters loaded, every row base. hf: the PEFT model under `disable_adapter()`.

Each case: warm-up calls, then `repeat` timed calls (synchronised), the median. Our engine's cases are timed
interleaved, one call of each case per round (`measure_interleaved`), so that a drift of the GPU's clocks during the
run does not land on one case: their ratios to our base come from the same minutes. A call is the whole job: token
lists in, float32 logprobs of every next token on the CPU out (hf: forward, log_softmax over the vocabulary,
gather). FLOPs count useful work only, the same for both systems: 2 x active matmul parameters per token (attention
and MLP projections, the router, top-k experts, lm_head; the embedding lookup is free) x tokens, plus the adapter's
active parameters on adapter rows, plus causal attention 2 x 2 x n(n+1)/2 x heads x head_dim per attention layer per
row, plus per linear-attention (Gated DeltaNet) layer and token its short convolution (2 x width x channels) and the
delta rule's three products with the K x V state per value head (2 x 3 x K x V x heads).
Every ours row carries the largest |ours - hf| logprob difference on the same batch (like for like).
A config's quantization_config is not applied (`unquantized`: random weights in the compute dtype, said in the note
column); `small_config` scales a config's widths down for the tests, which run every published config through here.
A vision-language config (Qwen3.5's `qwen3_5_moe`) keeps its language model under `text_config`: that is what is cut,
scaled and benchmarked; transformers builds it as its text model (AutoModelForCausalLM: Qwen3_5MoeForCausalLM), the
vision tower takes no part in scoring text.
"""

from __future__ import annotations

import gc
import platform
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch

from ..adapters import load_adapter
from ..engine.engine import DTYPES, Batch, Engine
from ..errors import InputError, UnsupportedError
from ..hf import quiet_libraries
from ..inputs.references import write_reference
from ..models import family_and_args, load_model_from_tensors
from ..models.checkpoint import read_json
from ..models.layers import FusedExperts, Linear
from ..models.quantized import KEY as QUANTIZATION_KEY
from ..models.quantized import read_quantization
from ..progress import progress

TARGETS = ("all", "attn", "experts")
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
# expert stacks and routers named in target_parameters (those the model has: gpt-oss calls its router mlp.router)
EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight", "mlp.router.weight"]
ADAPTER_STRENGTH = 0.2  # RMS of a LoRA delta relative to the RMS of the weight it adapts
# small_config: test sizes of the width keys a config has (2I != H and I != H: a swapped or transposed expert factor
# cannot pass by coincidence; v_head_dim != qk head dims; a sliding window shorter than a test's rows)
SMALL_SIZES = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=24, num_attention_heads=4, head_dim=16,
                   vocab_size=128, num_experts=8, num_local_experts=8, n_routed_experts=8, num_experts_per_tok=2,
                   experts_per_token=2, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
                   v_head_dim=16, sliding_window=8, shared_expert_intermediate_size=48,
                   # Gated DeltaNet: 2 key heads serving 4 value heads (the releases' 1:2 grouping), K != V
                   linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8)
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")  # ids into the real vocabulary
NOTE_SEPARATOR = " | "  # between the notes of one row (the model's, the case's); the CLI prints each once


def random_reference(path: str | Path, samples: int, vocab: int, seed: int, lengths=(128, 2048)) -> Path:
    """A reference dump of `samples` random samples (lengths in `lengths`, half under an adapter named "adapter",
    random logprobs) for timing runs: what they measure is speed, not agreement."""
    generator = torch.Generator().manual_seed(seed)
    sizes = torch.randint(lengths[0], lengths[1] + 1, (samples,), generator=generator).tolist()
    ids = [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in sizes]
    frame = pd.DataFrame(dict(sample_id=[f"s{i}" for i in range(samples)],
                              adapter=["adapter" if i % 2 else None for i in range(samples)], input_ids=ids,
                              logprobs=[(-10 * torch.rand(n - 1, generator=generator)).tolist() for n in sizes]))
    return write_reference(frame, path)


def parse_batch(text: str) -> tuple[int, int]:
    """'4x1024' -> (4 rows, 1024 tokens each)."""
    rows, sep, length = text.lower().partition("x")
    if not sep or not rows.isdigit() or not length.isdigit() or int(rows) < 1 or int(length) < 2:
        raise InputError("--batch", f"expected ROWSxTOKENS with rows >= 1 and tokens >= 2 (e.g. 4x1024), "
                         f"found '{text}'")
    return int(rows), int(length)


def text_config(config: dict) -> dict:
    """The part of `config` that describes the language model: its `text_config` where it nests one (a
    vision-language wrapper such as Qwen3.5's), else `config` itself. Edits to it are edits to `config`."""
    nested = config.get("text_config")
    return nested if isinstance(nested, dict) else config


def read_model_config(path: str | Path, layers: int | None = None) -> dict:
    """config.json of a published model, cut to its first `layers` decoder layers (the per-layer lists with them, so a
    hybrid keeps its pattern: Qwen3.5's layer_types; Qwen3-Next derives its own from full_attention_interval)."""
    path = Path(path)
    config = read_json(path)
    if not isinstance(config.get("model_type"), str):
        raise InputError(path, f"expected the model's architecture name, found {config.get('model_type')!r}",
                         key="model_type")
    text = text_config(config)
    total = text.get("num_hidden_layers")
    if not isinstance(total, int) or total < 1:
        raise InputError(path, f"expected a positive integer, found {total!r}",
                         key="num_hidden_layers" if text is config else "text_config.num_hidden_layers")
    if layers is not None:
        if not 1 <= layers <= total:
            raise InputError("--layers", f"{layers} is not within 1..{total} (the config's num_hidden_layers)")
        text["num_hidden_layers"] = layers
        if isinstance(text.get("mlp_only_layers"), list):
            text["mlp_only_layers"] = [i for i in text["mlp_only_layers"] if isinstance(i, int) and i < layers]
        if isinstance(text.get("layer_types"), list):
            text["layer_types"] = text["layer_types"][:layers]
        if isinstance(text.get("first_k_dense_replace"), int):  # (DeepSeek-V3's 3 dense layers, cut to 2: both)
            text["first_k_dense_replace"] = min(text["first_k_dense_replace"], layers)
    family_and_args(config, path)  # our own checks (family, sizes) before transformers sees the config
    return config


def small_config(config: dict) -> dict:
    """`config` at test widths: each SMALL_SIZES key it sets (not null) takes that size, key/value heads 2 (or as
    many as the attention heads where the config has equal counts: MLA), router groups at most 4 of which 2 are kept,
    token ids dropped. Family, layer pattern (dense first layers, layer_types), rope and routing rules stay, so bench runs
    it on the code path of the full-size config, in seconds on a CPU (tests/test_bench.py does, for every config in
    benchmarks/configs/). A nested language model (`text_config`) is scaled where it is; the rest of a
    vision-language config (its vision tower's) stays as published: bench builds the text model alone."""
    text = text_config(config)
    small = {**text, **{key: size for key, size in SMALL_SIZES.items() if text.get(key) is not None}}  # (null stays)
    if "num_key_value_heads" in text:
        equal = text["num_key_value_heads"] == text.get("num_attention_heads")
        small["num_key_value_heads"] = small["num_attention_heads"] if equal else 2
    if "n_group" in text:
        small["n_group"] = min(text["n_group"], 4)  # 8 experts: groups of 2 or more
        small["topk_group"] = min(text.get("topk_group", 1), 2)
    outer = {key: value for key, value in config.items() if key not in TOKEN_IDS}
    for key in TOKEN_IDS:
        small.pop(key, None)
    return small if text is config else {**outer, "text_config": small}


def unquantized(config: dict, where, dtype: str) -> tuple[dict, str]:
    """(config without its quantization_config, a note saying so; "" when it has none). bench's weights are random,
    drawn in the compute dtype at the unquantized shapes: lora-eval dequantises an mxfp4 / fp8 release to that
    dtype on load anyway, so ours runs as on the release; transformers' quantized kernels are not timed. A method we
    do not compute is refused by name (read_quantization)."""
    quant = read_quantization(config, where)
    if quant is None:
        return config, ""
    scheme = quant.method + (f" block {quant.block[0]}x{quant.block[1]}" if quant.block else "")
    note = (f"{QUANTIZATION_KEY} ({scheme}) not applied: both systems run random {dtype} weights of the same shapes "
            f"(lora-eval dequantises a {quant.method} release to the compute dtype on load; transformers' "
            f"{quant.method} kernels are not timed)")
    return {key: value for key, value in config.items() if key != QUANTIZATION_KEY}, note


def random_hf_model(config: dict, dtype: torch.dtype, device: torch.device, seed: int):
    """The transformers model of `config` (AutoModelForCausalLM: of a vision-language config, its text model), built
    on `device` in `dtype`, with random weights drawn there."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.for_model(**config)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    randomise_weights(model, seed)
    return model.eval()


@torch.no_grad()
def randomise_weights(model, seed: int) -> None:
    """Norm weights ~ 1 + 0.1 N (a zero-centred norm's, which computes x * (1 + w), ~ 0.1 N: the same scale), the
    embedding ~ N(0, 1), biases ~ 0.1 N, every matrix (and 3D expert stack) ~ N(0, 1/fan_in): activations keep their
    scale through the layers, routing is spread over the experts. A norm is zero-centred where transformers
    initialised its weight to zeros (Qwen3-Next's and Qwen3.5's, all but Gated DeltaNet's gated norm)."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():
        if param.ndim == 1:
            unit = "norm" in name and bool(param.any())
            param.normal_(1.0 if unit else 0.0, 0.1, generator=generator)
        elif "embed_tokens" in name:
            param.normal_(0.0, 1.0, generator=generator)
        else:
            param.normal_(0.0, param.shape[-1] ** -0.5, generator=generator)


def peft_config(targets: str, rank: int, explicit: tuple[str, ...] = ()):
    """The LoraConfig of `targets`. PEFT resolves "all-linear" and the MLP names to its own expert
    target_parameters (gate_up at rank 2r: gate and up are each a rank-r projection); `explicit` names the
    expert parameters directly (one rank-r gate_up) beside all-linear, the fallback for PEFT versions and families
    where it does not (PEFT 0.21: gpt-oss, Qwen3.5)."""
    from peft import LoraConfig

    if targets == "attn":
        return LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=ATTENTION)
    if explicit:
        return LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear" if targets == "all" else [],
                          target_parameters=list(explicit))
    if targets == "all":
        return LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear")
    return LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["gate_proj", "up_proj", "down_proj", "gate"])


def make_peft_adapters(hf_model, names: list[str], rank: int, targets: str, seed: int):
    """PEFT adapters `names` on `hf_model` (bf16 stays bf16: autocast_adapter_dtype=False), every A and B drawn
    at random. Returns (PeftModel, note): the note says when the experts had to be named explicitly."""
    from peft import __version__ as peft_version
    from peft import get_peft_model

    # the plain model's parameter names, read before PEFT wraps its modules in place (base_layer, lora_A, ...)
    params = [name for name, _ in hf_model.named_parameters()]
    wants_experts = targets != "attn" and any(name.endswith("experts.gate_up_proj") for name in params)
    explicit, note = (), ""
    try:
        model = get_peft_model(hf_model, peft_config(targets, rank), adapter_name=names[0],
                               autocast_adapter_dtype=False)
    except ValueError:  # the MLP names matched a router that is no Linear (PEFT 0.21, Qwen3.5): named below
        if not wants_experts:
            raise
        model = None
    if wants_experts and (model is None or not _wrapped_experts(model)):  # PEFT left the experts: name them
        explicit = tuple(p for p in EXPERT_PARAMETERS if any(name.endswith(p) for name in params))
        note = f"PEFT {peft_version} did not resolve the experts from target_modules; the adapters name them in " \
               "target_parameters (gate_up at rank r)"
        try:
            model = get_peft_model(hf_model if model is None else model.unload(), peft_config(targets, rank, explicit),
                                   adapter_name=names[0], autocast_adapter_dtype=False)
        except (ValueError, TypeError, RuntimeError) as e:
            raise UnsupportedError("--targets", f"PEFT {peft_version} cannot wrap this model's experts with "
                                   f"target_parameters ({str(e).splitlines()[0]})") from None
        if not _wrapped_experts(model):
            raise UnsupportedError("--targets", f"PEFT {peft_version} does not wrap this model's experts")
    for name in names[1:]:  # a fresh config each: PEFT resolves target names into the one it is given
        model.add_adapter(name, peft_config(targets, rank, explicit), autocast_adapter_dtype=False)
    for name in names:
        # PEFT's renaming for transformers 5 adds the expert parameters to target_parameters by model type, experts
        # or not (DeepSeek-V3 cut to its dense first layers): the saved config keeps the entries that match a
        # parameter (the name or a suffix after a dot, as PEFT and our loader match), as our loader refuses others
        config = model.peft_config[name]
        if config.target_parameters:
            config.target_parameters = [entry for entry in sorted(config.target_parameters)
                                        if any(p == entry or p.endswith(f".{entry}") for p in params)] or None
    randomise_adapters(model, names, seed)
    return model.eval(), note


def _wrapped_experts(peft_model) -> bool:
    from peft.tuners.lora import ParamWrapper

    return any(isinstance(m, ParamWrapper) and m.parameter_name in ("gate_up_proj", "down_proj")
               for m in peft_model.modules())


@torch.no_grad()
def randomise_adapters(peft_model, names: list[str], seed: int) -> None:
    """A ~ N(0, 1/in) and B ~ N(0, (ADAPTER_STRENGTH / scaling)^2 / r), so each delta s * B @ A has about
    ADAPTER_STRENGTH of the RMS of a weight drawn by randomise_weights (PEFT's own init leaves B zero)."""
    from peft.tuners.lora import LoraLayer

    device = next(peft_model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed + 1)
    for module in peft_model.modules():
        if not isinstance(module, LoraLayer):
            continue
        for name in names:
            if name not in module.lora_A:
                continue
            A, B = module.lora_A[name].weight, module.lora_B[name].weight  # [r(*E), in], [out, r(*E)]
            A.normal_(0.0, A.shape[-1] ** -0.5, generator=generator)
            B.normal_(0.0, ADAPTER_STRENGTH / (module.scaling[name] * module.r[name] ** 0.5), generator=generator)


@torch.inference_mode()
def hf_logprobs(model, input_ids: list[list[int]], device: torch.device, **forward_kwargs) -> torch.Tensor:
    """transformers' float32 logprobs [B, L-1] of every next token of equal-length rows, on the CPU."""
    ids = torch.tensor(input_ids, device=device)  # [B, L]
    logits = model(input_ids=ids, use_cache=False, **forward_kwargs).logits[:, :-1]  # [B, L-1, V]
    logp = torch.log_softmax(logits.float(), dim=-1)  # [B, L-1, V]
    return logp.gather(-1, ids[:, 1:, None]).squeeze(-1).cpu()  # [B, L-1]


def active_params(model) -> int:
    """Matmul weights one token goes through in our model: every Linear (router and lm_head included) and the
    top-k experts of each MoE layer."""
    count = 0
    for module in model.modules():
        if isinstance(module, Linear):
            count += module.weight.numel()
        elif isinstance(module, FusedExperts):
            count += model.args.top_k * (module.gate_up_proj[0].numel() + module.down_proj[0].numel())
    return count


def adapter_active_params(adapter, top_k: int) -> int:
    """LoRA factor entries one adapter token goes through: dense A and B, and both factors of its top-k experts."""
    count = sum(A.numel() + B.numel() for A, B in adapter.dense.values())
    for factors in adapter.experts.values():
        for part in (factors.gate_up, factors.down):
            if part is not None:
                count += top_k * (part[0][0].numel() + part[1][0].numel())
    return count


def attention_flops(args, lengths: list[int]) -> int:
    """Token mixing. Causal attention (QK^T and PV): 2 matmuls x 2 FLOPs x n(n+1)/2 pairs x heads x head_dim, per
    attention layer per row. A hybrid's linear-attention layers (Gated DeltaNet), per token: the depthwise causal
    conv, 2 x width x channels, and the delta rule's three products with the [K, V] state of each value head
    (k^T S, the rank-one update, q^T S), 2 x 3 x K x V x heads."""
    types = getattr(args, "layer_types", ()) or ()
    linear = sum(t == "linear_attention" for t in types)
    flops = sum(4 * n * (n + 1) // 2 * args.num_heads * args.head_dim * (args.num_layers - linear) for n in lengths)
    if linear:
        channels = 2 * args.linear_num_key_heads * args.linear_key_head_dim \
            + args.linear_num_value_heads * args.linear_value_head_dim
        per_token = 2 * args.conv_kernel * channels \
            + 6 * args.linear_key_head_dim * args.linear_value_head_dim * args.linear_num_value_heads
        flops += per_token * linear * sum(lengths)
    return flops


@dataclass
class Timing:
    seconds: float = float("nan")  # median of the timed calls
    output: torch.Tensor | None = None  # logprobs [B, L-1] of the last call
    peak_gb: float = float("nan")
    resident_gb: float = float("nan")
    status: str = "ok"
    note: str = ""


def measure(call, device: torch.device, warmup: int, repeat: int) -> Timing:
    """Warm-up calls, then `repeat` synchronised timed calls: the median, the last output, the peak memory of
    the whole phase (CUDA only; NaN on the CPU). Running out of device memory is recorded, not raised."""
    timings = warm_up({None: call}, device, warmup)
    try:
        time_interleaved({None: call}, timings, device, repeat)
    except torch.OutOfMemoryError as e:
        timings[None].output, timings[None].status = None, f"oom: {str(e).splitlines()[0][:160]}"
        free_memory(device)
    if device.type == "cuda":
        timings[None].peak_gb = torch.cuda.max_memory_allocated(device) / 1e9  # warm-up and timed calls
    return timings[None]


def warm_up(calls: dict, device: torch.device, warmup: int) -> dict:
    """The warm-up calls of each of several calls, with the peak memory each reaches: {key: Timing}. A call
    that runs out of memory is recorded (status) and timed no further."""
    cuda = device.type == "cuda"
    timings = {}
    for key, call in calls.items():
        timing = timings[key] = Timing()
        if cuda:
            torch.cuda.synchronize(device)
            timing.resident_gb = torch.cuda.memory_allocated(device) / 1e9
            torch.cuda.reset_peak_memory_stats(device)
        try:
            for _ in range(warmup):
                call()
            if cuda:
                timing.peak_gb = torch.cuda.max_memory_allocated(device) / 1e9
        except torch.OutOfMemoryError as e:
            timing.status = f"oom: {str(e).splitlines()[0][:160]}"
            free_memory(device)
    return timings


def time_interleaved(calls: dict, timings: dict, device: torch.device, repeat: int, stats=None) -> None:
    """`repeat` rounds of one synchronised timed call of each (warmed-up, not out-of-memory) call; per key the
    median into timings[key].seconds. `stats(key)` (optional): the graph runner's counters behind that call, for a
    note of what it did. Interleaving puts a drift of the GPU's clocks on every case alike."""
    cuda = device.type == "cuda"
    keys = [key for key in calls if timings[key].status == "ok"]
    times = {key: [] for key in keys}
    counts = {key: dict(replays=0, eager_batches=0) for key in keys}
    for _ in range(repeat):
        for key in keys:
            before = stats(key) if stats is not None else {}
            if cuda:
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            timings[key].output = calls[key]()
            if cuda:
                torch.cuda.synchronize(device)
            times[key].append(time.perf_counter() - start)
            after = stats(key) if stats is not None else {}
            for name in counts[key]:
                counts[key][name] += after.get(name, 0) - before.get(name, 0)
            if after:
                timings[key].note = (f"graphs: {counts[key]['replays']} replayed, {counts[key]['eager_batches']} "
                                     f"eager, pool {after.get('graph_memory_bytes', 0) / 1e9:.2f} GB")
    for key in keys:
        timings[key].seconds = statistics.median(times[key])


def free_memory(device: torch.device) -> None:
    """Hand cached device memory back between phases (the next phase's peak is its own)."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


@dataclass
class Cases:
    """What every system times: the cases, (batch label, case label, row adapters), and each batch's token rows; and
    how: the device, warm-up and timed calls per case, the progress bar (a step per case timed)."""
    plan: list[tuple[str, str, list]]
    token_rows: dict[str, list[list[int]]]
    device: torch.device
    warmup: int
    repeat: int
    bar: object


def bench(config_path: str | Path, *, layers: int | None = None, adapters: int = 4, rank: int = 16,
          targets: str = "all", batches: tuple[str, ...] = ("4x1024",), dtype: str = "bfloat16",
          device: str = "cuda", repeat: int = 5, warmup: int = 2, skip_hf: bool = False, also_eager: bool = False,
          also_invariant: bool = False, backend: str | None = None, seed: int = 0,
          quiet: bool = False) -> pd.DataFrame:
    """One row per (system, batch, case): ms_per_batch, tokens_per_s, tflops, peak_mem_gb, ratios and the
    logprob difference to transformers + PEFT. Systems: `ours`, `hf` (unless `skip_hf`), `ours-eager` (with
    `also_eager`: our engine with CUDA graphs off), `ours-invariant` (with `also_invariant`: our engine in its
    batch-invariant mode, EngineOptions.batch_invariant; its cost_vs_base is over its own base, and the cost of the
    mode is its ms_per_batch over ours')."""
    check_options(dtype, targets, adapters, rank, repeat, warmup, device)
    shapes = [parse_batch(b) for b in batches]
    config, model_notes = bench_config(config_path, layers, targets, dtype)
    dev, torch_dtype = torch.device(device), DTYPES[dtype]
    names = [f"a{i}" for i in range(adapters)]
    plan = case_plan(shapes, names)
    generator = torch.Generator().manual_seed(seed)
    vocab = text_config(config)["vocab_size"]
    token_rows = {f"{r}x{n}": torch.randint(0, vocab, (r, n), generator=generator).tolist() for r, n in shapes}
    systems = (["ours"] + (["ours-eager"] if also_eager else []) + (["ours-invariant"] if also_invariant else [])
               + ([] if skip_hf else ["hf"]))
    bar = progress(len(plan) * len(systems), "bench", "case", quiet)
    cases = Cases(plan, token_rows, dev, warmup, repeat, bar)

    with quiet_libraries(), bar, tempfile.TemporaryDirectory(prefix="lora-eval-bench-") as tmp:
        hf = random_hf_model(config, torch_dtype, dev, seed)
        ours_model = load_model_from_tensors(config, hf.state_dict(), torch_dtype, dev, where=str(config_path))
        env = dict(hf_experts=getattr(hf.config, "_experts_implementation", None),
                   hf_attention=getattr(hf.config, "_attn_implementation", None))
        results, passes, note = time_transformers(hf, cases, "hf" in systems, names, rank, targets, seed, tmp)
        del hf  # (PEFT's adapters are in it)
        free_memory(dev)
        timings, loaded = time_ours(ours_model, cases, [s for s in systems if s != "hf"], names, tmp, backend)
        results.update(timings)
        bar.close()

    lora_params = adapter_active_params(loaded[0], ours_model.args.top_k)
    frame = _frame(plan, systems, results, passes, token_rows, ours_model, lora_params, note,
                   NOTE_SEPARATOR.join(n for n in model_notes if n))
    meta = dict(model=Path(config_path).stem, layers=text_config(config)["num_hidden_layers"], adapters=adapters,
                rank=rank, targets=targets, dtype=dtype, device=dev.type, device_name=_device_name(dev), **env,
                **_versions(), warmup=warmup, repeat=repeat)
    for key, value in meta.items():
        frame[key] = value
    return frame


def check_options(dtype: str, targets: str, adapters: int, rank: int, repeat: int, warmup: int, device: str) -> None:
    """bench's options, each refused by name (the API takes what the command line's types would refuse)."""
    if dtype not in DTYPES:
        raise InputError("--dtype", f"'{dtype}' is not one of {', '.join(DTYPES)}")
    if targets not in TARGETS:
        raise InputError("--targets", f"'{targets}' is not one of {', '.join(TARGETS)}")
    if adapters < 1 or rank < 1 or repeat < 1 or warmup < 0:
        raise InputError("bench", "adapters, rank and repeat must be >= 1, warmup >= 0")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise InputError("--device", "CUDA was asked for but torch sees no GPU")


def bench_config(config_path: str | Path, layers: int | None, targets: str, dtype: str) -> tuple[dict, list[str]]:
    """The config benchmarked (its first `layers` layers; a quantized one in the compute dtype) and notes on the
    model built from it for the table."""
    config = read_model_config(config_path, layers)
    kept = text_config(config)["num_hidden_layers"]
    model_notes = []
    if not family_and_args(config, config_path)[1].sparse_layers:
        if targets == "experts":
            raise InputError("--targets", f"'experts' needs a model with MoE layers; {config_path} describes none in "
                             f"its first {kept} layers")
        moe = family_and_args(read_model_config(config_path), config_path)[1].sparse_layers
        if moe:  # e.g. DeepSeek-V3's first 3 layers are dense: a user asking for 2 would time no expert
            model_notes.append(f"--layers {kept} keeps no MoE layer (the first is layer "
                               f"{moe[0]}): dense layers only; --layers {moe[0] + 1} keeps one")
    config, quant_note = unquantized(config, config_path, dtype)
    return config, [*model_notes, quant_note]


def case_plan(shapes: list[tuple[int, int]], names: list[str]) -> list[tuple[str, str, list]]:
    """(batch label, case label, row adapters) of every case of every batch shape (see the module notes)."""
    plan = []
    for rows, length in shapes:
        label = f"{rows}x{length}"
        k = min(len(names), rows)
        plan += [(label, "base", [None] * rows), (label, "lora-1", [names[0]] * rows)]
        if k >= 2:
            plan.append((label, f"lora-{k}-mixed", [names[i % k] for i in range(rows)]))
        plan.append((label, "no-lora-rows", [None] * rows))
    return plan


def time_transformers(hf, cases: Cases, timed: bool, names: list[str], rank: int, targets: str, seed: int,
                      out: str) -> tuple[dict, dict, str]:
    """Adapters made by PEFT on the transformers model `hf` and saved in `out` (our engine reads them from there);
    with `timed`, the hf cases timed: the base model's first, then the adapters', while only PEFT holds adapters on
    the device -> ({("hf", batch, case): Timing}, {(batch, case): forward passes}, how PEFT made the adapters)."""
    results, passes = {}, {}
    if timed:
        for batch, case, _ in cases.plan:
            if case == "base":
                results["hf", batch, "base"] = measure(
                    lambda model=hf, rows=cases.token_rows[batch]: hf_logprobs(model, rows, cases.device),
                    cases.device, cases.warmup, cases.repeat)
                cases.bar.update(1)
    peft_model, note = make_peft_adapters(hf, names, rank, targets, seed)
    peft_model.save_pretrained(out)
    if timed:
        from peft.tuners.lora import ParamWrapper

        one_pass = not any(isinstance(m, ParamWrapper) for m in peft_model.modules())
        for batch, case, tags in cases.plan:
            if case == "base":
                continue
            call, passes[batch, case] = _hf_call(peft_model, cases.token_rows[batch], tags, case, one_pass,
                                                 cases.device)
            results["hf", batch, case] = measure(call, cases.device, cases.warmup, cases.repeat)
            cases.bar.update(1)
    return results, passes, note


def time_ours(model, cases: Cases, systems: list[str], names: list[str], adapters_dir: str,
              backend: str | None) -> tuple[dict, list]:
    """Our engine, per system of `systems`: the base cases warmed up first (their peak memory without adapters),
    then the adapters read back from PEFT's files in `adapters_dir`; per system its other cases warmed up, then all
    its cases timed interleaved -> ({(system, batch, case): Timing}, the adapters loaded)."""
    dev, warmup, token_rows = cases.device, cases.warmup, cases.token_rows
    settings = {system: dict(backend=backend, cuda_graphs=system != "ours-eager",
                             batch_invariant=system == "ours-invariant") for system in systems}
    base_engines = {system: Engine(model, [], **settings[system]) for system in systems}
    base_calls = {(system, batch, case): (lambda engine=base_engines[system], rows=token_rows[batch]:
                                          torch.stack(engine.logprobs(Batch(rows, [None] * len(rows)))))
                  for system in systems for batch, case, _ in cases.plan if case == "base"}
    timings = warm_up(base_calls, dev, warmup)
    loaded = [load_adapter(Path(adapters_dir) / name, name, model) for name in names]
    for system in systems:
        engine = Engine(model, loaded, **settings[system])
        calls = {(system, batch, case): (lambda rows=token_rows[batch], tags=tags:
                                         torch.stack(engine.logprobs(Batch(rows, tags))))
                 for batch, case, tags in cases.plan if case != "base"}
        timings.update(warm_up(calls, dev, warmup))
        calls.update({key: call for key, call in base_calls.items() if key[0] == system})
        time_interleaved(calls, timings, dev, cases.repeat,
                         stats=lambda key: _graph_stats(base_engines[system] if key[2] == "base" else engine))
        cases.bar.update(len(calls))
        del engine, calls
        free_memory(dev)
    del base_engines, base_calls
    free_memory(dev)
    return timings, loaded


def _hf_call(peft_model, rows, tags, case, one_pass: bool, device):
    """(the call that runs one case on transformers + PEFT, how many forward passes it takes)."""
    if case == "no-lora-rows":
        def call():
            with peft_model.disable_adapter():
                return hf_logprobs(peft_model, rows, device)
        return call, 1
    used = list(dict.fromkeys(tags))
    if len(used) == 1:
        peft_model.set_adapter(used[0])
        return lambda: hf_logprobs(peft_model, rows, device), 1
    if one_pass:  # attention-only adapters: PEFT mixes adapters in one forward
        return lambda: hf_logprobs(peft_model, rows, device, adapter_names=list(tags)), 1

    def call():  # one pass per adapter over that adapter's rows, reassembled in row order
        out = torch.empty(len(rows), len(rows[0]) - 1)  # [B, L-1]
        for name in used:
            picked = [i for i, t in enumerate(tags) if t == name]
            peft_model.set_adapter(name)
            out[picked] = hf_logprobs(peft_model, [rows[i] for i in picked], device)
        return out
    return call, len(used)


def _frame(plan, systems, results, passes, token_rows, model, lora_params, note, model_note="") -> pd.DataFrame:
    """The table; `note`: the hf rows' (how PEFT made the adapters), `model_note`: every row's (the model built)."""
    base_params = active_params(model)
    records = []
    for system in systems:
        for batch, case, tags in plan:
            timing = results[system, batch, case]
            rows = token_rows[batch]
            lengths = [len(r) for r in rows]
            tokens = sum(lengths)
            adapter_tokens = sum(n for n, t in zip(lengths, tags) if t is not None)
            flops = 2 * base_params * tokens + attention_flops(model.args, lengths) + 2 * lora_params * adapter_tokens
            hf = results.get(("hf", batch, case))
            diff = (timing.output - hf.output).abs() if system != "hf" and hf is not None and \
                hf.output is not None and timing.output is not None else None
            records.append(dict(
                system=system, batch=batch, case=case, rows=len(rows), seq_len=lengths[0], tokens=tokens,
                adapters_in_batch=len({t for t in tags if t is not None}),
                passes=passes.get((batch, case), 1) if system == "hf" else 1,
                ms_per_batch=timing.seconds * 1e3, tokens_per_s=tokens / timing.seconds,
                tflops=flops / timing.seconds / 1e12, peak_mem_gb=timing.peak_gb, resident_gb=timing.resident_gb,
                max_abs_diff=float(diff.max()) if diff is not None else float("nan"),
                mean_abs_diff=float(diff.mean()) if diff is not None else float("nan"),
                status=timing.status,
                note=NOTE_SEPARATOR.join(n for n in (model_note, note if system == "hf" else timing.note) if n)))
    frame = pd.DataFrame(records)
    base = frame[frame["case"] == "base"].set_index(["system", "batch"])["ms_per_batch"]
    frame["cost_vs_base"] = frame["ms_per_batch"] / [base[s, b] for s, b in zip(frame["system"], frame["batch"])]
    hf_speed = frame[frame["system"] == "hf"].set_index(["batch", "case"])["tokens_per_s"]
    frame["vs_hf"] = [tps / hf_speed[b, c] if s != "hf" and (b, c) in hf_speed.index else float("nan")
                      for s, b, c, tps in zip(frame["system"], frame["batch"], frame["case"], frame["tokens_per_s"])]
    return frame


def _graph_stats(engine) -> dict:
    stats = getattr(engine, "graph_stats", None)
    return (stats() if stats is not None else None) or {}


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or "cpu"


def _versions() -> dict:
    import peft
    import transformers

    return dict(torch=torch.__version__, transformers=transformers.__version__, peft=peft.__version__)
