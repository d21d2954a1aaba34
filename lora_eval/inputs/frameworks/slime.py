"""slime's debug dumps (and miles', its fork): torch.save dicts of samples with response-only logprobs.

Follows THUDM/slime @ 624b824a898ab0ec1fcb4d373004c7f3852bf515:
* the rollout dump (`--save-debug-rollout-data`, `--dump-details D` -> D/rollout_data/{id}.pt),
  slime/observability/rollout_data_utils.py `save_debug_rollout_data`: {rollout_id, samples: [Sample.to_dict()]}
  (slime/utils/types.py): `tokens` (N), `response_length` R, `loss_mask` (R, None = all ones),
  `rollout_log_probs` (the sampler, R), `rollout_routed_experts` int32 [N-1, layers, top_k] (row p: the routing of
  input token p). The sampler side is compared.
* the train dump (`--save-debug-train-data`), slime/observability/train_data_utils.py `_build_dump_payload`:
  {format_version: 2, rollout_id, rank, samples: [...]} with `tokens`, `response_lengths`, `loss_masks`,
  `rollout_log_probs`, `log_probs` (the trainer, when computed: then compared), `rollout_routed_experts`.
Response value j scores tokens[N-R+j], our position N-R-1+j. Prompt positions have no logprob in the file: they are
masked out and hold 0.0 (a valid log-probability that is never scored). Both sides are taken at
`--rollout-temperature`, which is not written. miles' rollout .pt (radixark/miles @ 31f1ca9,
miles/ray/rollout/debug_data.py) holds numpy arrays, which torch.load(weights_only=True) refuses: `refuse_miles`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from ...errors import InputError
from .common import EXPORTS, Format, length, numbers, routes

SOURCE = "THUDM/slime @ 624b824"
TEMPERATURE = "--rollout-temperature"
KEYS = (("input_ids", "tokens"), ("logprobs", "log_probs"), ("sampler_logprobs", "rollout_log_probs"),
        ("mask", "loss_mask"), ("routed_experts", "rollout_routed_experts"))
ROLLOUT = Format("slime rollout dump (rollout_data/{id}.pt)",
                 f"{SOURCE}: slime/observability/rollout_data_utils.py, slime/utils/types.py",
                 temperature_key=TEMPERATURE, keys=KEYS).sampler_only()
TRAIN = Format("slime train dump (train_data/{id}.pt, format_version 2)",
               f"{SOURCE}: slime/observability/train_data_utils.py", temperature_key=TEMPERATURE, keys=KEYS)
# key in the rollout dump's samples -> key in the train dump's
TRAIN_KEYS = dict(response_length="response_lengths", loss_mask="loss_masks")


def detect(data) -> bool:
    return (isinstance(data, dict) and isinstance(data.get("samples"), list)
            and ("rollout_id" in data or data.get("format_version") == 2))


def read(path: Path, data: dict) -> tuple[Format, pd.DataFrame]:
    train = data.get("format_version") == 2
    if "format_version" in data and not train:
        raise InputError(path, f"format_version {data['format_version']!r}: this reader follows slime's train dump "
                         "format_version 2")
    rows = []
    for i, sample in enumerate(data["samples"]):
        where = f"sample {i}"
        if not isinstance(sample, dict) or "tokens" not in sample:
            raise InputError(path, "expected a dict with 'tokens'", key=where)
        get = (lambda key: sample.get(TRAIN_KEYS.get(key, key))) if train else sample.get
        rows.append(_sample(path, where, get, f"{path}:{i}"))
    has_trainer = [r.pop("trainer") is not None for r in rows]
    if any(has_trainer) and not all(has_trainer):
        raise InputError(path, f"sample {has_trainer.index(False)} has no log_probs but others have: a file is "
                         "compared on one side")
    form = TRAIN if train else ROLLOUT
    if not any(has_trainer) and form.compared == "trainer":
        return form.sampler_only(), pd.DataFrame(rows)
    return form, pd.DataFrame(rows)


def _sample(path: Path, where: str, get, sample_id: str) -> dict:
    tokens = numbers(get("tokens"), "tokens", path, where)
    n, r = len(tokens) - 1, length(get("response_length"), "response_length", path, where, at_least=1)
    if r > n:
        raise InputError(path, f"response_length {r} leaves no prompt token before it ({len(tokens)} tokens)",
                         key=where)
    sides = {}
    for key in ("rollout_log_probs", "log_probs"):
        value = get(key)
        if value is None:
            if key == "rollout_log_probs":
                raise InputError(path, "rollout_log_probs is missing (the sampler's logprobs)", key=where)
            sides[key] = None
            continue
        sides[key] = _response(numbers(value, key, path, where), key, n, r, 0.0, path, where)
    loss_mask = get("loss_mask")
    mask = np.ones(r, dtype=bool) if loss_mask is None else numbers(loss_mask, "loss_mask", path, where) != 0
    mask = _response(mask, "loss_mask", n, r, False, path, where)
    experts = routes(get("rollout_routed_experts"), "rollout_routed_experts", path, where)
    trainer, sampler = sides["log_probs"], sides["rollout_log_probs"]
    return dict(sample_id=sample_id, input_ids=tokens.tolist(), logprobs=sampler if trainer is None else trainer,
                mask=mask.tolist(), sampler_logprobs=None if trainer is None else sampler, routed_experts=experts,
                trainer=trainer, _where=where)


def _response(values: np.ndarray, key: str, n: int, r: int, filler, path: Path, where: str) -> np.ndarray:
    """Response-only values (R) on our n positions: filler on the prompt's, the values on the last R."""
    if len(values) != r:
        raise InputError(path, f"{key} has {len(values)} entries, expected response_length = {r}", key=where)
    out = np.full(n, filler, dtype=values.dtype)
    out[n - r:] = values
    return out


def refuse_miles(path: Path, global_name: str) -> InputError:
    return InputError(path, f"refused: not a plain tensor file: it holds Python objects ({global_name}) that "
                      "lora-eval will not unpickle, as miles' rollout dumps hold numpy arrays; turn it into our "
                      f"Parquet in your own environment with the few lines in {EXPORTS} (miles)")
