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
    """Module names the config targets; an entry (or regex) that matches nothing is an InputError, except an entry
    in `outside`: a module of the trainer's model that ours leaves out (a family's vision tower)."""
    names = sites.module_names()
    targets = config.target_modules
    if targets in ("all-linear", "all"):
        chosen = [n for n in names if n != "lm_head" and layer_of(n) is not None and n not in sites.embedding]
    elif isinstance(targets, str):
        chosen = [n for n in names if re.fullmatch(targets, n)]
        if not chosen:
            raise InputError(config.path, f"regex {targets!r} matches no module of this model", key="target_modules")
    else:
        chosen = []
        for entry in targets or []:
            hits = [n for n in names if n == entry or n.endswith(f".{entry}")]
            if not hits and entry not in outside:
                raise InputError(config.path, f"entry '{entry}' matches no module of this model "
                                 f"(e.g. {', '.join(_examples(names))})", key="target_modules")
            chosen += hits
        if config.layers_to_transform is not None:
            chosen = [n for n in chosen if layer_of(n) in config.layers_to_transform]
    params = sites.parameter_names()
    for entry in config.target_parameters:
        hits = [p for p in params if p == entry or p.endswith(f".{entry}")]
        if not hits:
            raise InputError(config.path, f"entry '{entry}' matches no parameter of this model "
                             f"(e.g. {', '.join(_examples(params))})", key="target_parameters")
        chosen += hits
    return sorted(set(chosen))


def _examples(names: list[str]) -> list[str]:
    seen = []
    for n in names:
        short = re.sub(r"^model\.layers\.\d+\.", "", n)
        short = re.sub(r"\.\d+\.", ".{e}.", short)
        if short not in seen:
            seen.append(short)
    return seen[:8]
