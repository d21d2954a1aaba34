"""What an adapter can address in our model (sites), and `target_modules` resolved the way PEFT resolves them."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import InputError
from ..models.layers import Embedding, FusedExperts, Linear, RMSNorm
from .config import AdapterConfig

# names adapters use for one expert's projections (Qwen/OLMoE style and Mixtral style) -> our gate/up/down
EXPERT_PROJ = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}
# 3D names holding all experts of a layer
EXPERT_PROJ_3D = {**EXPERT_PROJ, "gate_up_proj": "gate_up"}


@dataclass
class Sites:
    """Every module of a model that an adapter may address, by its Hugging Face / PEFT path."""

    linear: dict[str, Linear]
    experts: dict[str, FusedExperts]
    embedding: dict[str, Embedding]
    norm: dict[str, RMSNorm]

    @classmethod
    def of(cls, model) -> "Sites":
        found = {Linear: {}, FusedExperts: {}, Embedding: {}, RMSNorm: {}}
        for module in model.modules():
            if type(module) in found:
                found[type(module)][module.site] = module
        return cls(found[Linear], found[FusedExperts], found[Embedding], found[RMSNorm])

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


def resolve_targets(config: AdapterConfig, sites: Sites, outside: tuple[str, ...] = ()) -> list[str]:
    """The module names (and `module.parameter` names of target_parameters) the config targets: the one place that
    decides which (layer, module) target_modules, layers_to_transform, layers_pattern, exclude_modules,
    modules_to_save and target_parameters cover, for every layout, by PEFT's rules (check_target_module_exists,
    _maybe_include_all_linear_layers, _inject_parameters). An entry (or regex) that matches nothing is an InputError,
    except an entry in `outside`: a module of the trainer's model that ours leaves out (a family's vision tower);
    so is a config that targets nothing (PEFT refuses it: NoMatchingPeftModuleError)."""
    names = sites.module_names()
    targets = config.target_modules
    if targets is None:
        candidates = []
    elif targets in ("all-linear", "all"):
        # every projection (the experts' each by its own name, so that exclude_modules can leave one out)
        candidates = [n for n in names if n != "lm_head" and layer_of(n) is not None and n not in sites.embedding
                      and n not in sites.experts]
    elif isinstance(targets, str):
        candidates = [n for n in names if re.fullmatch(targets, n)]
        if not candidates:
            raise InputError(config.path, f"regex {targets!r} matches no module of this model", key="target_modules")
    else:
        candidates = []
        for entry in targets:
            hits = [n for n in names if n == entry or n.endswith(f".{entry}")]
            if not hits and entry not in outside:
                raise InputError(config.path, f"entry '{entry}' matches no module of this model "
                                 f"(e.g. {', '.join(_examples(names))})", key="target_modules")
            candidates += hits
    # PEFT filters by layer only a list of target_modules (config.py refuses the layer settings with a string), and
    # never target_parameters
    in_layers = [n for n in candidates if not isinstance(targets, list) or not config.layers_to_transform
                 or _layer_index(n, config.layers_pattern) in config.layers_to_transform]
    chosen = [n for n in in_layers if not _excluded(config, n)]
    params = sites.parameter_names()
    for entry in config.target_parameters:
        hits = [p for p in params if p == entry or p.endswith(f".{entry}")]
        if not hits:
            raise InputError(config.path, f"entry '{entry}' matches no parameter of this model "
                             f"(e.g. {', '.join(_examples(params))})", key="target_parameters")
        chosen += hits
    if not chosen:
        raise _targets_nothing(config, candidates, in_layers, sites)
    return sorted(set(chosen))


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


def _excluded(config: AdapterConfig, name: str) -> bool:
    """PEFT leaves out of LoRA a module that exclude_modules names, and one inside a module of modules_to_save."""
    exclude = config.exclude_modules
    if isinstance(exclude, str):
        if re.fullmatch(exclude, name):
            return True
    elif name in exclude or any(name.endswith(f".{e}") for e in exclude):
        return True
    return any(re.match(rf"(^|.*\.){m}($|\..*)", name) for m in config.modules_to_save)


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
