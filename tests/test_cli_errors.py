"""`lora-eval inspect`: the report on good input, and one `error: <file>: <key>: <problem>` line (exit 2) on bad input.

Every bad-input case is built from a good artefact (a tiny Qwen3-MoE checkpoint, PEFT and hand-written
adapters) by one edit, so the only thing wrong is the thing under test. The CLI runs in-process through
click's CliRunner; one test runs the installed console script to check the exit code and stderr end to end.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import pstats
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from peft import LoraConfig, get_peft_model
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from lora_eval.cli import cli
from lora_eval.tasks.inspect_adapters import COLUMNS, inspect_adapters
from tests.builders import load_hf, save_random_model, save_random_peft_adapter, write_expert_adapter
from tests.cli_checks import assert_input_error, assert_no_traceback
from tests.conftest import MOE_OVERRIDES

PREFIX = "base_model.model."
NUM_EXPERTS = 6  # tiny_qwen3_moe_config
MOE_LAYERS = {0, 2}  # layer 1 is dense (mlp_only_layers=[1])
NUM_LAYERS = 3


# ---- helpers ---------------------------------------------------------------------------------------


def inspect(model_dir, **adapters):
    """Run `lora-eval inspect` in-process; stdout and stderr kept apart (click >= 8.2)."""
    args = ["inspect", "--model", str(model_dir)]
    for name, path in adapters.items():
        args += ["--adapter", f"{name}={path}"]
    return CliRunner().invoke(cli, args)




def copy_dir(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data, indent=2))


def truncate(path: Path, size: int) -> None:
    data = path.read_bytes()
    assert 0 <= size < len(data)
    path.write_bytes(data[:size])


def lora_tensor_groups(adapter_dir: Path) -> dict[tuple[str, str], dict]:
    """From the adapter file alone: (kind, part) -> {params, layers, ranks} over its lora_A / lora_B tensors.

    Parts follow the report: dense targets are "dense"; expert parts come from the key's module name
    (PEFT ParamWrapper: `experts.base_layer` = gate_up, `experts` = down; 3D: w1/w3/w2 = gate/up/down).
    """
    expert_part = {"experts.base_layer": "gate_up", "experts": "down", "experts.w1": "gate", "experts.w3": "up",
                   "experts.w2": "down", "experts.gate_up_proj": "gate_up", "experts.down_proj": "down"}
    groups: dict[tuple[str, str], dict] = {}
    with safe_open(str(adapter_dir / "adapter_model.safetensors"), framework="pt") as f:
        for key in f.keys():
            m = re.fullmatch(r"base_model\.model\.model\.layers\.(\d+)\.(.+)\.lora_([AB])\.weight", key)
            assert m, f"unexpected key in a test adapter: {key}"
            layer, module, side = int(m[1]), m[2], m[3]
            shape = f.get_slice(key).get_shape()
            if ".experts" in module:
                tail = module[module.index("experts"):]
                kind, part = "experts", f"experts.{expert_part[tail]}"
                rank = (shape[0] // NUM_EXPERTS if len(shape) == 2 else shape[1]) if side == "A" else None
            else:
                kind, part = module.rsplit(".", 1)[-1], "dense"
                rank = shape[0] if side == "A" else None
            g = groups.setdefault((kind, part), dict(params=0, layers=set(), ranks=set()))
            g["params"] += int(torch.Size(shape).numel())
            g["layers"].add(layer)
            if rank is not None:
                g["ranks"].add(rank)
    return groups


def parse_report(stdout: str) -> dict[str, dict]:
    """The `inspect` text output -> {adapter: {layout, total, rows: {(kind, part): (layers, rank, scaling, params)}}}."""
    adapters, current = {}, None
    for line in stdout.splitlines():
        m = re.fullmatch(r"adapter (\S+): layout (.+), ([\d,]+) parameters", line)
        if m:
            current = adapters[m[1]] = dict(layout=m[2], total=int(m[3].replace(",", "")), rows={})
            continue
        fields = line.split()
        if current is None or not fields or fields[0] in ("kind", "writer:", "read:"):  # header, writer lines
            continue
        kind, part, layers, rank, scaling, params = fields
        current["rows"][(kind, part)] = (int(layers), rank, scaling, int(params))
    return adapters


# ---- artefacts, built once per module ----------------------------------------------------------------


class Artefacts:
    """Good inputs for the tests to copy and break."""


@pytest.fixture(scope="module")
def art(tmp_path_factory, moe_model, session_seed) -> Artefacts:
    root = tmp_path_factory.mktemp("cli_errors")
    a = Artefacts()
    a.model = moe_model
    s = session_seed
    # the good pair for test A: PEFT all-linear (PEFT 0.21 adds the experts as target_parameters)
    a.peft_all = save_random_peft_adapter(moe_model, root / "peft_all", seed=s + 1, r=4, lora_alpha=8,
                                          target_modules="all-linear")
    write_expert_adapter(moe_model, root / "split_shared", layout="split_3d", seed=s + 2, rank=2, alpha=6,
                         shared_outer=True)
    a.split_shared = root / "split_shared"
    # a small dense-target PEFT adapter, the base of most config / file edits
    a.peft_qv = save_random_peft_adapter(moe_model, root / "peft_qv", seed=s + 3, r=4, lora_alpha=8,
                                         target_modules=["q_proj", "v_proj"])
    # models that differ from ours in one way, and adapters made for them
    wide = save_random_model(root / "wide_model", "qwen3_moe", seed=s + 4, hidden_size=48, **MOE_OVERRIDES)
    a.wide_adapter = save_random_peft_adapter(wide, root / "wide_adapter", seed=s + 5, r=4, lora_alpha=8,
                                              target_modules=["q_proj", "v_proj"])
    eight = save_random_model(root / "eight_model", "qwen3_moe", seed=s + 6, num_experts=8, **MOE_OVERRIDES)
    write_expert_adapter(eight, root / "eight_fused", layout="fused_3d", seed=s + 7, rank=4, alpha=8)
    a.eight_fused = root / "eight_fused"
    dense = save_random_model(root / "dense_qwen3", "qwen3", seed=s + 8)
    a.dense_adapter = save_random_peft_adapter(dense, root / "dense_adapter", seed=s + 9, r=4, lora_alpha=8,
                                               target_modules=["q_proj", "gate_proj", "up_proj", "down_proj"])
    # a real DoRA adapter written by PEFT (zero-init B is fine: only the format matters here)
    dora = get_peft_model(load_hf(moe_model), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], use_dora=True))
    dora.save_pretrained(root / "dora")
    a.dora = root / "dora"
    a.sharded_model = save_random_model(root / "sharded_model", "qwen3_moe", seed=session_seed,
                                        max_shard_size="20KB", **MOE_OVERRIDES)
    return a


# ---- A. good input ---------------------------------------------------------------------------------------


def _expected_rows(adapter_dir: Path) -> dict[tuple[str, str], tuple[int, str, str, int]]:
    """(kind, part) -> (layers, rank, scaling, params), with ranks and scalings from adapter_config.json."""
    config = json.loads((adapter_dir / "adapter_config.json").read_text())

    def rank_alpha(name: str) -> tuple[int, float]:
        r = next((v for p, v in (config.get("rank_pattern") or {}).items() if re.match(rf"(.*\.)?({p})$", name)),
                 config["r"])
        alpha = next((v for p, v in (config.get("alpha_pattern") or {}).items()
                      if re.match(rf"(.*\.)?({p})$", name)), config["lora_alpha"])
        return r, alpha

    rows = {}
    for (kind, part), g in lora_tensor_groups(adapter_dir).items():
        name = {"experts.gate_up": "model.layers.0.mlp.experts.gate_up_proj",
                "experts.down": "model.layers.0.mlp.experts.down_proj"}.get(part, f"model.layers.0.x.{kind}")
        r, alpha = rank_alpha(name)
        assert g["ranks"] == {r}, (kind, part, g["ranks"], r)
        rows[(kind, part)] = (len(g["layers"]), f"{r:.6g}", f"{alpha / r:.6g}", g["params"])
    return rows


def test_inspect_good_input_report(art):
    result = inspect(art.model, peft=art.peft_all, split=art.split_shared)
    assert_no_traceback(result)
    assert result.exit_code == 0, (result.stdout, result.stderr, result.exception)
    assert result.stderr == ""
    assert result.stdout.splitlines()[0] == \
        f"model: qwen3_moe, {NUM_LAYERS} layers, hidden 32, {NUM_EXPERTS} experts top-2 in 2 layers, vocab 96"
    report = parse_report(result.stdout)
    assert list(report) == ["peft", "split"]
    assert report["peft"]["layout"] == "PEFT target_parameters"
    assert report["split"]["layout"] == "shared-outer 3D"

    peft, split = report["peft"]["rows"], report["split"]["rows"]
    # fixed numbers first: r=4, alpha=8 -> scaling 2 on q_proj in every layer; experts only in the MoE layers
    assert peft[("q_proj", "dense")][:3] == (NUM_LAYERS, "4", "2")
    assert peft[("experts", "experts.down")][:3] == (len(MOE_LAYERS), "4", "2")
    assert peft[("experts", "experts.gate_up")][0] == len(MOE_LAYERS)
    # split_3d shared-outer: r=2, alpha=6 -> scaling 3, gate / up / down in both MoE layers
    assert set(split) == {("experts", "experts.gate"), ("experts", "experts.up"), ("experts", "experts.down")}
    for row in split.values():
        assert row[:3] == (len(MOE_LAYERS), "2", "3")
    # then everything against the files themselves: params = sum of numel of the LoRA A/B tensors
    assert peft == _expected_rows(art.peft_all)
    assert split == _expected_rows(art.split_shared)
    for name, adapter_dir in (("peft", art.peft_all), ("split", art.split_shared)):
        total = sum(t.numel() for t in load_file(str(adapter_dir / "adapter_model.safetensors")).values())
        assert report[name]["total"] == total


def test_inspect_adapters_dataframe(art):
    summary, table = inspect_adapters(art.model, {"peft": art.peft_all, "split": art.split_shared})
    assert summary == dict(model_type="qwen3_moe", layers=NUM_LAYERS, hidden=32, experts=NUM_EXPERTS, top_k=2,
                           sparse_layers=len(MOE_LAYERS), vocab=96, quantization=None,
                           linear_attention_layers=0)
    assert list(table.columns) == COLUMNS
    for name, adapter_dir, layout in (("peft", art.peft_all, "PEFT target_parameters"),
                                      ("split", art.split_shared, "shared-outer 3D")):
        rows = table[table["adapter"] == name]
        assert set(rows["layout"]) == {layout}
        got = {(r.kind, r.part): (int(r.layers), r.rank, r.scaling, int(r.params)) for r in rows.itertuples()}
        assert got == _expected_rows(adapter_dir)
    q = table[(table["adapter"] == "peft") & (table["kind"] == "q_proj")].iloc[0]
    assert (q["layers"], q["rank"], q["scaling"]) == (NUM_LAYERS, "4", "2")
    experts = table[(table["adapter"] == "split") & (table["kind"] == "experts")]
    assert set(experts["layers"]) == {len(MOE_LAYERS)}


# ---- B. bad input: one line, exit 2 ----------------------------------------------------------------------


def test_missing_adapter_weights_file(art, tmp_path):
    adapter = copy_dir(art.peft_qv, tmp_path / "no_weights_adapter")
    (adapter / "adapter_model.safetensors").unlink()
    line = assert_input_error(inspect(art.model, a=adapter), str(adapter), "adapter_model.safetensors")
    assert "missing" in line


def test_missing_adapter_folder(art, tmp_path):
    assert_input_error(inspect(art.model, a=tmp_path / "nowhere"), str(tmp_path / "nowhere"), "not found")


def test_missing_adapter_config(art, tmp_path):
    adapter = copy_dir(art.peft_qv, tmp_path / "no_config")
    (adapter / "adapter_config.json").unlink()
    assert_input_error(inspect(art.model, a=adapter), str(adapter / "adapter_config.json"), "not found")


def test_adapter_config_not_json(art, tmp_path):
    adapter = copy_dir(art.peft_qv, tmp_path / "bad_json")
    (adapter / "adapter_config.json").write_text('{"r": 4, ')
    assert_input_error(inspect(art.model, a=adapter), str(adapter / "adapter_config.json"), "JSON")


def test_wrong_hidden_size(art):
    # made for hidden 48: q_proj lora_A is [4, 48] where this model needs [r, 32]
    key = f"{PREFIX}model.layers.0.self_attn.q_proj.lora_A.weight"
    line = assert_input_error(inspect(art.model, a=art.wide_adapter),
                              str(art.wide_adapter / "adapter_model.safetensors"), key)
    assert "[4, 48]" in line and "expected [r, 32]" in line


def test_wrong_expert_count(art):
    # fused_3d made for 8 experts: an A is [8, 4, in] where this model takes [6 or 1, r, in]
    line = assert_input_error(inspect(art.model, a=art.eight_fused),
                              str(art.eight_fused / "adapter_model.safetensors"),
                              f"{PREFIX}model.layers.0.mlp.experts.")
    key = line.split(": ")[2]
    assert re.fullmatch(rf"{re.escape(PREFIX)}model\.layers\.0\.mlp\.experts\.(gate_up|down)_proj\.lora_A\.weight",
                        key), line
    assert re.search(r"shape \[8, 4, (32|8)\], expected \[6 or 1, r, (32|8)\]", line), line


@pytest.mark.parametrize("change, key, shapes", [
    (dict(experts=8), "model.layers.0.mlp.gate.weight", ("[6, 32]", "[8, 32]")),
    (dict(experts=4), "model.layers.0.mlp.gate.weight", ("[6, 32]", "[4, 32]")),
    (dict(hidden_size=48), "model.embed_tokens.weight", ("[96, 32]", "[96, 48]")),
    (dict(moe_intermediate_size=16), "model.layers.0.mlp.experts.0.gate_proj.weight", ("[8, 32]", "[16, 32]")),
])
def test_config_disagrees_with_weights(art, tmp_path, change, key, shapes):
    model = copy_dir(art.model, tmp_path / "edited_model")
    config = json.loads((model / "config.json").read_text())
    if "experts" in change:  # edit the expert-count field the file has (transformers 5 writes num_local_experts)
        field = next(k for k in ("num_experts", "num_local_experts") if k in config)
        change = {field: change["experts"]}
    edit_json(model / "config.json", **change)
    line = assert_input_error(inspect(model), str(model / "model.safetensors"), key)
    for shape in shapes:
        assert shape in line


def test_config_with_fewer_layers_than_weights(art, tmp_path):
    # the weights of layer 2 are left over: named as not a weight of the model config.json describes
    model = copy_dir(art.model, tmp_path / "two_layers")
    edit_json(model / "config.json", num_hidden_layers=2)
    assert_input_error(inspect(model), str(model / "model.safetensors"), "model.layers.2.", "config.json")


def test_unknown_target_module(art, tmp_path):
    adapter = copy_dir(art.peft_qv, tmp_path / "foo_target")
    edit_json(adapter / "adapter_config.json", target_modules=["q_proj", "foo_proj"])
    assert_input_error(inspect(art.model, a=adapter), str(adapter / "adapter_config.json"), "target_modules",
                       "foo_proj")


def test_dora_config_refused(art):
    assert json.loads((art.dora / "adapter_config.json").read_text())["use_dora"] is True
    line = assert_input_error(inspect(art.model, a=art.dora), str(art.dora / "adapter_config.json"), "use_dora")
    assert "DoRA" in line


def test_dora_magnitude_key_refused(art, tmp_path):
    # the config no longer says DoRA, but the weights still carry PEFT's magnitude vectors
    adapter = copy_dir(art.dora, tmp_path / "dora_hidden")
    edit_json(adapter / "adapter_config.json", use_dora=False)
    keys = [k for k in load_file(str(adapter / "adapter_model.safetensors")) if "lora_magnitude_vector" in k]
    assert keys
    line = assert_input_error(inspect(art.model, a=adapter), str(adapter / "adapter_model.safetensors"),
                              "lora_magnitude_vector")
    assert any(k in line for k in keys), line


@pytest.mark.parametrize("cut", ["half", "header"])
def test_truncated_adapter_file(art, tmp_path, cut):
    adapter = copy_dir(art.split_shared, tmp_path / "truncated_adapter")
    weights = adapter / "adapter_model.safetensors"
    truncate(weights, weights.stat().st_size // 2 if cut == "half" else 6)
    line = assert_input_error(inspect(art.model, a=adapter), str(weights))
    assert "truncated" in line or "unreadable" in line or "not a readable" in line


def test_truncated_model_file(art, tmp_path):
    model = copy_dir(art.model, tmp_path / "truncated_model")
    weights = model / "model.safetensors"
    truncate(weights, weights.stat().st_size // 2)
    line = assert_input_error(inspect(model), str(weights))
    assert "truncated" in line


def test_truncated_model_shard(art, tmp_path):
    model = copy_dir(art.sharded_model, tmp_path / "truncated_shards")
    shards = sorted(model.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2
    shard = shards[1]
    truncate(shard, shard.stat().st_size // 2)
    line = assert_input_error(inspect(model), str(shard))
    assert "truncated" in line


def test_sharded_model_missing_shard(art, tmp_path):
    model = copy_dir(art.sharded_model, tmp_path / "lost_shard")
    shard = sorted(model.glob("model-*-of-*.safetensors"))[-1]
    shard.unlink()
    assert_input_error(inspect(model), str(shard), "not found")


def test_adapter_for_dense_architecture(art):
    # a Qwen3 (dense) adapter: layer 0 has mlp.gate_proj/up_proj/down_proj there, experts here
    line = assert_input_error(inspect(art.model, a=art.dense_adapter),
                              str(art.dense_adapter / "adapter_model.safetensors"), f"{PREFIX}model.layers.0.mlp.")
    key = line.split(": ")[2]
    assert re.fullmatch(rf"{re.escape(PREFIX)}model\.layers\.0\.mlp\.(gate|up|down)_proj\.lora_[AB]\.weight", key), line
    assert "another architecture" in line


class _Payload:
    """Unpickling this runs code (creates a marker file): what a weights_only load must refuse."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('executed')",)


def _write_pickled_bin(adapter: Path, marker: Path, template: Path) -> Path:
    (adapter / "adapter_model.safetensors").unlink(missing_ok=True)
    tensors = load_file(str(template / "adapter_model.safetensors"))
    key = next(iter(tensors))
    path = adapter / "adapter_model.bin"
    torch.save({key: tensors[key], "extra": _Payload(marker)}, path)
    return path


def test_pickled_bin_refused_without_executing(art, tmp_path):
    # the payload is live: an unsafe load of an identical file (own marker) does run it
    control = tmp_path / "control"
    control.mkdir()
    control_marker = tmp_path / "control_marker"
    torch.load(_write_pickled_bin(control, control_marker, art.peft_qv), weights_only=False)
    assert control_marker.read_text() == "executed"

    adapter = copy_dir(art.peft_qv, tmp_path / "pickled")
    marker = tmp_path / "marker"
    binary = _write_pickled_bin(adapter, marker, art.peft_qv)
    line = assert_input_error(inspect(art.model, a=adapter), str(binary))
    assert "refused" in line
    assert not marker.exists(), "unpickling ran code from the adapter file"


def test_bin_with_non_tensor_values_refused(art, tmp_path):
    adapter = copy_dir(art.peft_qv, tmp_path / "bin_list")
    (adapter / "adapter_model.safetensors").unlink()
    torch.save({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": [1, 2, 3]},
               adapter / "adapter_model.bin")
    assert_input_error(inspect(art.model, a=adapter), str(adapter / "adapter_model.bin"), "tensor")


def test_truncated_adapter_bin(art, tmp_path):
    # the same tensors as a plain torch.save .bin (which loads: see the check below), cut in half
    adapter = copy_dir(art.peft_qv, tmp_path / "truncated_bin")
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    (adapter / "adapter_model.safetensors").unlink()
    binary = adapter / "adapter_model.bin"
    torch.save(tensors, binary)
    assert inspect(art.model, a=adapter).exit_code == 0
    truncate(binary, binary.stat().st_size // 2)
    assert_input_error(inspect(art.model, a=adapter), str(binary))


# Values of the wrong type or form in fields that are read: still one line naming the file and the key.
@pytest.mark.parametrize("key, value", [
    ("lora_alpha", "abc"),
    ("lora_alpha", None),
    ("layers_to_transform", "abc"),
    ("rank_pattern", [1, 2]),
    ("rank_pattern", {"q_proj": "x"}),
    ("rank_pattern", {"[": 4}),
    ("alpha_pattern", {"q_proj(": 4}),
], ids=["alpha-str", "alpha-null", "layers_to_transform-str", "rank_pattern-list", "rank_pattern-value-str",
        "rank_pattern-bad-regex", "alpha_pattern-bad-regex"])
def test_malformed_adapter_config_value(art, tmp_path, key, value):
    adapter = copy_dir(art.peft_qv, tmp_path / "malformed")
    edit_json(adapter / "adapter_config.json", **{key: value})
    assert_input_error(inspect(art.model, a=adapter), str(adapter / "adapter_config.json"), key)


@pytest.mark.parametrize("key, value", [
    ("hidden_size", "abc"),
    ("rms_norm_eps", "x"),
    ("mlp_only_layers", 1),
    ("num_attention_heads", 0),
], ids=["hidden_size-str", "rms_norm_eps-str", "mlp_only_layers-int", "num_attention_heads-0"])
def test_malformed_model_config_value(art, tmp_path, key, value):
    model = copy_dir(art.model, tmp_path / "malformed_model")
    edit_json(model / "config.json", **{key: value}, **({"head_dim": None} if key == "num_attention_heads" else {}))
    assert_input_error(inspect(model), str(model / "config.json"), key)


def test_unsupported_rope_type(art, tmp_path):
    # transformers 5 writes `rope_parameters`; the error must name this config.json (full path) and that key
    model = copy_dir(art.model, tmp_path / "yarn")
    config = json.loads((model / "config.json").read_text())
    assert "rope_parameters" in config and "rope_scaling" not in config
    edit_json(model / "config.json", rope_parameters={"rope_type": "yarn", "factor": 2.0, "rope_theta": 10000.0})
    assert_input_error(inspect(model), str(model / "config.json"), "rope_parameters", "yarn")


@pytest.mark.parametrize("key, value, name", [
    ("lora_bias", True, "lora_bias"),
    ("use_qalora", True, "QA-LoRA"),
    ("bias", "all", "bias"),
    ("fan_in_fan_out", True, "fan_in_fan_out"),
    ("layer_replication", [[0, 2]], "layer replication"),
    ("peft_type", "LOHA", "LOHA"),
    ("some_future_setting", 3, "unknown setting"),
])
def test_unsupported_config_feature(art, tmp_path, key, value, name):
    adapter = copy_dir(art.peft_qv, tmp_path / "feature")
    edit_json(adapter / "adapter_config.json", **{key: value})
    line = assert_input_error(inspect(art.model, a=adapter), str(adapter / "adapter_config.json"), f": {key}: ")
    assert name in line


def test_lora_bias_tensor_refused(art, tmp_path):
    adapter = copy_dir(art.peft_qv, tmp_path / "bias_tensor")
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    key = f"{PREFIX}model.layers.0.self_attn.q_proj.lora_B.bias"
    tensors[key] = torch.zeros(32)
    save_file(tensors, str(adapter / "adapter_model.safetensors"))
    assert_input_error(inspect(art.model, a=adapter), str(adapter / "adapter_model.safetensors"), key, "lora_bias")


@pytest.mark.parametrize("source, weights_rank, key", [
    ("peft_qv", 4, f"{PREFIX}model.layers.0.self_attn.q_proj.lora_A.weight"),
    ("split_shared", 2, f"{PREFIX}model.layers.0.mlp.experts.w1.lora_A.weight"),
])
def test_rank_mismatch(art, tmp_path, source, weights_rank, key):
    adapter = copy_dir(getattr(art, source), tmp_path / "rank8")
    edit_json(adapter / "adapter_config.json", r=8)
    line = assert_input_error(inspect(art.model, a=adapter), str(adapter / "adapter_model.safetensors"), key)
    assert f"rank {weights_rank}" in line and "r=8" in line


def test_missing_lora_b(art, tmp_path):
    adapter = copy_dir(art.peft_qv, tmp_path / "lonely_a")
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    del tensors[f"{PREFIX}model.layers.1.self_attn.v_proj.lora_B.weight"]
    save_file(tensors, str(adapter / "adapter_model.safetensors"))
    assert_input_error(inspect(art.model, a=adapter), str(adapter / "adapter_model.safetensors"),
                       f"{PREFIX}model.layers.1.self_attn.v_proj.lora_B.weight", "missing")


def test_missing_model_folder(tmp_path):
    assert_input_error(inspect(tmp_path / "no_model"), str(tmp_path / "no_model"), "not found")


def test_unsupported_model_type(art, tmp_path):
    model = copy_dir(art.model, tmp_path / "deepseek_v2")
    edit_json(model / "config.json", model_type="deepseek_v2", architectures=["DeepseekV2ForCausalLM"])
    assert_input_error(inspect(model), str(model / "config.json"), "model_type", "deepseek_v2")


@pytest.mark.parametrize("value", ["no_equals_sign", "=dir", "name="])
def test_malformed_adapter_option(art, value):
    result = CliRunner().invoke(cli, ["inspect", "--model", str(art.model), "--adapter", value])
    assert_no_traceback(result)
    assert result.exit_code == 2, (result.stdout, result.stderr)
    assert "--adapter" in result.stderr and "NAME=PATH" in result.stderr and value in result.stderr


def test_adapter_name_given_twice(art):
    result = CliRunner().invoke(cli, ["inspect", "--model", str(art.model), "--adapter", f"a={art.peft_qv}",
                                      "--adapter", f"a={art.split_shared}"])
    assert_no_traceback(result)
    assert result.exit_code == 2
    assert "given twice" in result.stderr


def test_console_script_end_to_end(art):
    """The installed `lora-eval` script: exit 2 and exactly one stderr line, from a real process."""
    exe = shutil.which("lora-eval") or str(Path(sys.executable).parent / "lora-eval")
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([exe, "inspect", "--model", str(art.model), "--adapter", f"wide={art.wide_adapter}"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stdout + proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"error: {art.wide_adapter / 'adapter_model.safetensors'}: "
                               f"{PREFIX}model.layers.0.self_attn.q_proj.lora_A.weight: ")


def test_console_script_loses_nothing_on_its_way_out(art):
    """main() ends the process itself (os._exit) once the command returns; nothing is lost on the way: its output (a
    pipe: block-buffered) is all there, the exit handlers ran (atexit: the process group's teardown lives there),
    the command's exit code is kept. (The time this saves is measured, not tested: BENCHMARKS-history section 13.)"""
    probe = ("import atexit, sys\n"
             "import lora_eval.cli as cli\n"
             "atexit.register(lambda: print('exit handler ran'))\n"
             "sys.argv = ['lora-eval'] + sys.argv[1:]\n"
             "cli.main()\n"
             "print('not reached')\n")
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    good = subprocess.run([sys.executable, "-c", probe, "inspect", "--model", str(art.model),
                           "--adapter", f"peft={art.peft_all}"], capture_output=True, text=True, timeout=120, env=env)
    assert good.returncode == 0, good.stderr
    lines = good.stdout.splitlines()
    assert lines[0].startswith("model: qwen3_moe,") and lines[-1] == "exit handler ran"
    assert "not reached" not in good.stdout and len(lines) > 5
    bad = subprocess.run([sys.executable, "-c", probe, "inspect", "--model", str(art.model), "--adapter",
                          f"wide={art.wide_adapter}"], capture_output=True, text=True, timeout=120, env=env)
    assert bad.returncode == 2 and bad.stdout == "exit handler ran\n"
    assert bad.stderr.startswith("error: ") and len(bad.stderr.splitlines()) == 1


def test_a_profiled_command_ends_the_usual_way(tmp_path):
    """Under cProfile (which writes its file once the program has returned) main() does not end the process early:
    the profile is written and the exit code kept."""
    out = tmp_path / "profile.out"
    proc = subprocess.run([sys.executable, "-m", "cProfile", "-o", str(out), "-m", "lora_eval", "--version"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "version" in proc.stdout and out.stat().st_size > 0
    assert any("main" in name for _, _, name in pstats.Stats(str(out)).stats)
