"""prime-rl: the trainer's token export (both sides, JSONL) and the filesystem transport's rollouts (sampler only,
msgpack).

Follows PrimeIntellect-ai/prime-rl @ 559b44772e471d1538537b8805cc77f3824a5e64:
* `token_exports/step_{s}/rank_{r}.jsonl`, src/prime_rl/trainer/rl/token_export.py (SCHEMA_VERSION 1): one line per
  packed sample, per-token lists of the sample's full length N, position i = token i (train.py ~447-452 shifts the
  trainer's logprobs right; index 0 is filler). Trainer = `trainer_logprobs`, sampler = `inference_logprobs`, mask =
  `loss_mask`; ours = arr[1:N]. Non-finite values are written as null. Both sides are taken at the sampling
  temperature, which the export does not record (the orchestrator's sampling.temperature).
* `rollouts/step_{s}/rank_{r}.bin`, src/prime_rl/transports/rollouts/filesystem.py + types.py: msgspec msgpack of
  list[MicroBatch], each an array_like struct (fields in FIELDS' order). Samples are packed back to back and
  `position_ids` restart at 0 at each; src/prime_rl/trainer/batch.py `pad_micro_batch` pads the last one (its
  position_ids restart at 0 too, loss_mask False), which is dropped. `inference_logprobs` (the sampler, position
  i = token i) is the side compared; `temperatures` per token (entry i for token i, so ours = [1:N]);
  `routed_experts` = [bytes, [S, L, K], dtype] for the packed batch, row i = the routing of input token i, the last
  row of each sample a copy (verifiers graph.py `_attribute_routed_experts`): ours = each sample's rows [:N-1].
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from ...errors import InputError
from .common import Format, numbers

SOURCE = "PrimeIntellect-ai/prime-rl @ 559b447"
EXPORT_KEYS = {"schema_version", "token_ids", "loss_mask", "inference_logprobs", "trainer_logprobs"}
EXPORT = Format("prime-rl token export (token_exports/step_s/rank_r.jsonl)",
                f"{SOURCE}: src/prime_rl/trainer/rl/token_export.py", temperature_key="sampling.temperature",
                keys=(("input_ids", "token_ids"), ("logprobs", "trainer_logprobs"),
                      ("sampler_logprobs", "inference_logprobs"), ("mask", "loss_mask")))
ROLLOUTS = Format("prime-rl rollouts (rollouts/step_s/rank_r.bin, msgpack MicroBatch)",
                  f"{SOURCE}: src/prime_rl/transports/rollouts/types.py, filesystem.py", compared="sampler",
                  keys=(("logprobs", "inference_logprobs"), ("mask", "loss_mask"), ("temperature", "temperatures")))
FIELDS = ["input_ids", "loss_mask", "advantages", "inference_logprobs", "position_ids", "sequence_lengths",
          "temperatures", "env_names", "seq_lens", "ref_logprobs", "routed_experts"]  # the first 11 of MicroBatch


def detect_export(keys) -> bool:
    return EXPORT_KEYS <= set(keys)


def read_export(path: Path, lines: list[tuple[int, dict]]) -> pd.DataFrame:
    rows = []
    for i, (number, line) in enumerate(lines):
        where = f"line {number}"
        if line.get("schema_version") != 1:
            raise InputError(path, f"schema_version {line.get('schema_version')!r}: this reader follows prime-rl's "
                             "token export schema_version 1", key=where)
        missing = sorted(EXPORT_KEYS - set(line))
        if missing:
            raise InputError(path, f"a prime-rl token export line lacks '{missing[0]}'", key=where)
        ids = numbers(line["token_ids"], "token_ids", path, where)
        mask = numbers(line["loss_mask"], "loss_mask", path, where)[1:] != 0
        sides = {key: _logprobs(line[key], key, mask, path, where) for key in ("trainer_logprobs",
                                                                               "inference_logprobs")}
        rows.append(dict(sample_id=f"{path}:{i}", input_ids=ids.tolist(), logprobs=sides["trainer_logprobs"],
                         mask=mask.tolist(), sampler_logprobs=sides["inference_logprobs"], _where=where))
    return pd.DataFrame(rows)


def _logprobs(value, key: str, mask: np.ndarray, path: Path, where: str) -> list:
    """Positions 1.. of a full-length list. The export writes a non-finite value as null: where the mask leaves it
    out it becomes 0.0 (never scored); where it is scored it is refused."""
    if not isinstance(value, list) or len(value) != len(mask) + 1:
        raise InputError(path, f"{key} must be a list of len(token_ids) = {len(mask) + 1} numbers", key=where)
    values = value[1:]
    nulls = [p for p, v in enumerate(values) if v is None]
    scored = [p for p in nulls if mask[p]]
    if scored:
        raise InputError(path, f"{key} is null (a non-finite value, as the export writes one) at scored token "
                         f"{scored[0] + 1}", key=where)
    return [0.0 if v is None else v for v in values]


def detect_rollouts(data) -> bool:
    return (isinstance(data, list) and len(data) > 0 and isinstance(data[0], list) and 9 <= len(data[0]) <= 16
            and all(isinstance(v, list) for v in data[0][:9]))


def read_rollouts(path: Path, data: list) -> pd.DataFrame:
    rows = []
    for b, batch in enumerate(data):
        where = f"micro-batch {b}"
        if not isinstance(batch, list) or not 9 <= len(batch) <= 16:
            raise InputError(path, "expected a MicroBatch (an array of 9 to 16 fields)", key=where)
        fields = dict(zip(FIELDS, batch))
        arrays = {key: numbers(fields[key], key, path, where) for key in
                  ("input_ids", "loss_mask", "inference_logprobs", "position_ids", "temperatures")}
        size = len(arrays["input_ids"])
        wrong = [key for key, a in arrays.items() if len(a) != size]
        if wrong:
            raise InputError(path, f"{wrong[0]} has {len(arrays[wrong[0]])} entries, input_ids {size}", key=where)
        routes = _routes(fields.get("routed_experts"), size, path, where)
        for start, end in _samples(arrays["position_ids"], fields["sequence_lengths"], arrays["loss_mask"], path,
                                   where):
            rows.append(dict(
                sample_id=f"{path}:{len(rows)}", input_ids=arrays["input_ids"][start:end].tolist(),
                logprobs=arrays["inference_logprobs"][start + 1:end], mask=(arrays["loss_mask"][start + 1:end] != 0),
                temperature=arrays["temperatures"][start + 1:end].tolist(),
                routed_experts=None if routes is None else routes[start:end - 1],
                _where=f"{where}, sample at token {start}"))
    return pd.DataFrame(rows)


def _samples(position_ids: np.ndarray, lengths, loss_mask: np.ndarray, path: Path, where: str) -> list:
    """(start, end) of each packed sample: position_ids restart at 0 at each; the padding pad_micro_batch adds after
    the last (its positions restart at 0 too, all loss-masked, counted in the last sequence_lengths) is dropped."""
    starts = np.flatnonzero(position_ids == 0).tolist()
    if not starts or starts[0] != 0:
        raise InputError(path, "position_ids must start at 0 (one run of 0, 1, ... per packed sample)", key=where)
    bounds = list(zip(starts, starts[1:] + [len(position_ids)]))
    if not isinstance(lengths, list) or not lengths or not all(isinstance(n, int) for n in lengths):
        raise InputError(path, "sequence_lengths must be a list of integers", key=where)
    if len(bounds) == len(lengths) + 1 and not loss_mask[bounds[-1][0]:].any():
        padding = bounds.pop()
        lengths = lengths[:-1] + [lengths[-1] - (padding[1] - padding[0])]
    if [e - s for s, e in bounds] != lengths:
        raise InputError(path, f"position_ids split the batch into samples of {[e - s for s, e in bounds]} tokens "
                         f"but sequence_lengths says {lengths}", key=where)
    return bounds


def _routes(value, size: int, path: Path, where: str) -> np.ndarray | None:
    """RoutedExperts [data bytes, [S, L, K], dtype] as an int array [S, L, K]."""
    if value is None:
        return None
    try:
        data, shape, dtype = value
        dtype = np.dtype(dtype)
        ok = isinstance(data, bytes) and dtype.kind in "iu" and len(shape) == 3 and shape[0] == size
        array = np.frombuffer(data, dtype=dtype).reshape(shape) if ok else None
    except (TypeError, ValueError):
        array = None
    if array is None:
        raise InputError(path, f"routed_experts must be [bytes, [{size}, layers, top_k], integer dtype]", key=where)
    return array.astype(np.int32)
