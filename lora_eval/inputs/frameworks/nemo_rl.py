"""NeMo-RL's `train_data_step{N}.jsonl`: both sides, one JSON line per sample.

Follows NVIDIA-NeMo/RL @ 7ea279abfbeb698b092856d0dab61e7cf39bc909: the fields of nemo_rl/algorithms/grpo.py
(built ~3155-3270, written ~3629-3653), the writer nemo_rl/utils/logger.py `log_batched_dict_as_jsonl`
(1071-1098: each line a length-1 slice of the batch, so every value wrapped in one more list; the flat form is read
too) and the alignment of nemo_rl/models/policy/lm_policy.py 559-565 (position i holds the logprob of token i,
position 0 is 0). `token_ids` is right-padded; `input_lengths` is the unpadded length N. Trainer = `prev_logprobs`,
sampler = `generation_logprobs`; ours (position p scores token p+1) = arr[1:N]; mask = token_loss_mask[1:N] and
sample_loss_mask. The temperature (policy.generation.temperature, applied by both sides) is not written, and no routes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from ...errors import InputError
from .common import Format, length, numbers

KEYS = {"token_ids", "input_lengths", "token_loss_mask", "generation_logprobs", "prev_logprobs"}
FORMAT = Format("NeMo-RL train_data_step{N}.jsonl",
                "NVIDIA-NeMo/RL @ 7ea279a: nemo_rl/algorithms/grpo.py, nemo_rl/utils/logger.py",
                temperature_key="policy.generation.temperature",
                keys=(("input_ids", "token_ids"), ("logprobs", "prev_logprobs"),
                      ("sampler_logprobs", "generation_logprobs"), ("mask", "token_loss_mask")))


def detect(keys) -> bool:
    return KEYS <= set(keys)


def read(path: Path, lines: list[tuple[int, dict]]) -> pd.DataFrame:
    rows, trainer_scored = [], []
    for i, (number, line) in enumerate(lines):
        where = f"line {number}"
        missing = sorted(KEYS - set(line))
        if missing:
            raise InputError(path, f"a NeMo-RL train_data line lacks '{missing[0]}' (it has {', '.join(line)})",
                             key=where)
        n = length(_scalar(line["input_lengths"]), "input_lengths", path, where, at_least=2)
        arrays = {}
        for key in ("token_ids", "token_loss_mask", "generation_logprobs", "prev_logprobs"):
            arrays[key] = numbers(_row(line[key]), key, path, where)
            if len(arrays[key]) < n:
                raise InputError(path, f"{key} has {len(arrays[key])} entries, fewer than input_lengths = {n}",
                                 key=where)
        keep = _scalar(line.get("sample_loss_mask", 1.0))
        if isinstance(keep, bool) or not isinstance(keep, (int, float)):
            raise InputError(path, f"sample_loss_mask must be a number, found {keep!r:.40}", key=where)
        mask = (arrays["token_loss_mask"][1:n] != 0) & (keep != 0)
        trainer = arrays["prev_logprobs"][1:n]
        trainer_scored.append(trainer[mask])
        rows.append(dict(sample_id=f"{path}:{i}", input_ids=arrays["token_ids"][:n].tolist(), logprobs=trainer,
                         mask=mask.tolist(), sampler_logprobs=arrays["generation_logprobs"][1:n], _where=where))
    scored = np.concatenate(trainer_scored) if trainer_scored else np.zeros(0)
    if len(scored) and np.all(scored == 0):
        raise InputError(path, "prev_logprobs is 0.0 on every scored token: NeMo-RL skipped the trainer's logprob "
                         "pass (force_on_policy_ratio), so this file holds no trainer side to compare")
    return pd.DataFrame(rows)


def _scalar(value):
    """A per-sample value, unwrapped from the length-1 list NeMo-RL's writer puts it in."""
    return value[0] if isinstance(value, list) and len(value) == 1 else value


def _row(value):
    """A per-token list, unwrapped from the length-1 list NeMo-RL's writer puts it in."""
    return value[0] if isinstance(value, list) and len(value) == 1 and isinstance(value[0], list) else value
