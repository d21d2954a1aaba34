"""Bad adapter inputs (issue 42, classes 1, 2 and 6): every one refused with exit 2 and one line naming the file and
the key, through the CLI (inspect for every case: it reads the adapter against a shapes-only model; compare and
dump-reference for one case of each class), never a silent wrong answer.

1. settings: layers_to_transform / layers_pattern / exclude_modules / modules_to_save decide the targets by PEFT's
   rules in every layout (dense, per-expert 2D, fused 3D, shared-outer 3D, PEFT target_parameters, embedding,
   modules_to_save); a config PEFT refuses, or one that targets nothing, is refused; weights for a module the
   config leaves out are refused; settings that change the base model (ensure_weight_tying, PiSSA-like inits) too;
2. numbers: a NaN or inf in any LoRA tensor of any layout (also a .bin), an int32 or bool tensor, a float64 value
   beyond float32, lora_alpha / alpha_pattern NaN or Infinity, a huge r, a scaling that overflows float32;
3. messages: a pickled .bin is refused without torch's advice to unpickle it; a truncated .bin is named.

Every bad input is a good artefact with one edit. Artefacts are built once per module.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from lora_eval.adapters import load_adapter
from lora_eval.cli import cli
from lora_eval.models import load_model
from lora_eval.tasks.dump_reference import dump_reference
from tests.builders import (
    random_sequences,
    save_random_model,
    save_random_peft_adapter,
    write_dense_adapter,
    write_expert_adapter,
)
from tests.cli_checks import assert_input_error

VOCAB = 96  # tests.builders' tiny vocabulary
LAYOUTS = {  # name -> write_expert_adapter kwargs (layers 0 and 2 are the MoE layers of the session model)
    "per-expert-2d": dict(layout="per_expert_2d"),
    "fused-3d": dict(layout="fused_3d"),
    "shared-outer-3d": dict(layout="split_3d", shared_outer=True),
    "peft-target-parameters": dict(layout="peft_target_parameters"),
}


class Artefacts:
    """Good inputs for the tests to copy and break."""


@pytest.fixture(scope="module")
def art(tmp_path_factory, moe_model, session_seed) -> Artefacts:
    root = tmp_path_factory.mktemp("adapter_inputs")
    s = session_seed
    a = Artefacts()
    a.root, a.model = root, moe_model
    # dense q/v, an embedding LoRA (with PEFT's copy of the base embedding) and a modules_to_save norm, from PEFT
    a.peft = save_random_peft_adapter(moe_model, root / "peft", seed=s + 1, r=2, lora_alpha=4,
                                      target_modules=["q_proj", "v_proj", "embed_tokens"], modules_to_save=["q_norm"])
    a.dense = write_dense_adapter(moe_model, root / "dense", modules=["q_proj", "v_proj"], seed=s + 2).adapter_dir
    a.layouts = {name: write_expert_adapter(moe_model, root / name, seed=s + 3 + i, **kwargs).adapter_dir
                 for i, (name, kwargs) in enumerate(LAYOUTS.items())}
    a.shapes = load_model(moe_model, device="meta")
    # a trainer reference for adapter "x" (the PEFT adapter), so compare reaches the adapter it is given
    ids = random_sequences(4, VOCAB, seed=s + 9, min_len=4, max_len=9)
    a.prompts = root / "prompts.jsonl"
    a.prompts.write_text("".join(json.dumps(dict(sample_id=f"s{i}", adapter="x" if i % 2 else None, input_ids=seq))
                                 + "\n" for i, seq in enumerate(ids)))
    a.reference = root / "reference.parquet"
    dump_reference(moe_model, {"x": a.peft}, a.prompts, a.reference, quiet=True)
    return a


# ---- helpers -------------------------------------------------------------------------------------------------


def run_cli(*args) -> object:
    return CliRunner().invoke(cli, [str(x) for x in args])


def inspect(art, adapter: Path):
    return run_cli("inspect", "--model", art.model, "--adapter", f"x={adapter}")


def compare(art, adapter: Path, out: Path):
    return run_cli("compare", "--model", art.model, "--adapter", f"x={adapter}", "--reference", art.reference,
                   "--out", out, "--quiet")


def dump(art, adapter: Path, out: Path):
    return run_cli("dump-reference", "--model", art.model, "--adapter", f"x={adapter}", "--prompts", art.prompts,
                   "--out", out, "--quiet")


def copy_of(src: Path, dst: Path, **config) -> Path:
    """A copy of the adapter folder with `config` merged into its adapter_config.json."""
    shutil.copytree(src, dst)
    path = dst / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return dst


def edit_tensors(adapter: Path, edit) -> None:
    """Rewrite the adapter's safetensors file with `edit(tensors)` applied to its dict."""
    path = adapter / "adapter_model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


def first_key(adapter: Path, *parts: str) -> str:
    """The first key (sorted) of the adapter's file that contains every one of `parts`."""
    return next(k for k in sorted(load_file(str(adapter / "adapter_model.safetensors"))) if all(p in k for p in parts))


def all_three(art, adapter: Path, tmp_path: Path, *needles: str) -> None:
    """inspect, compare and dump-reference all refuse `adapter` with exit 2 and one line holding every needle;
    neither run leaves its output behind."""
    assert_input_error(inspect(art, adapter), *needles)
    assert_input_error(compare(art, adapter, tmp_path / "run"), *needles)
    assert_input_error(dump(art, adapter, tmp_path / "ref.parquet"), *needles)
    assert not (tmp_path / "run").exists() and not (tmp_path / "ref.parquet").exists()


# ---- 1. settings that decide the targets -----------------------------------------------------------------------


def test_layers_to_transform_with_a_string_target_is_refused_in_every_command(art, tmp_path):
    """The issue's case: the shared-outer adapter (target_modules "all-linear") with layers_to_transform [99] was
    applied to every layer; PEFT's LoraConfig refuses layer settings with a string target_modules."""
    bad = copy_of(art.layouts["shared-outer-3d"], tmp_path / "bad", layers_to_transform=[99])
    all_three(art, bad, tmp_path, str(bad / "adapter_config.json"), "layers_to_transform", "'all-linear'")


@pytest.mark.parametrize("config", [dict(layers_to_transform=[0]), dict(layers_pattern="layers"),
                                    dict(target_modules=r".*\.q_proj", layers_to_transform=0)])
def test_layer_settings_refused_where_peft_refuses_them(art, tmp_path, config):
    bad = copy_of(art.dense, tmp_path / "bad", **({"target_modules": "all-linear"} | config))
    key = "layers_pattern" if "layers_pattern" in config and "layers_to_transform" not in config else \
        "layers_to_transform"
    assert_input_error(inspect(art, bad), str(bad / "adapter_config.json"), key)


def test_layers_pattern_without_layers_to_transform_is_refused(art, tmp_path):
    bad = copy_of(art.dense, tmp_path / "bad", layers_pattern="layers")
    assert_input_error(inspect(art, bad), "layers_pattern", "without layers_to_transform")


# every layout with a list target_modules that covers it: the layer filter acts the same on each
LIST_TARGETS = {"dense": ["q_proj", "v_proj"], "per-expert-2d": ["experts"], "fused-3d": ["experts"],
                "shared-outer-3d": ["experts"], "peft-embedding-modules-to-save": ["q_proj", "v_proj", "embed_tokens"]}


def _layout_dir(art, name: str) -> Path:
    return {"dense": art.dense, "peft-embedding-modules-to-save": art.peft}.get(name) or art.layouts[name]


@pytest.mark.parametrize("layout", list(LIST_TARGETS))
def test_layers_to_transform_outside_the_model_targets_nothing_in_every_layout(art, tmp_path, layout):
    bad = copy_of(_layout_dir(art, layout), tmp_path / "bad", target_modules=LIST_TARGETS[layout],
                  layers_to_transform=[99])
    assert_input_error(inspect(art, bad), str(bad / "adapter_config.json"), "layers_to_transform",
                       "[99] selects no layer", "layers 0-2")


@pytest.mark.parametrize("layout", [k for k in LIST_TARGETS if k != "peft-embedding-modules-to-save"])
def test_weights_in_a_layer_left_out_are_refused_in_every_layout(art, tmp_path, layout):
    """layers_to_transform [0] on an adapter with weights in layer 2 too: PEFT would not load layer 2's weights."""
    bad = copy_of(_layout_dir(art, layout), tmp_path / "bad", target_modules=LIST_TARGETS[layout],
                  layers_to_transform=[0])
    line = assert_input_error(inspect(art, bad), str(bad / "adapter_model.safetensors"), "does not target")
    assert "model.layers." in line and "model.layers.0." not in line


def test_layers_pattern_that_names_no_layer_targets_nothing(art, tmp_path):
    bad = copy_of(art.dense, tmp_path / "bad", layers_to_transform=[0, 1, 2], layers_pattern=["h", "blocks"])
    assert_input_error(inspect(art, bad), "layers_to_transform", "layers_pattern ['h', 'blocks']")


def test_layers_filter_with_layers_pattern_acts_like_peft(art, tmp_path):
    """layers_pattern 'layers' and layers_to_transform [0, 2]: layer 1's q/v weights are refused; without them the
    adapter loads with exactly layers 0 and 2."""
    ok = copy_of(art.dense, tmp_path / "ok", layers_to_transform=[0, 2], layers_pattern="layers")
    assert_input_error(inspect(art, ok), "model.layers.1.", "does not target")
    edit_tensors(ok, lambda t: [t.pop(k) for k in list(t) if ".layers.1." in k])
    adapter = load_adapter(ok, "x", art.shapes)
    assert {t["layer"] for t in adapter.targets} == {0, 2}


def test_target_parameters_ignore_layers_to_transform_as_in_peft(art, tmp_path):
    """PEFT's _inject_parameters never filters by layer: experts of both MoE layers load, the same tensors as
    without the setting."""
    edited = copy_of(art.layouts["peft-target-parameters"], tmp_path / "edited", layers_to_transform=[0])
    plain = load_adapter(art.layouts["peft-target-parameters"], "x", art.shapes)
    with_layers = load_adapter(edited, "x", art.shapes)
    assert set(with_layers.experts) == set(plain.experts) == {f"model.layers.{i}.mlp.experts" for i in (0, 2)}
    for site, factors in plain.experts.items():
        assert torch.equal(factors.down[1], with_layers.experts[site].down[1])


@pytest.mark.parametrize("exclude", [["v_proj"], "model\\.layers\\.\\d\\.self_attn\\.v_proj"])
def test_exclude_modules_removes_targets(art, tmp_path, exclude):
    bad = copy_of(art.dense, tmp_path / "bad", exclude_modules=exclude)
    assert_input_error(inspect(art, bad), "v_proj.lora_A.weight", "does not target")
    edit_tensors(bad, lambda t: [t.pop(k) for k in list(t) if ".v_proj." in k])
    adapter = load_adapter(bad, "x", art.shapes)
    assert {t["kind"] for t in adapter.targets} == {"q_proj"}


def test_exclude_modules_on_3d_experts(art, tmp_path):
    bad = copy_of(art.layouts["fused-3d"], tmp_path / "bad", exclude_modules=["model.layers.2.mlp.experts.down_proj"])
    assert_input_error(inspect(art, bad), "model.layers.2.mlp.experts.down_proj.lora_A", "does not target")


def test_excluding_every_target_is_refused(art, tmp_path):
    bad = copy_of(art.dense, tmp_path / "bad", exclude_modules=["q_proj", "v_proj"])
    assert_input_error(inspect(art, bad), "exclude_modules", "every module")


def test_modules_to_save_excludes_lora_targets(art, tmp_path):
    """PEFT leaves a module named by modules_to_save out of LoRA: its LoRA weights are refused."""
    bad = copy_of(art.dense, tmp_path / "bad", modules_to_save=["v_proj"])
    assert_input_error(inspect(art, bad), "v_proj.lora_A.weight", "does not target")


def test_saved_copy_of_a_module_not_named_by_modules_to_save_is_refused(art, tmp_path):
    """A `.modules_to_save.default.` copy loads in PEFT only into a module that modules_to_save names (else PEFT
    drops it as an unexpected key); a plain `q_norm.weight` loads into the module either way (PEFT's
    load_state_dict), so it applies."""
    bad = copy_of(art.peft, tmp_path / "bad", modules_to_save=None)
    load_adapter(bad, "x", art.shapes)  # plain keys: applied, as PEFT does
    key = first_key(bad, "layers.0.self_attn.q_norm.weight")
    copy_key = key.replace(".weight", ".modules_to_save.default.weight")
    edit_tensors(bad, lambda t: t.update({copy_key: t.pop(key)}))
    assert_input_error(inspect(art, bad), str(bad / "adapter_model.safetensors"), copy_key, "modules_to_save")


def test_modules_to_save_ignores_layers_to_transform_as_in_peft(art, tmp_path):
    """PEFT's _set_trainable saves q_norm in every layer whatever layers_to_transform says."""
    edited = copy_of(art.peft, tmp_path / "edited", layers_to_transform=[0, 1, 2])
    # the embedding has no layer index: PEFT's layer filter leaves it out, so its weights are refused
    assert_input_error(inspect(art, edited), "embed_tokens.lora_embedding_A", "does not target")
    edit_tensors(edited, lambda t: [t.pop(k) for k in list(t) if "embed_tokens" in k])
    adapter = load_adapter(edited, "x", art.shapes)
    assert sorted(adapter.overrides) == [f"model.layers.{i}.self_attn.q_norm" for i in range(3)]


def test_second_saved_copy_of_one_module_is_refused(art, tmp_path):
    bad = copy_of(art.peft, tmp_path / "bad")
    key = first_key(bad, "layers.0.self_attn.q_norm.weight")
    edit_tensors(bad, lambda t: t.update({key.replace(".weight", ".modules_to_save.default.weight"): t[key] * 2}))
    assert_input_error(inspect(art, bad), "a second saved weight", "q_norm")


def test_target_modules_null_without_target_parameters_targets_nothing(art, tmp_path):
    bad = copy_of(art.dense, tmp_path / "bad", target_modules=None)
    assert_input_error(inspect(art, bad), "target_modules", "targets nothing")


@pytest.mark.parametrize("config,key,needle", [
    (dict(ensure_weight_tying=True), "ensure_weight_tying", "not supported"),
    (dict(init_lora_weights="pissa_niter_4"), "init_lora_weights", "residual base model"),
    (dict(init_lora_weights="olora"), "init_lora_weights", "residual base model"),
    (dict(use_rslora="false"), "use_rslora", "true or false"),
    (dict(exclude_modules=7), "exclude_modules", "a list of names"),
    (dict(layers_to_transform=[0], layers_pattern="(layers"), "layers_pattern", "not a valid regular expression"),
])
def test_settings_that_change_the_model_or_are_malformed(art, tmp_path, config, key, needle):
    bad = copy_of(art.dense, tmp_path / "bad", **config)
    assert_input_error(inspect(art, bad), str(bad / "adapter_config.json"), key, needle)


# ---- 2. numbers -------------------------------------------------------------------------------------------------


NAN_CASES = {  # case -> (adapter, parts of the key to break)
    "dense-lora_B": ("dense", ("q_proj.lora_B",)),
    "per-expert-2d-lora_B": ("per-expert-2d", ("experts.3.down_proj.lora_B",)),
    "fused-3d-lora_A": ("fused-3d", ("gate_up_proj.lora_A",)),
    "shared-outer-3d-lora_B": ("shared-outer-3d", ("w2.lora_B",)),
    "peft-target-parameters-lora_B": ("peft-target-parameters", ("experts.base_layer.lora_B",)),
    "embedding-lora_embedding_B": ("peft", ("lora_embedding_B",)),
    "modules_to_save": ("peft", ("q_norm.weight",)),
}


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("case", list(NAN_CASES))
def test_non_finite_value_refused_in_every_layout(art, tmp_path, case, value):
    source, parts = NAN_CASES[case]
    bad = copy_of(art.peft if source == "peft" else art.dense if source == "dense" else art.layouts[source],
                  tmp_path / "bad")
    key = first_key(bad, *parts)

    def poke(tensors):
        t = tensors[key].clone().reshape(-1)
        t[torch.randint(0, t.numel(), (1,))] = value
        tensors[key] = t.reshape(tensors[key].shape)

    edit_tensors(bad, poke)
    assert_input_error(inspect(art, bad), str(bad / "adapter_model.safetensors"), key, "1 of", "not finite",
                       str(value))


def test_nan_in_lora_B_is_exit_2_in_every_command(art, tmp_path):
    """The issue's case: compare said exit 1 'adapter not applied ... max |lp - base| nan'."""
    bad = copy_of(art.peft, tmp_path / "bad")
    key = first_key(bad, "layers.1.self_attn.v_proj.lora_B")
    edit_tensors(bad, lambda t: t[key].view(-1).__setitem__(0, float("nan")))
    all_three(art, bad, tmp_path, str(bad / "adapter_model.safetensors"), key, "not finite")


def test_non_finite_in_a_bin_adapter(art, tmp_path):
    bad = copy_of(art.layouts["shared-outer-3d"], tmp_path / "bad")
    tensors = load_file(str(bad / "adapter_model.safetensors"))
    key = first_key(bad, "w1.lora_A")
    tensors[key].view(-1)[-1] = float("-inf")
    torch.save(tensors, bad / "adapter_model.bin")
    (bad / "adapter_model.safetensors").unlink()
    assert_input_error(inspect(art, bad), str(bad / "adapter_model.bin"), key, "not finite", "-inf")


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, torch.int64])
def test_non_float_tensor_refused(art, tmp_path, dtype):
    bad = copy_of(art.dense, tmp_path / "bad")
    key = first_key(bad, "v_proj.lora_A")
    edit_tensors(bad, lambda t: t.update({key: (t[key] * 100).to(dtype)}))
    name = str(dtype).removeprefix("torch.")
    line = assert_input_error(inspect(art, bad), str(bad / "adapter_model.safetensors"), key, f"dtype {name}",
                              "floating-point")
    if dtype is torch.int32:
        assert_input_error(compare(art, bad, tmp_path / "run"), line.removeprefix("error: "))


def test_float64_beyond_float32_refused(art, tmp_path):
    bad = copy_of(art.dense, tmp_path / "bad")
    key = first_key(bad, "q_proj.lora_B")
    edit_tensors(bad, lambda t: t.update({key: t[key].double() * 1e300}))
    assert_input_error(inspect(art, bad), key, "not finite")


@pytest.mark.parametrize("config,key", [
    (dict(lora_alpha=float("inf")), "lora_alpha"),
    (dict(lora_alpha=float("nan")), "lora_alpha"),
    (dict(lora_alpha=-float("inf")), "lora_alpha"),
    (dict(alpha_pattern={"q_proj": float("inf")}), "alpha_pattern"),
    (dict(alpha_pattern={"q_proj": float("nan")}), "alpha_pattern"),
    (dict(rank_pattern={"q_proj": float("nan")}), "rank_pattern"),
    (dict(r=10 ** 400), "r"),
    (dict(r=1 << 20), "r"),
    (dict(rank_pattern={"q_proj": 10 ** 30}), "rank_pattern"),
])
def test_non_finite_or_huge_config_numbers_refused(art, tmp_path, config, key):
    bad = copy_of(art.dense, tmp_path / "bad", **config)  # json.dumps writes NaN / Infinity, as Python reads them
    assert_input_error(inspect(art, bad), str(bad / "adapter_config.json"), key, "expected")


def test_lora_alpha_infinity_exit_2_in_compare(art, tmp_path):
    bad = copy_of(art.peft, tmp_path / "bad", lora_alpha=float("inf"))
    assert_input_error(compare(art, bad, tmp_path / "run"), "lora_alpha", "finite", "inf")


def test_scaling_that_overflows_float32_refused(art, tmp_path):
    bad = copy_of(art.dense, tmp_path / "bad", lora_alpha=1e300)
    assert_input_error(inspect(art, bad), str(bad / "adapter_model.safetensors"), "lora_B", "overflows float32")


# ---- 3. messages ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", [2, 4])  # (with 4, torch warns about the protocol on its way to refusing)
def test_pickled_bin_refused_without_advice_to_unpickle(art, tmp_path, protocol):
    bad = copy_of(art.dense, tmp_path / "bad")
    tensors = load_file(str(bad / "adapter_model.safetensors"))
    torch.save({**tensors, "hook": print}, bad / "adapter_model.bin",  # a global: weights_only refuses it
               pickle_protocol=protocol)
    (bad / "adapter_model.safetensors").unlink()
    with warnings.catch_warnings(record=True) as seen:  # (pytest takes warnings off stderr: recorded here)
        warnings.simplefilter("always")
        results = (inspect(art, bad), compare(art, bad, tmp_path / "run"))
    assert not seen, [str(w.message) for w in seen]  # a warning is a second line on stderr
    for result in results:
        line = assert_input_error(result, str(bad / "adapter_model.bin"), "not a plain tensor file",
                                  "never unpickles")
        assert "weights_only" not in line and "False" not in line


def test_truncated_bin_is_named(art, tmp_path):
    bad = copy_of(art.dense, tmp_path / "bad")
    torch.save(load_file(str(bad / "adapter_model.safetensors")), bad / "adapter_model.bin")
    (bad / "adapter_model.safetensors").unlink()
    data = (bad / "adapter_model.bin").read_bytes()
    (bad / "adapter_model.bin").write_bytes(data[:len(data) // 2])
    line = assert_input_error(inspect(art, bad), str(bad / "adapter_model.bin"), "truncated")
    assert "weights_only" not in line


def test_adapter_path_that_is_a_file(art, tmp_path):
    path = art.dense / "adapter_model.safetensors"
    assert_input_error(inspect(art, path), str(path), "is a file", "folder")


def test_alpha_pattern_keys_hit_expert_tensors_as_in_peft(art, tmp_path):
    """A pattern matches the end of the module path the weights are saved under (PEFT's get_pattern_key): a 3D
    expert factor and a PEFT target_parameters one share `...experts.down_proj` / `...experts.gate_up_proj`; a
    per-expert 2D factor is `...experts.{e}.down_proj`. r = 4, lora_alpha = 8 in every layout."""
    patterns = {"down_proj": 3, "model.layers.2.mlp.experts.gate_up_proj": 5}
    expected = {  # layout -> (part, layer) -> scaling
        "fused-3d": {("experts.down", 0): 3 / 4, ("experts.down", 2): 3 / 4,
                     ("experts.gate_up", 0): 2, ("experts.gate_up", 2): 5 / 4},
        "peft-target-parameters": {("experts.down", 0): 3 / 4, ("experts.down", 2): 3 / 4,
                                   ("experts.gate_up", 0): 2, ("experts.gate_up", 2): 5 / 4},
        "per-expert-2d": {("experts.down", 0): 3 / 4, ("experts.down", 2): 3 / 4,  # gate_proj / up_proj: no match
                          ("experts.gate", 0): 2, ("experts.gate", 2): 2, ("experts.up", 0): 2, ("experts.up", 2): 2},
    }
    for layout, scalings in expected.items():
        edited = copy_of(art.layouts[layout], tmp_path / layout, alpha_pattern=patterns)
        adapter = load_adapter(edited, "x", art.shapes)
        assert {(t["part"], t["layer"]): t["scaling"] for t in adapter.targets} == pytest.approx(scalings), layout


def test_two_keys_for_one_factor_after_renames_are_refused(tmp_path, session_seed):
    """Mixtral adapters of transformers 4 say block_sparse_moe where ours says mlp: a file holding both names for one
    expert's factor kept whichever came last."""
    model = save_random_model(tmp_path / "mixtral", "mixtral", seed=session_seed)
    adapter = write_expert_adapter(model, tmp_path / "old", layout="per_expert_2d", names="mixtral", seed=session_seed,
                                   moe_module="block_sparse_moe").adapter_dir
    key = first_key(adapter, "layers.0.block_sparse_moe.experts.1.w2.lora_B")
    edit_tensors(adapter, lambda t: t.update({key.replace("block_sparse_moe", "mlp"): -t[key]}))
    assert_input_error(run_cli("inspect", "--model", model, "--adapter", f"x={adapter}"),
                       str(adapter / "adapter_model.safetensors"), "a second lora_B", "experts.1.w2")
