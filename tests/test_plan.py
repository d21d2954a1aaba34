"""`lora-eval plan` (lora_eval/plan.py): parameter counts of the published configs against the model authors' figures
and a hand calculation, per-GPU memory per layout, and the refusal of a run that cannot fit, before any load."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from lora_eval.cli import cli
from lora_eval.engine.plan import GB, model_parameters, plan
from tests.cli_checks import assert_input_error

CONFIGS = Path("/work/shared/data/model-configs")
if not CONFIGS.is_dir():
    CONFIGS = Path(__file__).resolve().parents[2] / "shared" / "data" / "model-configs"
pytestmark = pytest.mark.skipif(not CONFIGS.is_dir(), reason="the published configs are not in ../shared")

# model card figures, billions: (total, active per token, embedding tables the card leaves out of "active": gpt-oss
# the input embedding, GLM both tables; the others count them); totals within 3% (cards round: "1T", "106B")
PUBLISHED = {"Qwen3-235B-A22B": (235, 22, 0), "Qwen3-30B-A3B": (30.5, 3.3, 0), "Mixtral-8x7B-v0.1": (46.7, 12.9, 0),
             "OLMoE-1B-7B-0924": (6.9, 1.3, 0), "Qwen1.5-MoE-A2.7B": (14.3, 2.7, 0), "gpt-oss-120b": (116.8, 5.1, 1),
             "gpt-oss-20b": (20.9, 3.6, 1), "DeepSeek-V3": (671, 37, 0), "Kimi-K2-Instruct": (1040, 32, 0),
             "GLM-4.5-Air": (106, 12, 2), "GLM-4.5": (355, 32, 2), "Qwen3-VL-30B-A3B-Instruct": (30.5, 3.3, 0)}


def model_dir(tmp_path: Path, name: str) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    shutil.copy(CONFIGS / f"{name}.json", folder / "config.json")
    return folder


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_parameter_counts_agree_with_the_model_cards(name, tmp_path):
    counts = model_parameters(model_dir(tmp_path, name))
    total, active, tables = PUBLISHED[name]
    assert counts["total"] / 1e9 == pytest.approx(total, rel=0.03)
    config = json.loads((CONFIGS / f"{name}.json").read_text())
    config = config.get("text_config", config)
    embedding = tables * config["vocab_size"] * config["hidden_size"]
    assert (counts["active"] - embedding) / 1e9 == pytest.approx(active, rel=0.03)


def test_qwen3_235b_by_hand(tmp_path):
    """The hand calculation of docs/commands/plan.md: experts L x E x 3 x H x I; attention, routers, norms and the two embedding
    tables replicated."""
    L, E, H, I, V, k = 94, 128, 4096, 1536, 151936, 8
    q, kv, d = 64, 4, 128
    experts = L * E * 3 * H * I
    attention = L * (H * q * d + 2 * H * kv * d + q * d * H + 2 * d + 2 * H)  # q/k/v/o, q/k norms, two layer norms
    replicated = attention + L * H * E + 2 * V * H + H  # routers, embeddings and lm_head, final norm
    counts, rows = plan(model_dir(tmp_path, "Qwen3-235B-A22B"), gpus=8, batch_tokens=4096)
    assert (counts["experts"], counts["replicated"]) == (experts, replicated)
    assert counts["active"] == replicated + experts * k // E
    by_layout = rows.set_index("layout")
    assert by_layout.loc["one GPU", "experts_gb"] == pytest.approx(experts * 2 / GB)
    assert by_layout.loc["expert parallel", "experts_gb"] == pytest.approx(experts * 2 / 8 / GB)
    assert by_layout.loc["data parallel", "replicated_gb"] == by_layout.loc["expert parallel", "replicated_gb"]
    assert list(by_layout["fits"]) == [False, False, True]  # 471 GB on one H100; 73.7 GB with experts over 8


def test_plan_command_exit_codes(tmp_path):
    folder = model_dir(tmp_path, "Qwen3-235B-A22B")
    fits = CliRunner().invoke(cli, ["plan", "--model", str(folder), "--gpus", "8"])
    assert fits.exit_code == 0 and "235.09 B parameters" in fits.stdout and "expert parallel" in fits.stdout
    assert CliRunner().invoke(cli, ["plan", "--model", str(folder)]).exit_code == 1


def test_a_run_that_cannot_fit_is_refused_before_anything_loads(tmp_path):
    folder = model_dir(tmp_path, "Qwen3-235B-A22B")  # config.json alone: a load would fail on the missing weights
    ref = tmp_path / "ref.jsonl"
    ref.write_text(json.dumps(dict(input_ids=[1, 2, 3], logprobs=[-1.0, -2.0])) + "\n")
    result = CliRunner().invoke(cli, ["compare", "--model", str(folder), "--reference", str(ref), "--out",
                                      str(tmp_path / "run"), "--device", "cpu"])
    assert_input_error(result, str(folder / "config.json"), "235.1 B parameters need about", "GB in float32",
                       "GB of host memory available", "lora-eval plan")
    assert not (tmp_path / "run").exists() and not (tmp_path / "run.partial").exists()
