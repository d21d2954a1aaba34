"""One PEFT adapter folder -> an Adapter: every LoRA factor checked against our model and brought into one form.

Dense targets become (A [r, in], B [out, r]); each MoE layer's experts become gate_up (A [Ea, R, H],
B [Eb, 2I, R]) and down (A [Ea, r, I], B [Eb, H, r]) with an expert dim Ea/Eb of 1 (shared by all experts)
or E. Separate gate and up factors are joined block-diagonally (A rows stacked, B block-diagonal), so one
shrink and one expand serve both. The adapter's scaling is folded into every B.

Expert layouts read (keys after `base_model.model.`, `{x}` = `model.layers.{i}.mlp.experts`):
  per-expert 2D    {x}.{e}.gate_proj|up_proj|down_proj|w1|w3|w2.lora_A/B.weight       A [r, in], B [out, r]
  fused / split 3D {x}.gate_up_proj|down_proj|w1|w3|w2.lora_A/B.weight                A [E|1, r, in], B [E|1, out, r]
  target_parameters (PEFT ParamWrapper; gate_up inner, down outer; told apart by shape)
                   {x}.base_layer.lora_A.weight [r*E, H] (expert-major), lora_B [2I, r*E] (rank-major)
                   {x}.lora_A.weight [r*E, I], {x}.lora_B.weight [H, r*E]
                   or, as PEFT 0.17-0.19.0 and Megatron-Bridge wrote them, swapped (A on the output side), and with
                   Unsloth's or Bridge's expert-major B: the writer decides (writers.py; Adapter.decisions says how)
Split projections: LoRA on parts of a projection the checkpoint fuses (Tinker's Qwen3.5 `linear_attn.in_proj_q`,
`in_proj_k`, `in_proj_v`, each A [r, H], B [part rows, r], for the fused `in_proj_qkv`) becomes one LoRA of the fused
projection, A stacked, B block-diagonal (a family's adapter_split_projections says which parts, in row order).
A family may rename module paths of older adapters first (its ADAPTER_RENAMES: Mixtral's block_sparse_moe -> mlp),
and may name parts of the trainer's model that ours leaves out (its ADAPTER_SKIPPED_PREFIXES of keys and
ADAPTER_SKIPPED_MODULES of target_modules entries: Qwen3-VL-MoE's vision tower): their LoRA is skipped
(Adapter.skipped).
Gate/up row order of a fused gate_up LoRA B: a target_parameters delta follows the model's own parameter (GPT-OSS
interleaves gate and up: de-interleaved here); a fused / shared-outer 3D B is [gate; up] unless `gate_up_layout`
says "interleaved" — on a model whose own order is interleaved it must be given (GATE_UP_LAYOUTS).
"""

from __future__ import annotations

import pickle
import re
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from ..errors import InputError, UnsupportedError
from ..models.checkpoint import TensorFiles
from ..models.layers import deinterleave_gate_up
from .config import AdapterConfig
from .targets import EXPERT_PROJ, EXPERT_PROJ_3D, Sites, kind_of, layer_of, peft_view, resolve_targets
from .writers import B_ORDERS, RANK_MAJOR, STANDARD, SWAPPED, decide

PREFIX = "base_model.model."
GATE_UP_LAYOUTS = ("interleaved", "concatenated")  # row orders of a fused gate_up LoRA B
SPLIT_LAYOUT = "split projection parts"  # Adapter.layouts: LoRA on parts of a fused projection (Tinker's in_proj_q)
LORA_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")
EMBEDDING_KEY = re.compile(r"^(?P<module>.+)\.lora_embedding_(?P<ab>[AB])$")
OVERRIDE_KEY = re.compile(r"^(?P<module>.+?)(?P<copy>\.modules_to_save\.[^.]+|\.base_layer)?\.(?P<param>weight|bias)$")


@dataclass
class ExpertFactors:
    """LoRA of one MoE layer's experts (scaling folded into B); a part is None when the adapter lacks it."""

    gate_up: tuple[torch.Tensor, torch.Tensor] | None = None  # A [Ea, R, H], B [Eb, 2I, R]
    down: tuple[torch.Tensor, torch.Tensor] | None = None  # A [Ea, r, I], B [Eb, H, r]


@dataclass
class Adapter:
    name: str
    path: Path
    config: AdapterConfig
    weights_file: Path
    dense: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # A [r, in], B [out, r]
    experts: dict[str, ExpertFactors] = field(default_factory=dict)
    embedding: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # A^T [V, r], B [H, r]
    overrides: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  # site -> {weight, bias}
    layouts: set[str] = field(default_factory=set)
    targets: list[dict] = field(default_factory=list)  # one row per target for reports: site, kind, rank, ...
    skipped: list[str] = field(default_factory=list)  # keys for parts of the trainer's model that ours leaves out
    decisions: list[str] = field(default_factory=list)  # how the writer's layout was read (writers.py), for inspect

    def max_rank(self) -> int:
        ranks = [A.shape[-2] for A, _ in self.dense.values()] + [A.shape[-1] for A, _ in self.embedding.values()]
        for f in self.experts.values():
            ranks += [part[0].shape[-2] for part in (f.gate_up, f.down) if part is not None]
        return max(ranks, default=0)


def read_adapter_tensors(adapter_dir: Path) -> tuple[dict[str, torch.Tensor], Path]:
    """All tensors of the adapter's weights file in float32, each checked floating and finite (one reduction per
    tensor: a NaN or int32 factor is refused here, by file and key, for every command); a `.bin` only through
    weights_only unpickling."""
    st, binary = adapter_dir / "adapter_model.safetensors", adapter_dir / "adapter_model.bin"
    if st.is_file():
        files = TensorFiles([st])
        return {k: _checked(st, k, files.get(k)) for k in files.keys()}, st
    if binary.is_file():
        data = _read_bin(binary)
        return {k: _checked(binary, k, v) for k, v in data.items()}, binary
    raise InputError(adapter_dir, "adapter weights file missing: expected adapter_model.safetensors "
                     "(or adapter_model.bin)")


def _read_bin(path: Path) -> dict[str, torch.Tensor]:
    """A `.bin` state dict read with torch's weights_only unpickler; anything else refused without torch's advice
    (which suggests weights_only=False: we never unpickle untrusted files)."""
    try:
        with warnings.catch_warnings():  # (torch warns about pickle protocols on its way to refusing: one line only)
            warnings.simplefilter("ignore")
            data = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise InputError(path, "refused: not a plain tensor file (it pickles Python objects other than tensors, and "
                         "lora-eval never unpickles untrusted files); save the adapter as adapter_model.safetensors") \
            from None
    except OSError as e:
        raise InputError(path, f"cannot be read ({e.strerror or e})") from None
    except (RuntimeError, EOFError, ValueError, AttributeError, TypeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InputError(path, f"not a readable PyTorch tensor file ({first[:200]}); is it truncated?") from None
    if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                             for k, v in data.items()):
        raise InputError(path, "expected a dict of tensor names to tensors")
    return data


def non_float_error(path: Path, key: str, dtype: torch.dtype | None) -> InputError:
    """The refusal of a LoRA tensor that is not floating point (read, or seen in a header by plan)."""
    found = "a dtype lora-eval does not read" if dtype is None else f"dtype {str(dtype).removeprefix('torch.')}"
    return InputError(path, f"{found}, expected a floating-point tensor (an integer or bool LoRA tensor would be cast "
                      "silently)", key=key)


def _checked(path: Path, key: str, tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` in float32, refused unless it is floating and every value is finite (in float32 too)."""
    if not tensor.dtype.is_floating_point:
        raise non_float_error(path, key, tensor.dtype)
    tensor = tensor.to(torch.float32)
    finite = torch.isfinite(tensor)
    if not bool(finite.all()):
        bad = tensor[~finite]
        raise InputError(path, f"{bad.numel()} of {tensor.numel()} values are not finite (first: {bad[0].item()}); "
                         "expected finite numbers", key=key)
    return tensor


def load_adapter(adapter_dir: str | Path, name: str, model, gate_up_layout: str | None = None) -> Adapter:
    """Read, validate and normalise the PEFT adapter in `adapter_dir` for `model` (our CausalLM).
    `gate_up_layout` ("interleaved" / "concatenated"): the row order of fused 3D gate_up LoRA, which the files
    do not record (see the module notes)."""
    if gate_up_layout not in (None, *GATE_UP_LAYOUTS):
        raise InputError("--gate-up-layout", f"'{gate_up_layout}' is not one of {', '.join(GATE_UP_LAYOUTS)}")
    adapter_dir = Path(adapter_dir)
    if adapter_dir.is_file():
        raise InputError(adapter_dir, f"is a file; expected the folder of adapter '{name}' (with adapter_config.json)")
    if not adapter_dir.is_dir():
        raise InputError(adapter_dir, f"adapter folder for '{name}' not found")
    sites = Sites.of(model)
    config = read_config(adapter_dir, sites)
    targeted = resolve_targets(config, sites)
    tensors, wfile = read_adapter_tensors(adapter_dir)
    adapter = Adapter(name=name, path=adapter_dir, config=config, weights_file=wfile)
    parser = _Parser(adapter, sites, wfile, targeted, gate_up_layout)
    for key, tensor in tensors.items():
        parser.add(key, tensor)
    parser.finish()
    return adapter


def read_config(adapter_dir: Path, sites: Sites) -> AdapterConfig:
    """The folder's adapter_config.json in our module paths (the family's renames of older transformers' or a
    trainer's paths: Sites.renames, e.g. Mixtral's block_sparse_moe -> mlp) as PEFT reads it for this model
    (targets.peft_view)."""
    return peft_view(_renamed_config(AdapterConfig.read(adapter_dir), sites.renames), sites)


def _renamed(name: str, renames) -> str:
    for old, new in renames:
        name = name.replace(old, new)
    return name


def _renamed_config(config: AdapterConfig, renames) -> AdapterConfig:
    """`config` with the family's renames applied to every module name and pattern in it."""
    if not renames:
        return config
    targets = config.target_modules
    return replace(
        config, target_modules=_renamed(targets, renames) if isinstance(targets, str)
        else targets and [_renamed(t, renames) for t in targets],
        target_parameters=[_renamed(t, renames) for t in config.target_parameters],
        exclude_modules=_renamed(config.exclude_modules, renames) if isinstance(config.exclude_modules, str)
        else [_renamed(m, renames) for m in config.exclude_modules],
        rank_pattern={_renamed(k, renames): v for k, v in config.rank_pattern.items()},
        alpha_pattern={_renamed(k, renames): v for k, v in config.alpha_pattern.items()},
        modules_to_save=[_renamed(m, renames) for m in config.modules_to_save])


class _Parser:
    def __init__(self, adapter: Adapter, sites: Sites, wfile: Path, targeted: list[str],
                 gate_up_layout: str | None = None):
        self.adapter, self.sites, self.wfile, self.renames = adapter, sites, wfile, sites.renames
        self.skipped = sites.skipped_prefixes
        self.gate_up_layout = gate_up_layout
        self.targeted = set(targeted)
        self.weight_sites = {**sites.linear, **sites.norm, **sites.embedding}  # modules_to_save candidates
        self.vocab_sites = {*sites.embedding, *(s for s in sites.linear if s == "lm_head")}  # [V, H] weights
        self.config = adapter.config
        self.pairs: dict[tuple[str, str], dict[str, tuple[str, torch.Tensor]]] = {}  # (module, family) -> A/B
        self.expert_parts: dict[str, dict[str, tuple]] = {}  # expert site -> part name -> (A, B)
        self.per_expert: dict[tuple[str, str], dict[int, tuple]] = {}  # (site, part) -> e -> (A, B, scaling)
        self.split_parts = sites.split_parts()  # part site -> fused site
        self.split_given: dict[str, dict[str, tuple]] = {}  # fused site -> part site -> (a_key, A, b_key, B)

    def error(self, key, problem):
        return InputError(self.wfile, problem, key=key)

    def add(self, key: str, tensor: torch.Tensor):
        if not key.startswith(PREFIX):
            raise self.error(key, f"expected adapter keys to start with '{PREFIX}'")
        k = _renamed(key[len(PREFIX):], self.renames)
        if self.skipped and k.startswith(self.skipped):  # a part of the trainer's model that ours leaves out
            self.adapter.skipped.append(key)
            return
        if "lora_magnitude_vector" in k:
            raise UnsupportedError(self.wfile, "DoRA magnitude vectors are not supported by lora-eval", key=key)
        if re.search(r"\.lora_[AB]\.bias$", k):
            raise UnsupportedError(self.wfile, "LoRA bias (lora_bias) is not supported by lora-eval", key=key)
        for pattern, family in ((LORA_KEY, "lora"), (EMBEDDING_KEY, "embedding")):
            m = pattern.match(k)
            if m:
                pair = self.pairs.setdefault((m["module"], family), {})
                if m["ab"] in pair:  # two keys for one factor (e.g. Mixtral's block_sparse_moe and mlp names)
                    raise self.error(key, f"a second lora_{m['ab']} for {m['module']} (also {pair[m['ab']][0]})")
                pair[m["ab"]] = (key, tensor)
                return
        m = OVERRIDE_KEY.match(k)
        if m and m["module"] in self.weight_sites:
            self._override(key, m["module"], m["param"], m["copy"] or "", tensor)
            return
        raise self.error(key, "matches no module of this model; was the adapter made for another architecture?")

    def finish(self):
        for (module, _), ab in self.pairs.items():
            if len(ab) == 1:
                self._refuse_split_shared_outer(module, *next(iter(ab.values())))
        for (module, family), ab in self.pairs.items():
            for side in "AB":
                if side not in ab:
                    present_key = next(iter(ab.values()))[0]
                    other_side = "B" if side == "A" else "A"
                    raise self.error(present_key.replace(f"_{other_side}", f"_{side}"),
                                     f"missing: lora_{side} is needed beside {present_key}")
            (a_key, A), (b_key, B) = ab["A"], ab["B"]
            if module in self.sites.unsupported_modules:
                raise UnsupportedError(self.wfile, f"LoRA on {module} ({self.sites.unsupported_modules[module]}) is "
                                       "not supported", key=a_key)
            if self._is_known(module) and not self._is_targeted(module):
                raise self.error(a_key, "LoRA weights for a module that adapter_config.json does not target "
                                 "(target_modules / target_parameters / layers_to_transform / layers_pattern / "
                                 "exclude_modules / modules_to_save); PEFT would not load them")
            if family == "embedding":
                self._embedding(module, a_key, A, b_key, B)
            elif module in self.sites.linear:
                self._dense(module, a_key, A, b_key, B)
            elif module in self.split_parts:
                self.split_given.setdefault(self.split_parts[module], {})[module] = (a_key, A, b_key, B)
            else:
                self._expert(module, a_key, A, b_key, B)
        self._join_split()
        self._join_experts()

    def _refuse_split_shared_outer(self, module, key, tensor):
        """A [1, ...] factor alone under an expert's projection name, its partner under per-expert names: Megatron-
        Bridge's experts_shared_outer_loras export (peft_bridge.py `_stream_shared_outer_adapter_weights`, 067f987d;
        Bridge itself refused to save it there, and the later format is unconfirmed)."""
        site = self._expert_site(module)
        if site is not None and tensor.dim() == 3 and tensor.shape[0] == 1 and \
                re.fullmatch(r"\.(\w+)", module[len(site):]) and module.rsplit(".", 1)[1] in EXPERT_PROJ:
            raise UnsupportedError(self.wfile, "a shared factor [1, ...] whose partner is stored per expert "
                                   "(Megatron-Bridge's experts_shared_outer_loras export) is not supported; export "
                                   "with expand_shared_outer=True (per-expert names)", key=key)

    def _expert_site(self, module: str) -> str | None:
        return next((s for s in self.sites.experts if module == s or module.startswith(s + ".")), None)

    def _is_known(self, module: str) -> bool:
        return (module in self.sites.linear or module in self.sites.embedding or module in self.split_parts
                or self._expert_site(module) is not None)

    def _is_targeted(self, module: str) -> bool:
        """Whether resolve_targets chose the module: by its own name (a per-expert or 3D projection too; a split
        part, or the projection it is part of), as the experts module as a whole, or through one of the experts'
        parameters: a per-expert or 3D projection through the one it is part of (PEFT converts such keys into its
        target_parameters LoRA), PEFT's own keys (`experts` / `experts.base_layer`) through either, told by the
        shapes and checked then (_param_wrapper)."""
        if module in self.targeted or f"{module}.weight" in self.targeted:
            return True
        if module in self.split_parts:
            return self.split_parts[module] in self.targeted
        site = self._expert_site(module)
        if site is None:
            return False
        if site in self.targeted:
            return True
        rest = module[len(site):]
        projection = re.fullmatch(r"(?:\.\d+)?\.(\w+)", rest)
        if projection and projection[1] in EXPERT_PROJ_3D:
            param = "down_proj" if EXPERT_PROJ_3D[projection[1]] == "down" else "gate_up_proj"
            return f"{site}.{param}" in self.targeted
        return bool(re.fullmatch(r"(\.base_layer)*", rest)) and any(
            f"{site}.{param}" in self.targeted for param in ("gate_up_proj", "down_proj"))

    # ---- dense targets -------------------------------------------------------------------------------
    def _dense(self, module, a_key, A, b_key, B):
        lin = self.sites.linear[module]
        r = self._check(a_key, A, (None, lin.in_features), rank_dim=0)
        self._check(b_key, B, (lin.out_features, r))
        param_key = f"{module}.weight"
        targeted_as_param = any(param_key == p or param_key.endswith(f".{p}") for p in self.config.target_parameters)
        scaling = self._scaling(a_key, param_key if targeted_as_param else module, r)
        self.adapter.dense[module] = (A, self._fold(b_key, B, scaling))
        self._report(module, r, scaling, A.numel() + B.numel(), "dense")

    def _join_split(self):
        """LoRA on parts of a projection that trainers split (Sites.split: Tinker's in_proj_q / k / v of the fused
        in_proj_qkv) as one LoRA of the fused projection: the parts' A stacked [R, in], B block-diagonal [out, R] (a
        part's rows see only its own rank), each part's scaling folded in; a part without LoRA adds nothing."""
        for fused, given in self.split_given.items():
            if fused in self.adapter.dense:
                raise self.error(next(iter(given.values()))[0], f"LoRA on both {fused} and its split parts")
            lin = self.sites.linear[fused]
            factors, blocks, row = [], [], 0
            for part, rows in self.sites.split[fused]:
                if part in given:
                    a_key, A, b_key, B = given[part]
                    r = self._check(a_key, A, (None, lin.in_features), rank_dim=0)
                    self._check(b_key, B, (rows, r))
                    scaling = self._scaling(a_key, part, r)
                    factors.append(A)
                    blocks.append((row, self._fold(b_key, B, scaling)))  # [rows, r] at rows row..row+rows
                    self._report(part, r, scaling, A.numel() + B.numel(), "dense")
                row += rows
            A = torch.cat(factors)  # [R, in]
            B = torch.zeros(lin.out_features, A.shape[0])  # [out, R]
            col = 0
            for start, part_B in blocks:
                B[start:start + part_B.shape[0], col:col + part_B.shape[1]] = part_B
                col += part_B.shape[1]
            self.adapter.dense[fused] = (A, B)
            self.adapter.layouts.add(SPLIT_LAYOUT)

    def _embedding(self, module, a_key, A, b_key, B):
        if module not in self.sites.embedding:
            raise self.error(a_key, "embedding LoRA on a module that is not a token embedding of this model")
        emb = self.sites.embedding[module]
        V, H = emb.weight.shape
        r = self._check(a_key, A, (None, V), rank_dim=0)
        self._check(b_key, B, (H, r))
        scaling = self._scaling(a_key, module, r)
        self.adapter.embedding[module] = (A.T.contiguous(), self._fold(b_key, B, scaling))
        self._report(module, r, scaling, A.numel() + B.numel(), "embedding")

    def _override(self, key, module, param, copy, tensor):
        """A module's own weight or bias saved in the adapter: under its plain name (how PEFT saves modules_to_save,
        and how PEFT loads it: into the module, named by modules_to_save or not), as `.base_layer.` (PEFT's copy of
        a base embedding / lm_head beside its LoRA) or as `.modules_to_save.NAME.` (loaded by PEFT only into a module
        that modules_to_save names)."""
        is_base_copy = copy == ".base_layer"
        base = getattr(self.weight_sites[module], param, None)
        if base is None:
            raise self.error(key, f"the model's {module} has no {param}")
        if tuple(tensor.shape) != tuple(base.shape):
            if module in self.vocab_sites and tensor.dim() == 2 and tensor.shape[1:] == base.shape[1:]:
                extra = tensor.shape[0] - base.shape[0]
                raise UnsupportedError(self.wfile, f"{tensor.shape[0]} rows for the model's {base.shape[0]}: the "
                                       f"adapter {'adds' if extra > 0 else 'removes'} {abs(extra)} tokens, and "
                                       "lora-eval does not resize the model's vocabulary", key=key)
            if is_base_copy:
                raise UnsupportedError(self.wfile, f"saved base layer of shape {list(tensor.shape)} differs from the "
                                       f"model's {list(base.shape)}: resized vocabularies are not supported", key=key)
            raise self.error(key, f"shape {list(tensor.shape)}, expected {list(base.shape)}")
        if copy.startswith(".modules_to_save.") and not any(module.endswith(m) for m in self.config.modules_to_save):
            raise self.error(key, f"a saved copy of {module}, which adapter_config.json's modules_to_save does not "
                             "name; PEFT would not load it")
        if param in self.adapter.overrides.get(module, {}):
            raise self.error(key, f"a second saved {param} for {module}")
        # PEFT saves a copy of the base embedding / lm_head beside their LoRA; unchanged, there is nothing to apply
        # (on a shapes-only model it cannot be told, and applying an unchanged copy changes nothing)
        if is_base_copy and not base.is_meta and torch.equal(tensor.to(base.dtype).cpu(), base.detach().cpu()):
            return
        self.adapter.overrides.setdefault(module, {})[param] = tensor
        self._report(module, None, None, tensor.numel(), "saved base_layer" if is_base_copy else "modules_to_save")

    # ---- experts -------------------------------------------------------------------------------------
    def _expert(self, module, a_key, A, b_key, B):
        for site, experts in self.sites.experts.items():
            if module != site and not module.startswith(site + "."):
                continue
            rest = module[len(site):]
            E, H, I = experts.num_experts, experts.hidden_size, experts.intermediate_size
            dims = {"gate": (H, I), "up": (H, I), "down": (I, H), "gate_up": (H, 2 * I)}
            if re.fullmatch(r"(\.base_layer)*", rest):
                self._param_wrapper(site, E, H, I, a_key, A, b_key, B)
                return
            m = re.fullmatch(r"\.(\d+)\.(\w+)", rest)
            if m and m[2] in EXPERT_PROJ and int(m[1]) < E:
                part, e = EXPERT_PROJ[m[2]], int(m[1])
                r = self._check(a_key, A, (None, dims[part][0]), rank_dim=0)
                self._check(b_key, B, (dims[part][1], r))
                scaling = self._scaling(a_key, module, r)
                self.per_expert.setdefault((site, part), {})[e] = (A, self._fold(b_key, B, scaling), scaling)
                self.adapter.layouts.add("per-expert 2D")
                return
            m = re.fullmatch(r"\.(\w+)", rest)
            if m and m[1] in EXPERT_PROJ_3D:
                part = EXPERT_PROJ_3D[m[1]]
                if A.dim() != 3 or A.shape[0] not in (1, E):
                    raise self.error(a_key, f"shape {list(A.shape)}, expected [{E} or 1, r, {dims[part][0]}]")
                r = self._check(a_key, A, (A.shape[0], None, dims[part][0]), rank_dim=1)
                if B.dim() != 3 or B.shape[0] not in (1, E):
                    raise self.error(b_key, f"shape {list(B.shape)}, expected [{E} or 1, {dims[part][1]}, {r}]")
                self._check(b_key, B, (B.shape[0], dims[part][1], r))
                scaling = self._scaling(a_key, module, r)
                if part == "gate_up" and self._fused_gate_up_interleaved(experts, b_key):
                    B = deinterleave_gate_up(B, dim=1)  # [Eb, 2I, r]: gate rows, then up rows
                self._set_part(site, part, A, self._fold(b_key, B, scaling), a_key, r, scaling)
                shared = E > 1 and 1 in (A.shape[0], B.shape[0])
                self.adapter.layouts.add("shared-outer 3D" if shared else "fused 3D")
                return
        raise self.error(a_key, "matches no module of this model; was the adapter made for another architecture?")

    def _param_wrapper(self, site, E, H, I, a_key, A, b_key, B):
        """PEFT target_parameters (ParamWrapper): which parameter from the shapes, its orientation and B column order
        from the writer (writers.py); A rows expert-slowest. Standard: A [r*E, in], B [out, r*E]; swapped (A on the
        output side): A [r*E, out], B [in, r*E], delta A_e^T B_e^T."""
        if A.dim() != 2 or B.dim() != 2:
            raise self.error(a_key, f"expected 2D target_parameters factors, found {list(A.shape)} and {list(B.shape)}")
        fits = (((H, 2 * I), "gate_up", STANDARD), ((2 * I, H), "gate_up", SWAPPED), ((I, H), "down", STANDARD),
                ((H, I), "down", SWAPPED))  # (A's dim 1, B's dim 0): both orientations where a parameter is square
        found = [(part, o) for dims, part, o in fits if dims == (A.shape[1], B.shape[0])]
        if not found:
            raise self.error(a_key, f"shapes {list(A.shape)} / {list(B.shape)} fit neither gate_up_proj "
                             f"([r*{E}, {H}] / [{2 * I}, r*{E}], or swapped [r*{E}, {2 * I}] / [{H}, r*{E}]) nor "
                             f"down_proj ([r*{E}, {I}] / [{H}, r*{E}], or swapped [r*{E}, {H}] / [{I}, r*{E}])")
        part = found[0][0]
        param, out = f"{part}_proj", (2 * I if part == "gate_up" else H)
        if A.shape[0] % E or B.shape[1] != A.shape[0]:
            raise self.error(a_key, f"rank dim {A.shape[0]} (B: {B.shape[1]}) is not r*{E} for {E} experts")
        if f"{site}.{param}" not in self.targeted and site not in self.targeted:
            raise self.error(a_key, f"LoRA weights for {site}.{param}, which adapter_config.json does not target "
                             "(target_modules / target_parameters / exclude_modules); PEFT would not load them")
        writer = self.config.writer
        oriented, how = decide(writer, self.sites.experts_transposed, tuple(o for _, o in found), self.config.path,
                               "peft_version")
        order = writer.b_order(param)
        self._decided(f"{param}: {how}; B columns {B_ORDERS[order]} ({writer.b_source(param)})")
        r = A.shape[0] // E
        scaling = self._scaling(a_key, f"{site}.{param}", r)
        # views, no copies: a strided copy here would cost the load far more than scaling the view (BENCHMARKS-history
        # 13 and 18.3); the AdapterStack copies the factor to the compute device as it lies and reorders it there
        if oriented == STANDARD:
            A3, B3 = A.reshape(E, r, A.shape[1]), _expert_columns(B, E, r, order)  # [E, r, in], [E, out, r]
        else:
            A3, B3 = _expert_columns(B, E, r, order).transpose(1, 2), A.reshape(E, r, out).transpose(1, 2)
        if part == "gate_up" and self.sites.experts[site].interleaved_gate_up:  # the delta of the model's own param
            B3 = deinterleave_gate_up(B3, dim=1)  # [E, 2I, r]: gate rows, then up rows
        self._set_part(site, part, A3, self._fold(b_key, B3, scaling), a_key, r, scaling)
        self.adapter.layouts.add("PEFT target_parameters")

    def _decided(self, decision: str):
        """Record how the writer's layout was read (inspect prints it); an ambiguous reading also warns, once."""
        if decision in self.adapter.decisions:
            return
        self.adapter.decisions.append(decision)
        if "AMBIGUOUS" in decision:
            warnings.warn(f"adapter '{self.adapter.name}' ({self.adapter.path}): {decision}", stacklevel=2)

    def _fused_gate_up_interleaved(self, experts, key) -> bool:
        """Whether a fused 3D gate_up B alternates gate and up rows: `gate_up_layout` when given; else [gate; up],
        unless the model's own parameter interleaves them (GPT-OSS): then either is plausible and we ask."""
        if self.gate_up_layout is not None:
            return self.gate_up_layout == "interleaved"
        if experts.interleaved_gate_up:
            raise InputError(self.wfile, "a fused gate_up LoRA on a model whose gate_up_proj interleaves gate and up "
                             "columns: its row order cannot be told from the file; pass --gate-up-layout interleaved "
                             "(gate, up alternating) or concatenated (all gate rows, then all up rows)", key=key)
        return False

    def _set_part(self, site, part, A, B, key, r, scaling):
        parts = self.expert_parts.setdefault(site, {})
        if part in parts:
            raise self.error(key, f"a second LoRA for the {part} projection of {site}")
        parts[part] = (A, B)
        self._report(site, r, scaling, A.numel() + B.numel(), f"experts.{part}")

    def _join_experts(self):
        for (site, part), by_expert in self.per_expert.items():
            E = self.sites.experts[site].num_experts
            first_A, first_B, scaling = next(iter(by_expert.values()))
            A = torch.zeros(E, *first_A.shape)  # [E, r, in]; experts without LoRA stay zero
            B = torch.zeros(E, *first_B.shape)  # [E, out, r]
            for e, (Ae, Be, _) in by_expert.items():
                if Ae.shape != first_A.shape:
                    raise self.error(f"{site}.{e}", f"rank {Ae.shape[0]} differs from expert "
                                     f"{next(iter(by_expert))}'s rank {first_A.shape[0]} in one layer")
                A[e], B[e] = Ae, Be
            self._set_part(site, part, A, B, f"{site}.{part}", A.shape[1], scaling)
        for site, parts in self.expert_parts.items():
            if "gate_up" in parts and ({"gate", "up"} & set(parts)):
                raise self.error(f"{site}.gate_up_proj", "both a fused gate_up LoRA and separate gate/up LoRA")
            factors = ExpertFactors(down=parts.get("down"))
            if "gate_up" in parts:
                factors.gate_up = parts["gate_up"]
            elif "gate" in parts or "up" in parts:
                factors.gate_up = _block_gate_up(parts.get("gate"), parts.get("up"),
                                                 self.sites.experts[site].intermediate_size)
            self.adapter.experts[site] = factors

    # ---- shared checks -------------------------------------------------------------------------------
    def _check(self, key, t, shape, rank_dim=None) -> int:
        """Check `t` against `shape` (None = the rank, free); return the rank."""
        ok = t.dim() == len(shape) and all(want is None or got == want for got, want in zip(t.shape, shape))
        if not ok:
            want = ", ".join("r" if w is None else str(w) for w in shape)
            raise self.error(key, f"shape {list(t.shape)}, expected [{want}] for this model; "
                             "was the adapter made for another model?")
        return t.shape[rank_dim] if rank_dim is not None else 0

    def _scaling(self, key, pattern_key, r) -> float:
        want_r, scaling = self.config.rank_and_scaling(pattern_key)
        if want_r != r:
            raise self.error(key, f"rank {r} in the weights, but adapter_config.json gives r={want_r} for "
                             f"'{pattern_key}' (r / rank_pattern)")
        return scaling

    def _fold(self, key, B, scaling) -> torch.Tensor:
        """B times the scaling, refused where a finite B and a finite scaling overflow float32."""
        folded = B * scaling
        if not bool(torch.isfinite(folded).all()):
            raise self.error(key, f"times its scaling {scaling:.6g} (lora_alpha / r, alpha_pattern) overflows float32")
        return folded

    def _report(self, site, r, scaling, params, what):
        self.adapter.targets.append(dict(site=site, kind=kind_of(site), part=what, layer=layer_of(site), rank=r,
                                         scaling=scaling, params=params))


def _expert_columns(M: torch.Tensor, E: int, r: int, order: str) -> torch.Tensor:
    """[d, r*E] packed columns -> [E, d, r] (a view): column j*E + e (RANK_MAJOR, PEFT's) or e*r + j (Unsloth's
    pre-#1269 GROUPED_BY_EXPERT, Megatron-Bridge's) is expert e's rank j."""
    if order == RANK_MAJOR:
        return M.reshape(M.shape[0], r, E).permute(2, 0, 1)
    return M.reshape(M.shape[0], E, r).permute(1, 0, 2)


def _block_gate_up(gate, up, I):
    """Separate gate (A [Eg, r1, H], B [Eb, I, r1]) and up LoRA joined: A [Ea, r1+r2, H], B [Eb, 2I, r1+r2]
    with B block-diagonal, so gate rows see only gate's rank and up rows only up's."""
    parts = [p for p in (gate, up) if p is not None]
    Ea = max(p[0].shape[0] for p in parts)
    Eb = max(p[1].shape[0] for p in parts)
    H = parts[0][0].shape[-1]
    ranks = [p[0].shape[1] if p is not None else 0 for p in (gate, up)]
    A = torch.zeros(Ea, sum(ranks), H)  # [Ea, R, H]
    B = torch.zeros(Eb, 2 * I, sum(ranks))  # [Eb, 2I, R]
    if gate is not None:
        A[:, :ranks[0]] = gate[0]
        B[:, :I, :ranks[0]] = gate[1]
    if up is not None:
        A[:, ranks[0]:] = up[0]
        B[:, I:, ranks[0]:] = up[1]
    return A, B
