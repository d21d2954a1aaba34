"""What an adapter can address in our model (sites), and `target_modules` resolved the way PEFT resolves them."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

from ..errors import InputError, UnsupportedError
from ..models import FAMILIES
from ..models.layers import Embedding, FusedExperts, Linear, RMSNorm
from .config import AdapterConfig

# names adapters use for one expert's projections (Qwen/OLMoE style and Mixtral style) -> our gate/up/down
EXPERT_PROJ = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}
# 3D names holding all experts of a layer
EXPERT_PROJ_3D = {**EXPERT_PROJ, "gate_up_proj": "gate_up"}
# PEFT 0.21's conversion of target_modules on the MoE models whose experts transformers 5 fused, for a family that
# names the model type in ADAPTER_PEFT_CONVERTED (peft.utils.transformers_weight_conversion, Qwen2-MoE's mapping):
# module name -> the target parameter it becomes; gate_proj and up_proj only together (PEFT refuses one alone), as
# one LoRA of twice the rank and alpha on the fused gate_up_proj
PEFT_MOE_CONVERSION = {"gate": "gate.weight", "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj",
                       "down_proj": "down_proj"}
PEFT_FUSED = {"gate_up_proj": ("gate_proj", "up_proj")}
ALL_LINEAR = ("all-linear", "all")
# model types whose transformers-5 expert parameters are stored [E, in, out] (`@use_experts_implementation(
# is_transposed=True)`: transformers 5.24 models/gpt_oss/modeling_gpt_oss.py); every other family's are [E, out, in].
# PEFT's orientation of a target_parameters LoRA depends on it (writers.orientation)
HF_TRANSPOSED_EXPERTS = ("gpt_oss",)


@dataclass
class Sites:
    """Every module of a model that an adapter may address, by its Hugging Face / PEFT path, and what the model's
    family says about adapters (its ADAPTER_* names: see the family modules, e.g. models/qwen3_next.py)."""

    linear: dict[str, Linear]
    experts: dict[str, FusedExperts]
    embedding: dict[str, Embedding]
    norm: dict[str, RMSNorm]
    renames: tuple[tuple[str, str], ...] = ()  # ADAPTER_RENAMES: (a trainer's name part, ours)
    # the family's declaration of which Linear sites are other modules in transformers (routers): None where the
    # family declares nothing, and "all-linear" is then every projection (a superset of PEFT's)
    not_nn_linear: tuple[str, ...] | None = None
    peft_converted: bool = False  # PEFT converts target_modules for this model type (PEFT_MOE_CONVERSION)
    split: dict[str, tuple[tuple[str, int], ...]] = field(default_factory=dict)  # fused site -> ((part, rows), ...)
    unsupported_modules: dict[str, str] = field(default_factory=dict)  # name -> what it is; no LoRA on it
    unsupported_parameters: dict[str, str] = field(default_factory=dict)
    # parts of the trainer's model that ours leaves out (a vision tower): ADAPTER_SKIPPED_MODULES, target_modules
    # entries that may match nothing here; ADAPTER_SKIPPED_PREFIXES, weight keys whose LoRA is skipped
    skipped_modules: tuple[str, ...] = ()
    skipped_prefixes: tuple[str, ...] = ()
    experts_transposed: bool = False  # transformers 5 stores the expert parameters [E, in, out]: HF_TRANSPOSED_EXPERTS

    @classmethod
    def of(cls, model) -> "Sites":
        found = {Linear: {}, FusedExperts: {}, Embedding: {}, RMSNorm: {}}
        for module in model.modules():
            if type(module) in found:
                found[type(module)][module.site] = module
        family = FAMILIES.get(model.args.model_type)
        split = family.adapter_split_projections(model) if hasattr(family, "adapter_split_projections") else {}
        refused = getattr(family, "ADAPTER_UNSUPPORTED", {})

        def unsupported(names):
            return {n: refused[part] for n in names for part in n.split(".") if part in refused}

        return cls(found[Linear], found[FusedExperts], found[Embedding], found[RMSNorm],
                   renames=getattr(family, "ADAPTER_RENAMES", ()),
                   not_nn_linear=getattr(family, "ADAPTER_NOT_NN_LINEAR", None),
                   peft_converted=model.args.model_type in getattr(family, "ADAPTER_PEFT_CONVERTED", ()),
                   split=split, unsupported_modules=unsupported(n for n, _ in model.named_modules()),
                   unsupported_parameters=unsupported(n for n, _ in model.named_parameters()),
                   skipped_modules=tuple(getattr(family, "ADAPTER_SKIPPED_MODULES", ())),
                   skipped_prefixes=tuple(getattr(family, "ADAPTER_SKIPPED_PREFIXES", ())),
                   experts_transposed=model.args.model_type in HF_TRANSPOSED_EXPERTS)

    def module_names(self) -> list[str]:
        """Names that `target_modules` can match: modules, and each expert's projections as PEFT would see them."""
        names = list(self.linear) + list(self.embedding)
        for site, experts in self.experts.items():
            names.append(site)
            names += [f"{site}.{proj}" for proj in EXPERT_PROJ_3D]
            names += [f"{site}.{e}.{proj}" for e in range(experts.num_experts) for proj in EXPERT_PROJ]
        return names

    def parameter_names(self) -> list[str]:
        """Names that `target_parameters` can match."""
        return [f"{s}.weight" for s in self.linear] + [f"{s}.{p}" for s in self.experts
                                                          for p in ("gate_up_proj", "down_proj")]

    def split_parts(self) -> dict[str, str]:
        """{part site: fused site} of the projections trainers split (see `split`)."""
        return {part: fused for fused, parts in self.split.items() for part, _ in parts}

    def aliases(self, name: str) -> tuple[str, ...]:
        """`name` and, where the family's trainers name it otherwise (ADAPTER_RENAMES: a vision-language model's
        `model.language_model.`), that name: an adapter's config names a module in its own layout, which its
        config does not say, and a name in either layout names one module."""
        theirs = name
        for old, new in self.renames:
            theirs = theirs.replace(new, old, 1)
        return (name,) if theirs == name else (name, theirs)


def layer_of(name: str) -> int | None:
    m = re.search(r"\.layers\.(\d+)\.", name)
    return int(m.group(1)) if m else None


def kind_of(name: str) -> str:
    """Short module kind for reports: q_proj, gate (router), experts, shared_expert.up_proj, embed_tokens, ..."""
    if ".experts" in name:
        return "experts"
    if ".shared_expert." in name:  # Qwen2-MoE's shared expert: dense, but not the dense MLP
        return "shared_expert." + name.rsplit(".", 1)[-1]
    if ".shared_experts." in name:  # GLM-4.5's (and DeepSeek-V3's) shared experts, likewise
        return "shared_experts." + name.rsplit(".", 1)[-1]
    return name.rsplit(".", 1)[-1]


def peft_view(config: AdapterConfig, sites: Sites) -> AdapterConfig:
    """`config` as PEFT 0.21 rewrites it for this model before matching names, where the family says what that takes
    (Sites.not_nn_linear, peft_converted): "all-linear" becomes every projection that transformers' model has as an
    nn.Linear, but the output layer (_maybe_include_all_linear_layers); on a converted model type, a regex becomes
    the last names of the modules it matches (so `.*layers\\.0\\.q_proj` is every layer's q_proj) and the expert
    projections' and the router's names become target_parameters (_convert_peft_config_moe, with its rank and alpha
    patterns). Another family's config is returned as it is. Idempotent: nothing it rewrites is left."""
    if sites.not_nn_linear is None:
        return config
    targets = config.target_modules
    if targets in ALL_LINEAR:
        targets = [n for n in sites.linear if n != "lm_head" and not _suffix_hit(sites.not_nn_linear, (n,))]
        if sites.peft_converted:  # PEFT adds the experts' and the router's names, no nn.Linear in transformers 5
            targets += list(PEFT_MOE_CONVERSION)
    elif isinstance(targets, str) and sites.peft_converted:
        targets = _regex_leaf_names(targets, sites) or targets  # matching nothing: refused as the regex below
    if not (sites.peft_converted and isinstance(targets, list)):
        return replace(config, target_modules=targets)
    return _converted(config, targets)


def _converted(config: AdapterConfig, targets: list[str]) -> AdapterConfig:
    remaining, parameters, fused = [], list(config.target_parameters), {}
    for entry in targets:
        old = next((o for o in PEFT_MOE_CONVERSION if entry == o or entry.endswith(f".{o}")), None)
        if old is None:
            remaining.append(entry)
            continue
        new = PEFT_MOE_CONVERSION[old]
        parameters += [] if new in parameters else [new]
        fused.setdefault(new, set()).add(old)
    ranks, alphas = dict(config.rank_pattern), dict(config.alpha_pattern)
    for new, parts in PEFT_FUSED.items():
        given = fused.get(new, set())
        if given and given != set(parts):
            missing = ", ".join(sorted(set(parts) - given))
            raise InputError(config.path, f"names {', '.join(sorted(given))} without {missing}: on this model PEFT "
                             f"fuses them into the experts' {new} and refuses the config", key="target_modules")
        if given:
            ranks[rf".*\.{re.escape(new)}"] = config.r * len(parts)
            alphas[rf".*\.{re.escape(new)}"] = config.lora_alpha * len(parts)
    return replace(config, target_modules=remaining, target_parameters=parameters, rank_pattern=ranks,
                   alpha_pattern=alphas)


def _regex_leaf_names(regex: str, sites: Sites) -> list[str]:
    """PEFT's _resolve_string_target_modules: the last names of the modules and parameters the regex matches, and the
    experts' gate_proj / up_proj / down_proj where it matches `{experts}.{name}`; a last name that names no module
    here (a parameter's) targets nothing in PEFT and is left out, one of a module that takes no LoRA is kept (and
    refused by resolve_targets, as PEFT fails on it)."""
    modules = list(sites.linear) + list(sites.embedding) + list(sites.unsupported_modules)
    keys = modules + list(sites.experts) + sites.parameter_names()
    leaves = {k.rsplit(".", 1)[-1] for k in keys if _regex_hit(regex, sites.aliases(k))}
    leaves |= {old for old, new in PEFT_MOE_CONVERSION.items() if new in ("gate_up_proj", "down_proj")
               and any(_regex_hit(regex, sites.aliases(f"{site}.{old}")) for site in sites.experts)}
    return sorted(leaf for leaf in leaves if leaf in PEFT_MOE_CONVERSION or _suffix_hit((leaf,), modules))


def resolve_targets(config: AdapterConfig, sites: Sites) -> list[str]:
    """The module names (and `module.parameter` names of target_parameters) the config targets: the one place that
    decides which (layer, module) target_modules, layers_to_transform, layers_pattern, exclude_modules,
    modules_to_save and target_parameters cover, for every layout, by PEFT's rules (check_target_module_exists,
    _maybe_include_all_linear_layers, _inject_parameters; peft_view). An entry (or regex) that matches nothing is an
    InputError, except an entry of Sites.skipped_modules: a module of the trainer's model that ours leaves out (a
    family's vision tower); so is a config that targets nothing (PEFT refuses it: NoMatchingPeftModuleError). Names a trainer splits
    (Sites.split) are matched by list entries, as their own; what takes no LoRA is refused by name."""
    config = peft_view(config, sites)
    names = sites.module_names()
    targets = config.target_modules
    if targets is None:
        candidates = []
    elif targets in ALL_LINEAR:  # a family that does not declare PEFT's view (peft_view): every projection
        # (the experts' each by its own name, so that exclude_modules can leave one out)
        candidates = [n for n in names if n != "lm_head" and layer_of(n) is not None and n not in sites.embedding
                      and n not in sites.experts]
    elif isinstance(targets, str):
        _refuse_unsupported(config, [n for n in sites.unsupported_modules if _regex_hit(targets, sites.aliases(n))],
                            sites.unsupported_modules, "target_modules")
        candidates = [n for n in names if _regex_hit(targets, sites.aliases(n))]
        if not candidates:
            raise InputError(config.path, f"regex {targets!r} matches no module of this model", key="target_modules")
    else:
        candidates = []
        for entry in targets:
            hits = [n for n in names + list(sites.split_parts()) if _suffix_hit((entry,), sites.aliases(n))]
            if not hits and entry not in sites.skipped_modules:
                _refuse_unsupported(config, [n for n in sites.unsupported_modules
                                             if _suffix_hit((entry,), sites.aliases(n))],
                                    sites.unsupported_modules, "target_modules")
                raise InputError(config.path, f"entry '{entry}' matches no module of this model "
                                 f"(e.g. {', '.join(_examples(names))})", key="target_modules")
            candidates += hits
    # PEFT filters by layer only a list of target_modules (config.py refuses the layer settings with a string), and
    # never target_parameters
    in_layers = [n for n in candidates if not isinstance(targets, list) or not config.layers_to_transform
                 or _layer_index(n, config.layers_pattern) in config.layers_to_transform]
    chosen = [n for n in in_layers if not _excluded(config, sites.aliases(n))]
    params = sites.parameter_names()
    for entry in config.target_parameters:
        hits = [p for p in params if _suffix_hit((entry,), sites.aliases(p))]
        if not hits:
            _refuse_unsupported(config, [p for p in sites.unsupported_parameters
                                         if _suffix_hit((entry,), sites.aliases(p))],
                                sites.unsupported_parameters, "target_parameters")
            raise InputError(config.path, f"entry '{entry}' matches no parameter of this model "
                             f"(e.g. {', '.join(_examples(params))})", key="target_parameters")
        chosen += hits
    if not chosen:
        raise _targets_nothing(config, candidates, in_layers, sites)
    return sorted(set(chosen))


def _suffix_hit(entries, names) -> bool:
    """PEFT's match of a target_modules list entry: the whole name, or its end after a dot."""
    return any(name == e or name.endswith(f".{e}") for e in entries for name in names)


def _regex_hit(regex: str, names) -> bool:
    return any(re.fullmatch(regex, name) for name in names)


def _refuse_unsupported(config: AdapterConfig, hits: list[str], what: dict[str, str], key: str) -> None:
    if hits:
        raise UnsupportedError(config.path, f"LoRA on {hits[0]} ({what[hits[0]]}) is not supported", key=key)


def _layer_index(name: str, layers_pattern: list[str]) -> int | None:
    """PEFT's layer index of a module name: its first numbered segment, or the number after a layers_pattern."""
    if not layers_pattern:
        m = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", name)
    else:
        m = None
        for pattern in layers_pattern:
            m = re.match(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", name)
            if m:
                break
    return int(m["idx"]) if m else None


def _excluded(config: AdapterConfig, aliases: tuple[str, ...]) -> bool:
    """PEFT leaves out of LoRA a module that exclude_modules names, and one inside a module of modules_to_save
    (`aliases`: the module's names, Sites.aliases)."""
    exclude = config.exclude_modules
    if _regex_hit(exclude, aliases) if isinstance(exclude, str) else _suffix_hit(exclude, aliases):
        return True
    return any(re.match(rf"(^|.*\.){m}($|\..*)", name) for m in config.modules_to_save for name in aliases)
def _targets_nothing(config: AdapterConfig, candidates: list[str], in_layers: list[str], sites: Sites) -> InputError:
    """The error for a config that targets no module and no parameter, naming the setting that removed them all."""
    if not candidates:
        return InputError(config.path, "targets nothing: neither target_modules nor target_parameters names a module "
                          "of this model", key="target_modules")
    if not in_layers:
        layers = sorted({i for n in sites.module_names() if (i := layer_of(n)) is not None})
        pattern = f" (layers_pattern {config.layers_pattern})" if config.layers_pattern else ""
        return InputError(config.path, f"{config.layers_to_transform}{pattern} selects no layer of the targeted "
                          f"modules; this model has layers {layers[0]}-{layers[-1]}", key="layers_to_transform")
    key = "exclude_modules" if config.exclude_modules else "modules_to_save"
    return InputError(config.path, f"every module that target_modules names is excluded by {key}", key=key)


def _examples(names: list[str]) -> list[str]:
    seen = []
    for n in names:
        short = re.sub(r"^model\.layers\.\d+\.", "", n)
        short = re.sub(r"\.\d+\.", ".{e}.", short)
        if short not in seen:
            seen.append(short)
    return seen[:8]
