"""adapter_config.json: the LoRA settings we honour, and refusal by name of everything we don't compute."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import InputError, UnsupportedError
from ..models.checkpoint import read_json
from .writers import UNSLOTH_KEYS, Writer

# Settings that only matter for training or initialisation: inference ignores them (init_lora_weights is checked
# below: some of its values mean a different base model).
IGNORED = {
    "task_type", "auto_mapping", "base_model_name_or_path", "revision", "inference_mode",
    "lora_dropout", "init_lora_weights", "loftq_config", "eva_config", "corda_config", "lora_ga_config",
    "megatron_core", "qalora_group_size", "runtime_config", "target_modules_to_tie",
}
# Settings that decide the forward; which (layer, module) they cover is decided in targets.resolve_targets alone.
HONOURED = {"peft_type", "r", "lora_alpha", "target_modules", "target_parameters", "layers_to_transform",
            "layers_pattern", "exclude_modules", "rank_pattern", "alpha_pattern", "use_rslora", "modules_to_save",
            "peft_version", *UNSLOTH_KEYS}  # the writer's facts: writers.Writer
# Features that change the forward and that the engine does not implement, with what PEFT calls them.
REFUSED = {
    "use_dora": "DoRA (use_dora)", "lora_bias": "LoRA bias (lora_bias)", "bias": "trained biases (bias)",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D layers)",
    "trainable_token_indices": "trainable tokens (rows of embed_tokens / lm_head replaced)",
    "layer_replication": "layer replication", "use_qalora": "QA-LoRA", "alora_invocation_tokens": "aLoRA",
    "megatron_config": "Megatron parallel layers", "velora_config": "VeLoRA", "monteclora_config": "MonteCLoRA",
    "arrow_config": "Arrow routing", "kasa_config": "KaSA", "use_bdlora": "BD-LoRA",
    "ensure_weight_tying": "adapter weight tying (ensure_weight_tying)",
}
# init_lora_weights values after which PEFT subtracts the initial LoRA from the base weights: such an adapter, saved
# without PEFT's conversion (which rewrites the value to true), is only right on that residual base model
RESIDUAL_INITS = ("pissa", "corda", "olora", "loftq", "lora_ga")
MAX_RANK = 1 << 16  # far above any real LoRA rank; a larger one is a corrupt config, not a rank
DEFAULTS_OK = {"bias": "none"}


@dataclass
class AdapterConfig:
    path: Path
    r: int
    lora_alpha: float
    target_modules: list[str] | str | None
    target_parameters: list[str] = field(default_factory=list)
    layers_to_transform: list[int] | None = None
    layers_pattern: list[str] = field(default_factory=list)
    exclude_modules: list[str] | str = field(default_factory=list)
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    use_rslora: bool = False
    modules_to_save: list[str] = field(default_factory=list)
    writer: Writer = field(default_factory=Writer)

    @classmethod
    def read(cls, adapter_dir: Path) -> "AdapterConfig":
        path = adapter_dir / "adapter_config.json"
        raw = read_json(path)
        _refuse_features(path, raw)

        def bad(key, expected):
            return InputError(path, f"expected {expected}, found {raw.get(key)!r}", key=key)

        r, alpha = raw.get("r", 8), raw.get("lora_alpha", 8)
        if not _is_rank(r):
            raise bad("r", f"a positive integer rank up to {MAX_RANK}")
        if not _is_number(alpha):
            raise bad("lora_alpha", "a positive finite number")
        if not isinstance(raw.get("use_rslora") or False, bool):
            raise bad("use_rslora", "true or false")
        targets = raw.get("target_modules")
        if targets is not None and not (isinstance(targets, str) or _str_list(targets)):
            raise bad("target_modules", "a list of names or a regex string")
        if isinstance(targets, str) and targets not in ("all-linear", "all"):
            _check_regex(path, "target_modules", targets)
        for key in ("target_parameters", "modules_to_save"):
            if raw.get(key) is not None and not _str_list(raw[key]):
                raise bad(key, "a list of names")
        exclude = raw.get("exclude_modules")
        if exclude is not None and not (isinstance(exclude, str) or _str_list(exclude)):
            raise bad("exclude_modules", "a list of names or a regex string")
        if isinstance(exclude, str):
            _check_regex(path, "exclude_modules", exclude)
        layer_names = raw.get("layers_pattern")
        if layer_names is not None and not (isinstance(layer_names, str) or _str_list(layer_names)):
            raise bad("layers_pattern", "a name or a list of names")
        # PEFT puts these into regular expressions as they are
        for key in ("layers_pattern", "modules_to_save"):
            for entry in [raw[key]] if isinstance(raw.get(key), str) else raw.get(key) or []:
                _check_regex(path, key, entry)
        layers = raw.get("layers_to_transform")
        layers = [layers] if isinstance(layers, int) and not isinstance(layers, bool) else layers
        if layers is not None and not (isinstance(layers, list) and all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layers)):
            raise bad("layers_to_transform", "a layer index or a list of layer indices")
        # PEFT's LoraConfig refuses these combinations (its __post_init__): the layer settings only filter a list
        for key, value in (("layers_to_transform", layers), ("layers_pattern", layer_names)):
            if value is not None and isinstance(targets, str):
                raise InputError(path, f"cannot be used with target_modules {targets!r}, a string (PEFT refuses this "
                                 "config: layer settings only filter a list of target_modules)", key=key)
        if layer_names and layers is None:
            raise InputError(path, "given without layers_to_transform (PEFT refuses this config)",
                             key="layers_pattern")
        for key, valid, expected in (("rank_pattern", _is_rank, f"positive integer ranks up to {MAX_RANK}"),
                                     ("alpha_pattern", _is_number, "positive finite numbers")):
            patterns = raw.get(key) or {}
            if not isinstance(patterns, dict) or not all(valid(v) for v in patterns.values()):
                raise bad(key, f"an object of module patterns to {expected}")
            for pattern in patterns:
                _check_regex(path, key, pattern)
        return cls(
            path=path, r=r, lora_alpha=float(alpha), target_modules=targets,
            target_parameters=list(raw.get("target_parameters") or []), layers_to_transform=layers,
            layers_pattern=[layer_names] if isinstance(layer_names, str) else list(layer_names or []),
            exclude_modules=exclude if isinstance(exclude, str) else list(exclude or []),
            rank_pattern=dict(raw.get("rank_pattern") or {}), alpha_pattern=dict(raw.get("alpha_pattern") or {}),
            use_rslora=bool(raw.get("use_rslora")), modules_to_save=list(raw.get("modules_to_save") or []),
            writer=Writer.read(path, raw),
        )

    def rank_and_scaling(self, key: str) -> tuple[int, float]:
        """PEFT's rank and scaling for the module (or `module.parameter`) key, patterns included."""
        r = self.rank_pattern[_pattern_key(self.rank_pattern, key)] if _pattern_key(self.rank_pattern, key) else self.r
        a_key = _pattern_key(self.alpha_pattern, key)
        alpha = float(self.alpha_pattern[a_key]) if a_key else self.lora_alpha
        return int(r), (alpha / math.sqrt(r) if self.use_rslora else alpha / r)


def _refuse_features(path: Path, raw: dict) -> None:
    """Refuse by name a PEFT type other than LoRA, a setting that changes the forward and that we do not compute
    (REFUSED, or one we do not know), and an adapter made for PEFT's residual base model (RESIDUAL_INITS)."""
    peft_type = raw.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise UnsupportedError(path, f"peft_type '{peft_type}' is not supported (only LORA)", key="peft_type")
    for key, value in raw.items():
        if key in IGNORED or key in HONOURED or not value or value == DEFAULTS_OK.get(key):
            continue
        feature = REFUSED.get(key, f"the unknown setting '{key}'")
        raise UnsupportedError(path, f"{feature} is not supported by lora-eval (value {value!r})", key=key)
    init = raw.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(RESIDUAL_INITS):
        raise UnsupportedError(path, f"an adapter initialised with '{init}' and saved without PEFT's conversion "
                               "applies to PEFT's residual base model, not to this one: save it with "
                               "path_initial_model_for_weight_conversion", key="init_lora_weights")


def _is_number(v) -> bool:
    """A positive finite number (Python's json reads NaN and Infinity)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def _is_rank(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 < v <= MAX_RANK


def _str_list(value) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _check_regex(path, key, pattern):
    try:
        re.compile(pattern)
    except re.error as e:
        raise InputError(path, f"'{pattern}' is not a valid regular expression ({e})", key=key) from None


def _pattern_key(patterns: dict, key: str) -> str | None:
    """The first pattern that matches the end of `key` at a dot boundary (PEFT's get_pattern_key)."""
    for pattern in patterns:
        if re.match(rf"(.*\.)?({pattern})$", key):
            return pattern
    return None
