"""Who wrote an adapter, and what that means for its expert factors: the writer facts of adapter_config.json.

PEFT `target_parameters` on a 3D expert parameter (ParamWrapper) store A [r*E, d_a] with expert-slowest rows and
B [d_b, r*E]; which of the parameter's dims is d_a, and how B's columns are grouped, depend on the writer:
* orientation, by the PEFT version that wrote the file (`peft_version`, written since PEFT 0.18.0; huggingface/peft
  #3165, tags v0.19.0 6d5a6f4f / v0.19.1 ba6a1906, peft/tuners/lora/layer.py ParamWrapper): "standard" (A on the
  input side, A [r*E, in], B [out, r*E], delta B_e A_e) or "swapped" (A on the output side, A [r*E, out],
  B [in, r*E], delta A_e^T B_e^T). PEFT's flag did_swap is False before 0.19.0, `is_transposed` in 0.19.0 and
  `not is_transposed` from 0.19.1 on, where `is_transposed` says transformers 5 stores the parameter [E, in, out]
  (GPT-OSS) rather than [E, out, in]; A is on the output side exactly when did_swap equals is_transposed.
  Where the dims differ the shapes decide (and must agree with the version); a square parameter needs the version.
* B's column order: PEFT's is expert-fastest (column j*E + e, "rank_major"). Unsloth before unsloth-zoo#1269 trained
  expert-slowest (column e*r + j, "grouped_by_expert"); since #1232 its save writes the marker `lora_B_layout` and
  `unsloth_fused_expert_lora.parameters.<param>.lora_B_layout` (unslothai/unsloth-zoo tests/test_moe_lora_layout.py,
  post-#1232), the per-parameter value deciding. A file without the marker reads as PEFT's: nothing tells a pre-fix
  Unsloth adapter apart.
* Megatron-Bridge's export (NVIDIA-NeMo/Megatron-Bridge@067f987d src/megatron/bridge/models/conversion/
  peft_bridge.py, `_pack_target_parameter_adapter_weights` :1522 and `build_adapter_config_dict` :1622) packs its
  per-expert A [E, r, in] / B [E, out, r] as lora_A = cat(B_e^T) [E*r, out] and lora_B = cat(A_e^T, dim=1)
  [in, E*r]: swapped, with expert-slowest B. Its config has no peft_version and exactly BRIDGE_CONFIG_KEYS (plus
  target_parameters): that key set is the fingerprint (PEFT writes every LoraConfig field, dozens more).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import InputError, UnsupportedError

STANDARD, SWAPPED = "standard", "swapped"
RANK_MAJOR, GROUPED_BY_EXPERT = "rank_major", "grouped_by_expert"  # Unsloth's names of the two B column orders
B_ORDERS = {RANK_MAJOR: "expert-fastest", GROUPED_BY_EXPERT: "expert-slowest"}
# build_adapter_config_dict's keys (Megatron-Bridge@067f987d peft_bridge.py:1638-1658); target_parameters comes on top
BRIDGE_CONFIG_KEYS = frozenset({
    "peft_type", "auto_mapping", "base_model_name_or_path", "bias", "fan_in_fan_out", "inference_mode",
    "init_lora_weights", "lora_alpha", "lora_dropout", "modules_to_save", "r", "rank_pattern", "alpha_pattern",
    "target_modules", "task_type", "use_dora", "use_rslora"})
UNSLOTH_KEYS = ("lora_B_layout", "unsloth_fused_expert_lora")
VERSION = re.compile(r"^(\d+)\.(\d+)\.(\d+)(?:\.?(dev|rc|a|b)\d*)?(?:\+[\w.]+)?(?:@\S*)?$")
# PEFT's behaviours (did_swap rules): "0.18" none (<=0.18.x and 0.17), "0.19.0" is_transposed, "0.19.1" not
_BEHAVIOURS_TEXT = {"0.18": "PEFT <0.19.0 never swaps", "0.19.0": "PEFT 0.19.0 swaps where is_transposed",
                    "0.19.1": "PEFT >=0.19.1 swaps where not is_transposed"}


@dataclass
class Writer:
    """What adapter_config.json says about its writer."""

    peft_version: str | None = None
    behaviours: tuple[str, ...] = ("0.18", "0.19.0", "0.19.1")  # PEFT's did_swap rules the version allows
    megatron_bridge: bool = False  # Bridge's config fingerprint (BRIDGE_CONFIG_KEYS, no peft_version)
    b_layouts: dict[str, str] = field(default_factory=dict)  # Unsloth marker: parameter name -> B order
    b_layout: str | None = None  # Unsloth's flat marker

    @classmethod
    def read(cls, path: Path, raw: dict) -> "Writer":
        version = raw.get("peft_version")
        writer = cls(peft_version=version, behaviours=_behaviours(path, version),
                     megatron_bridge=version is None and "target_parameters" in raw
                     and set(raw) - {"target_parameters"} == BRIDGE_CONFIG_KEYS)
        writer.b_layout, writer.b_layouts = _unsloth_marker(path, raw)
        return writer

    def describe(self) -> str:
        """One line for inspect: the version read and the writer's marks found."""
        parts = [f"peft_version {self.peft_version}" if self.peft_version
                 else "no peft_version (PEFT <0.18 or another writer)"]
        if self.megatron_bridge:
            parts.append("Megatron-Bridge's config fingerprint (its exact key set, target_parameters)")
        if self.b_layout or self.b_layouts:
            marks = {**({"all": self.b_layout} if self.b_layout else {}), **self.b_layouts}
            parts.append("Unsloth's lora_B_layout marker: " + ", ".join(f"{k} {v}" for k, v in marks.items()))
        return "; ".join(parts)

    def b_order(self, param: str) -> str:
        """RANK_MAJOR (PEFT, expert-fastest) or GROUPED_BY_EXPERT for the B columns of target parameter `param`."""
        if self.megatron_bridge:
            return GROUPED_BY_EXPERT
        return self.b_layouts.get(param) or self.b_layout or RANK_MAJOR

    def b_source(self, param: str) -> str:
        """Where b_order's answer comes from, for inspect."""
        if self.megatron_bridge:
            return "Megatron-Bridge's packing"
        if param in self.b_layouts or self.b_layout:
            return "Unsloth's lora_B_layout marker"
        return "PEFT's packing; no Unsloth marker, so an Unsloth adapter trained before unsloth-zoo#1269 reads as PEFT"


def _behaviours(path: Path, version) -> tuple[str, ...]:
    """PEFT's did_swap rules a peft_version allows: one for a release; two for a dev build between the releases that
    changed the rule (0.18.2.dev0 / 0.19.0.devN span #3083, 0.19.1.dev0 spans #3165: a commit hash cannot be dated
    here); all three when absent (PEFT <0.18 or another writer)."""
    if version is None:
        return ("0.18", "0.19.0", "0.19.1")
    m = VERSION.match(version) if isinstance(version, str) else None
    if m is None:
        raise InputError(path, f"expected a PEFT version such as \"0.19.1\" or \"0.19.1.dev0@abc123\", found "
                         f"{version!r}", key="peft_version")
    release, pre = tuple(int(x) for x in m.groups()[:3]), m[4] is not None
    if release < (0, 18, 2):
        return ("0.18",)
    if release < (0, 19, 0) or (release == (0, 19, 0) and pre):
        return ("0.18", "0.19.0")
    if release == (0, 19, 0):
        return ("0.19.0",)
    if release == (0, 19, 1) and pre:
        return ("0.19.0", "0.19.1")
    return ("0.19.1",)


def _unsloth_marker(path: Path, raw: dict) -> tuple[str | None, dict[str, str]]:
    """(flat lora_B_layout, {parameter: lora_B_layout}) of Unsloth's #1232 marker; "mixed" (wrappers of one parameter
    name trained both ways) is refused: which layers are which is not recorded."""
    flat, detail = raw.get("lora_B_layout"), raw.get("unsloth_fused_expert_lora")
    if flat is not None and flat not in B_ORDERS:
        raise InputError(path, f"expected one of {', '.join(B_ORDERS)}, found {flat!r}", key="lora_B_layout")
    per_param = {}
    if detail is not None:
        params = detail.get("parameters") if isinstance(detail, dict) else None
        if not isinstance(params, dict) or not all(isinstance(v, dict) for v in params.values()):
            raise InputError(path, "expected {\"parameters\": {name: {\"lora_B_layout\": ...}}}",
                             key="unsloth_fused_expert_lora")
        for name, entry in params.items():
            value = entry.get("lora_B_layout")
            if value == "mixed":
                raise UnsupportedError(path, f"lora_B_layout \"mixed\" for {name}: its layers were trained with "
                                       "different B column orders, which the file does not record per layer",
                                       key="unsloth_fused_expert_lora")
            if value not in B_ORDERS:
                raise InputError(path, f"parameters.{name}.lora_B_layout: expected one of {', '.join(B_ORDERS)}, "
                                 f"found {value!r}", key="unsloth_fused_expert_lora")
            if flat is not None and value != flat:
                raise InputError(path, f"parameters.{name}.lora_B_layout {value!r} contradicts lora_B_layout "
                                 f"{flat!r}", key="unsloth_fused_expert_lora")
            per_param[name] = value
    return flat, per_param


def orientation(writer: Writer, transposed: bool) -> tuple[str, ...]:
    """The orientations (STANDARD / SWAPPED) the writer may have used on a parameter whose transformers-5 storage is
    [E, in, out] (`transposed`) or [E, out, in]. PEFT first reads the parameter as [E, in, out] and swaps where
    did_swap: A is on the true output side where did_swap equals is_transposed."""
    if writer.megatron_bridge:
        return (SWAPPED,)
    did_swap = {"0.18": False, "0.19.0": transposed, "0.19.1": not transposed}
    return tuple(dict.fromkeys(SWAPPED if did_swap[b] == transposed else STANDARD for b in writer.behaviours))


def decide(writer: Writer, transposed: bool, by_shape: tuple[str, ...], path: Path, key: str) -> tuple[str, str]:
    """(orientation, how it was decided) from what the version allows and what the shapes fit; a contradiction is an
    InputError naming both; a square parameter with either orientation allowed reads as PEFT's current standard."""
    allowed = orientation(writer, transposed)
    fits = [o for o in by_shape if o in allowed]
    version = f"peft_version {writer.peft_version}" if writer.peft_version else "no peft_version"
    rules = ", ".join(_BEHAVIOURS_TEXT[b] for b in writer.behaviours)
    if not fits:
        who = "Megatron-Bridge's export (its config's key set)" if writer.megatron_bridge else f"{version} ({rules})"
        raise InputError(path, f"the shapes are PEFT's {by_shape[0]} layout (A on the "
                         f"{'output' if by_shape[0] == SWAPPED else 'input'} side), but {who} writes "
                         f"{' or '.join(allowed)} on this model; was the config edited?", key=key)
    if writer.megatron_bridge:
        return SWAPPED, "Megatron-Bridge's config fingerprint (no peft_version, its exact key set): swapped"
    if len(fits) == 1:
        why = "the shapes" if len(by_shape) == 1 else version
        return fits[0], f"{fits[0]}, decided by {why} ({rules})"
    return STANDARD, (f"AMBIGUOUS: a square expert parameter and {version} ({rules}): read as PEFT >=0.19.1's "
                      "standard orientation; if the adapter was written by PEFT 0.17-0.19.0 every expert delta is "
                      "transposed (compare's adapter-applied gate shows a mis-read as a large k2)")
