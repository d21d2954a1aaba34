"""Trainer reference dumps: read (Parquet, JSONL, serving-engine .pt, and the dumps of RL frameworks: frameworks/)
and write (Parquet), validated.

One row per sample: sample_id, adapter (None = base model), input_ids, logprobs (len(input_ids) - 1),
optional mask and sampler_logprobs (same length), temperature (one number, or one per position) and routed_experts
([len(input_ids) - 1, layers, top_k] expert ids). The format is specified in references/README.md. A file is read by
what it holds, not by its name (`read_file`).
Every logprob and sampler logprob is finite and at most 0: NaN, +inf and values above 0 are impossible, and -inf
(probability 0) is refused too, since a token of probability 0 cannot have been sampled: a dump holding one is
broken (`_logprobs`). .pt dumps are read with torch.load(weights_only=True) only and never unpickled.
"""

from __future__ import annotations

import io
import math
from pathlib import Path

import msgpack
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from ..errors import InputError
from ..names import BASE
from .checks import read_jsonl
from .frameworks import nemo_rl, prime_rl, slime, verl
from .frameworks.common import Format, NotPlain, load_torch

COLUMNS = ["sample_id", "adapter", "input_ids", "logprobs", "mask", "sampler_logprobs", "temperature",
           "routed_experts"]
SCHEMA = pa.schema([  # the columns every file has; temperature and routed_experts are written where a row has one
    ("sample_id", pa.string()), ("adapter", pa.string()), ("input_ids", pa.list_(pa.int64())),
    ("logprobs", pa.list_(pa.float32())), ("mask", pa.list_(pa.bool_())), ("sampler_logprobs", pa.list_(pa.float32())),
])
ROUTES = pa.list_(pa.list_(pa.list_(pa.int32())))
SPEC = "references/README.md"
PARQUET = Format("native Parquet", SPEC, adapter_column=True)
JSONL = Format("native JSONL", SPEC, adapter_column=True)
ENGINE_PT = Format("serving-engine .pt", SPEC)
MSGPACK_ARRAY = {*range(0x90, 0xA0), 0xDC, 0xDD}  # the first byte of a msgpack array
TRIED = ("native Parquet; JSON lines (native: input_ids + logprobs, NeMo-RL train_data_step{N}.jsonl, prime-rl token "
         "export); torch .pt (serving-engine, slime dumps); msgpack (prime-rl rollouts .bin); pickles are refused "
         "(verl, miles)")


def read_reference(path: str | Path, adapter: str | None = None, vocab_size: int | None = None,
                   temperature: float | None = None) -> pd.DataFrame:
    """A validated reference DataFrame with COLUMNS, its temperatures resolved (`resolve_temperature`).
    `adapter`, if given, is whose logprobs these are (required for files without an adapter column: every format
    but the native Parquet and JSONL; 'base' means the base model). `vocab_size`: the model's, which every token id
    must fall inside. `temperature`: the sampling temperature of files that record none."""
    path = Path(path)
    form, frame = read_file(path)
    if adapter is None and not form.adapter_column:
        raise InputError(path, f"a {form.name} file has no adapter column: give it as NAME={path.name} (NAME 'base' "
                         "for the base model)")
    if adapter is not None:
        frame["adapter"] = None if adapter == BASE else adapter
    frame = validate(frame, path, vocab_size, form.names())
    frame["temperature"] = _objects(resolve_temperature(frame, form, temperature, path), frame)
    return frame


def read_file(path: Path) -> tuple[Format, pd.DataFrame]:
    """(the format, its rows as our columns, not yet validated), recognised by the file's content: Parquet's and
    zip's (torch.save) magic bytes, a pickle's (refused unopened), a JSON object first (the keys of line 1 say
    whose), a msgpack array. The name's suffix only picks the message for a file none of them matches."""
    if not path.is_file():
        raise InputError(path, "reference file not found")
    with open(path, "rb") as f:
        head = f.read(4096)
    suffix = path.suffix.lower()
    if not head:
        raise InputError(path, "empty file (no samples)")
    if head.startswith(b"PAR1"):
        return PARQUET, _read_parquet(path)
    if head.startswith(b"PK\x03\x04") or head.startswith(verl.TORCH_LEGACY):
        return _read_torch(path)
    if verl.is_pickle(head):
        raise verl.refuse(path, head)
    if head.lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"{"):
        return _read_lines(path)
    if head[0] in MSGPACK_ARRAY:
        return _read_msgpack(path)
    if suffix == ".parquet":
        return PARQUET, _read_parquet(path)  # (which says why it is none)
    if suffix in (".jsonl", ".json"):
        return _read_lines(path)  # (which names the line that is no JSON object)
    if suffix == ".pt":
        raise InputError(path, "not a readable torch file (no torch.save archive)")
    raise InputError(path, f"not a reference file lora-eval reads; tried {TRIED}")


def _read_parquet(path: Path) -> pd.DataFrame:
    """The native Parquet; routed_experts straight from Arrow into int32 arrays (through pandas, each would be a
    nest of object arrays)."""
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as e:
        raise InputError(path, f"not a readable Parquet file ({e})") from None
    if "routed_experts" not in table.column_names:
        return table.to_pandas()
    routes = [_arrow_routes(row) for row in table.column("routed_experts").combine_chunks()]
    frame = table.drop_columns(["routed_experts"]).to_pandas()
    frame["routed_experts"] = routes
    return frame


def _arrow_routes(row):
    """One sample's routed_experts (a list<list<list<int>>> scalar) as an [n, L, k] array, or as nested lists when
    its rows are ragged or hold nulls (for `validate` to refuse by name)."""
    if not row.is_valid:
        return None
    positions = row.values
    if not pa.types.is_list(positions.type) or not pa.types.is_list(positions.type.value_type):
        return row.as_py()
    layers = positions.flatten()
    experts = layers.flatten()
    per_position, per_layer = positions.value_lengths(), layers.value_lengths()
    shape_ok = len(positions) and len(layers) and len(set(per_position.to_pylist())) == 1 \
        and len(set(per_layer.to_pylist())) == 1
    if not shape_ok or positions.null_count or layers.null_count or experts.null_count:
        return row.as_py()
    return experts.to_numpy(zero_copy_only=False).reshape(len(positions), per_position[0].as_py(),
                                                          per_layer[0].as_py())


def _read_torch(path: Path) -> tuple[Format, pd.DataFrame]:
    try:
        data = load_torch(path)
    except NotPlain as e:
        if e.global_name.startswith("numpy"):
            raise slime.refuse_miles(path, e.global_name) from None
        raise InputError(path, "refused: not a plain tensor file (a torch.save of tensors, lists and dicts only); it "
                         f"holds other Python objects ({e.global_name or 'unknown'}), and lora-eval never unpickles "
                         f"it; export it to our Parquet in your own environment ({SPEC})") from None
    if slime.detect(data):
        return slime.read(path, data)
    return ENGINE_PT, _read_pt(path, data)


def _read_lines(path: Path) -> tuple[Format, pd.DataFrame]:
    lines = read_jsonl(path)
    if not lines:
        raise InputError(path, "no samples")
    keys = lines[0][1].keys()
    if nemo_rl.detect(keys):
        return nemo_rl.FORMAT, nemo_rl.read(path, lines)
    if prime_rl.detect_export(keys):
        return prime_rl.EXPORT, prime_rl.read_export(path, lines)
    if not {"input_ids", "logprobs"} <= set(keys):
        raise InputError(path, f"line {lines[0][0]} has keys {', '.join(keys) or 'none'}: no reference format "
                         f"lora-eval reads (tried {TRIED})")
    return JSONL, pd.DataFrame([row for _, row in lines]).assign(_where=[f"line {n}" for n, _ in lines])


def _read_msgpack(path: Path) -> tuple[Format, pd.DataFrame]:
    try:
        data = msgpack.unpackb(path.read_bytes(), raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise InputError(path, f"not a readable msgpack file (truncated or corrupt: {str(e)[:120]})") from None
    if prime_rl.detect_rollouts(data):
        return prime_rl.ROLLOUTS, prime_rl.read_rollouts(path, data)
    raise InputError(path, f"a msgpack file, but not a list of prime-rl MicroBatch arrays; tried {TRIED}")


def _read_pt(path: Path, data) -> pd.DataFrame:
    """Serving-engine dumps: a dict {tokens, training_logprobs, sampling_logprobs?} of per-sample lists or
    2D tensors, or a list of such dicts (one per sample)."""
    samples = data if isinstance(data, list) else [data]
    rows = []
    for i, item in enumerate(samples):
        if not isinstance(item, dict) or "tokens" not in item or "training_logprobs" not in item:
            raise InputError(path, "expected a dict (or list of dicts) with 'tokens' and 'training_logprobs' (or a "
                             "slime dump: {rollout_id or format_version 2, samples})", key=f"sample {i}")
        where = f"sample {i}" if isinstance(data, list) else None
        tokens = _rows(item["tokens"], "tokens", path, where)
        train = _rows(item["training_logprobs"], "training_logprobs", path, where)
        sampler = _rows(item["sampling_logprobs"], "sampling_logprobs", path, where) \
            if item.get("sampling_logprobs") is not None else None
        if len(tokens) != len(train) or (sampler is not None and len(sampler) != len(tokens)):
            raise InputError(path, f"{len(tokens)} token rows but {len(train)} training_logprobs rows"
                             + (f" and {len(sampler)} sampling_logprobs rows" if sampler is not None else ""))
        for j in range(len(tokens)):
            rows.append(dict(sample_id=f"{path}:{len(rows)}", input_ids=tokens[j], logprobs=train[j],
                             sampler_logprobs=None if sampler is None else sampler[j], _where=f"sample {len(rows)}"))
    return pd.DataFrame(rows)


def _rows(value, key: str, path: Path, where: str | None) -> list[list]:
    """Per-sample lists from one of the documented forms (references/README.md): a 1D tensor (one sample), a 2D
    tensor (samples x positions, all of one length: no padding), or a list of 1D tensors or of per-sample lists (a
    flat list of numbers: one sample). Anything else is refused naming the key (and the dict of a list of dicts);
    the values themselves are checked by `validate`."""
    def bad(problem):
        return InputError(path, f"{key} {problem}", key=where)

    if isinstance(value, torch.Tensor):
        if value.dim() not in (1, 2):
            raise bad(f"is a {value.dim()}-D tensor; expected a 1-D (one sample) or 2-D (samples x positions) tensor")
        if value.numel() == 0:
            raise bad(f"is an empty tensor (shape {list(value.shape)})")
        if value.dim() == 2:
            _refuse_padding(value, key, bad)
        return [value.tolist()] if value.dim() == 1 else value.tolist()
    if not isinstance(value, (list, tuple)):
        raise bad(f"must be a tensor or a list, found {type(value).__name__} {str(value)[:40]}")
    if not value:
        raise bad("is empty (no sample)")
    sequences = [isinstance(v, (torch.Tensor, list, tuple)) for v in value]
    if not any(sequences):
        return [list(value)]  # a flat list: one sample
    if not all(sequences):
        j = sequences.index(False)
        raise bad(f"mixes samples (tensors or lists) and single values (row {j}: {type(value[j]).__name__}); "
                  "expected a list of 1-D tensors or of per-sample lists")
    rows = []
    for j, v in enumerate(value):
        if isinstance(v, torch.Tensor) and v.dim() != 1:
            raise bad(f"row {j} is a {v.dim()}-D tensor; expected one sample as a 1-D tensor")
        rows.append(v.tolist() if isinstance(v, torch.Tensor) else list(v))
    return rows


def _refuse_padding(value: torch.Tensor, key: str, bad) -> None:
    """A 2D tensor holds samples of one length. Serving engines pad ragged samples into one (token id -1, logprob
    0.0): read as data, the padding would be scored as tokens. A negative token id, or a row ending in two or more
    logprobs of exactly 0.0, is refused, pointing at the unpadded form. (One final 0.0 is left alone: a float32
    log-softmax gives exactly 0.0 for a token of near-certain probability; two such at the very end of a row is what
    padding looks like.)"""
    if value.is_floating_point():
        ends = torch.nonzero((value[:, -2:] == 0).all(dim=1)) if value.shape[1] >= 2 else value.new_zeros(0, 1)
        what = "ends with logprobs of exactly 0.0"
    else:
        ends = torch.nonzero(value < 0)  # [k, 2]
        what = "holds a negative token id"
    if len(ends):
        raise bad(f"row {int(ends[0, 0])} {what}: padding, as serving engines pad samples of different lengths "
                  "into one 2-D tensor; lora-eval reads a 2-D tensor as samples of one length only: give the samples "
                  "as a list of 1-D tensors (one per sample, unpadded)")


def validate(frame: pd.DataFrame, path: str | Path, vocab_size: int | None = None,
             names: dict[str, str] | None = None) -> pd.DataFrame:
    """Check every sample strictly and normalise it to Python lists (temperature: None, a float or a list of floats;
    routed_experts: None or an int32 array [n, layers, top_k], of one shape after the first dimension in a file);
    errors name the file, the line (JSONL) or row, the sample and the column. `vocab_size`: token ids must lie in
    [0, vocab_size). Whether the routes fit the model (its layers, top_k and experts) is compare's check. `names`:
    a column's key in the file read (a framework's), for the messages."""
    name = {column: column for column in COLUMNS} | (names or {})
    if len(frame) == 0:
        raise InputError(path, "no samples")
    for column in ("input_ids", "logprobs"):
        if column not in frame.columns:
            raise InputError(path, f"missing required column (columns: {', '.join(map(str, frame.columns))})",
                             key=column)
    frame = frame.copy()
    if "_where" not in frame.columns:
        frame["_where"] = [f"row {i}" for i in range(len(frame))]
    if "sample_id" not in frame.columns:
        frame["sample_id"] = [str(i) for i in range(len(frame))]
    for column in COLUMNS:
        if column not in frame.columns:
            frame[column] = None
    records, seen, scored, shapes = [], {}, 0, {}
    for values in frame[[*COLUMNS, "_where"]].itertuples(index=False, name=None):
        row = dict(zip([*COLUMNS, "origin"], values))
        sample_id, origin = row["sample_id"], row["origin"]
        if isinstance(sample_id, (bool, np.bool_)) or not isinstance(sample_id, (str, int, np.integer)):
            raise InputError(path, f"sample_id must be a string or an integer, found {sample_id!r}", key=origin)
        sample_id = str(sample_id)
        where = f"{origin} (sample {sample_id})"
        if sample_id in seen:
            raise InputError(path, f"sample_id is also used by {seen[sample_id]}; it must be unique within a file",
                             key=where)
        seen[sample_id] = origin
        ids = _checked(row["input_ids"], name["input_ids"], "integer token ids", _is_int, path, where)
        if len(ids) < 2:
            raise InputError(path, f"{name['input_ids']} must hold at least 2 token ids, found {len(ids)}", key=where)
        if vocab_size is not None:
            bad = _first_outside(ids, vocab_size)
            if bad is not None:
                raise InputError(path, f"{name['input_ids']}: token id {bad} is outside the model's vocabulary "
                                 f"[0, {vocab_size})", key=where)
        n = len(ids) - 1
        logprobs = _logprobs(row["logprobs"], name["logprobs"], n, path, where)
        mask = None
        if not _missing(row["mask"]):
            mask = [bool(m) for m in _checked(row["mask"], name["mask"], "booleans (true/false or 0/1)", _is_bool,
                                              path, where, n)]
        scored += n if mask is None else sum(mask)
        sampler = row["sampler_logprobs"]
        sampler = None if _missing(sampler) else _logprobs(sampler, name["sampler_logprobs"], n, path, where)
        routes = _routes(row["routed_experts"], name["routed_experts"], n, path, where)
        if routes is not None:
            shapes.setdefault(routes.shape[1:], where)
        adapter = row["adapter"]
        if _missing(adapter) or adapter == BASE:
            adapter = None
        elif not isinstance(adapter, str) or not adapter:
            raise InputError(path, f"adapter must be an adapter name or null, found {adapter!r}", key=where)
        temperature = _temperature(row["temperature"], name["temperature"], n, path, where)
        records.append(dict(sample_id=sample_id, adapter=adapter, input_ids=ids, logprobs=logprobs, mask=mask,
                            sampler_logprobs=sampler, temperature=temperature, routed_experts=routes))
    if scored == 0:
        raise InputError(path, "the mask leaves no scored token in any sample (every value is false)", key="mask")
    if len(shapes) > 1:
        (one, first), (other, second) = list(shapes.items())[:2]
        raise InputError(path, f"routed_experts has {other[0]} layers x top-{other[1]} in {second} but {one[0]} x "
                         f"top-{one[1]} in {first}: a file's routes come from one model", key=name["routed_experts"])
    frame = pd.DataFrame(records, columns=COLUMNS)
    frame["temperature"] = _objects([r["temperature"] for r in records], frame)
    return frame


def _objects(values: list, frame: pd.DataFrame) -> pd.Series:
    """A column of None, floats and lists as objects: None stays None (pandas makes floats and None a float column,
    None becoming NaN)."""
    return pd.Series(values, index=frame.index, dtype=object)


def _missing(value) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _is_number(v) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_))


def _is_bool(v) -> bool:
    return isinstance(v, (bool, np.bool_)) or (_is_int(v) and v in (0, 1))


ARRAY_KINDS = {_is_int: "iu", _is_number: "iuf", _is_bool: "b"}  # numpy dtype kinds that need no look at values


def _checked(value, column: str, what: str, accepts, path, where, length: int | None = None) -> list:
    """`value` (a list, or an array from Parquet / .pt) as a list whose every entry `accepts`."""
    if _missing(value):
        raise InputError(path, f"{column} is missing", key=where)
    if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__len__"):
        raise InputError(path, f"{column} must be a list of {what}, found {type(value).__name__} {value!r:.40}",
                         key=where)
    if length is not None and len(value) != length:
        raise InputError(path, f"{column} has {len(value)} entries, expected len(input_ids)-1 = {length}", key=where)
    if getattr(getattr(value, "dtype", None), "kind", "O") not in ARRAY_KINDS[accepts]:  # look at every value
        bad = next(((i, v) for i, v in enumerate(value) if not accepts(v)), None)
        if bad is not None:
            raise InputError(path, f"{column} must hold {what}, found {bad[1]!r} ({type(bad[1]).__name__}) at "
                             f"position {bad[0]}", key=where)
    return value.tolist() if hasattr(value, "tolist") else list(value)


def _logprobs(value, column: str, length: int, path, where) -> list[float]:
    """A column of log-probabilities as floats. Each is log p of a token that was sampled or scored, so it is
    finite (p > 0: a token of probability 0 cannot have been sampled, and a dump that holds -inf for one is broken)
    and at most 0 (p <= 1; log_softmax in any float precision never rounds above 0). NaN, +inf,
    -inf and values above 0 are refused, naming the position."""
    values = _checked(value, column, "numbers", _is_number, path, where, length)
    try:
        array = np.asarray(values, dtype=np.float64)  # [length]: ints and floats alike (checked above)
    except OverflowError:  # an integer beyond any float
        array = np.array([v if abs(v) < 1e308 else math.inf if v > 0 else -math.inf for v in values], dtype=np.float64)
    bad = np.flatnonzero(~(np.isfinite(array) & (array <= 0)))
    if len(bad):
        i = int(bad[0])
        if np.isneginf(array[i]):
            why = "a log-probability of -inf (probability 0: that token cannot have been sampled; a broken dump)"
        elif np.isfinite(array[i]):
            why = "a log-probability above 0 (probability above 1: impossible)"
        else:
            why = "not a finite number"
        raise InputError(path, f"{column} must hold finite numbers <= 0 (log-probabilities), found "
                         f"{str(values[i])[:40]} at position {i}: {why}", key=where)
    return array.tolist()


def _temperature(value, column: str, n: int, path, where) -> float | list[float] | None:
    """None (not recorded), one temperature > 0 for the sample, or one per position (entry p: the temperature token
    p+1 was sampled at)."""
    if _missing(value):
        return None
    what = "a number > 0 or a list of len(input_ids)-1 numbers > 0"
    if isinstance(value, (str, bytes, dict)) or not (_is_number(value) or hasattr(value, "__len__")):
        raise InputError(path, f"{column} must be {what}, found {type(value).__name__} {value!r:.40}", key=where)
    values = [value] if _is_number(value) else _checked(value, column, "numbers > 0", _is_number, path, where, n)
    array = np.asarray([float(v) if abs(v) < 1e308 else math.inf for v in values], dtype=np.float64)
    bad = np.flatnonzero(~(np.isfinite(array) & (array > 0)))
    if len(bad):
        at = "" if _is_number(value) else f" at position {int(bad[0])}"
        raise InputError(path, f"{column} must be finite and > 0, found {values[int(bad[0])]!r:.40}{at}",
                         key=where)
    return float(array[0]) if _is_number(value) else array.tolist()


def _routes(value, column: str, n: int, path, where) -> np.ndarray | None:
    """None, or the sampler's routed experts as int32 [n, layers, top_k]: row p the experts chosen when token p was
    the forward's input (vLLM's `routed_experts`: the last token was never an input, so it has no row)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    expected = "an array [len(input_ids)-1, layers, top_k] of expert ids (integers >= 0)"
    try:
        array = _nested(value)
    except (ValueError, TypeError, RecursionError):
        raise InputError(path, f"{column} must be {expected}, with rows of one length", key=where) from None
    if array.ndim != 3 or array.dtype.kind not in "iu" or 0 in array.shape[1:]:
        kind = {"b": "booleans", "f": "floats", "O": "mixed values", "U": "strings"}.get(array.dtype.kind, "integers")
        raise InputError(path, f"{column} must be {expected}, found shape {list(array.shape)} of {kind}",
                         key=where)
    if array.shape[0] != n:
        raise InputError(path, f"{column} has {array.shape[0]} rows, expected len(input_ids)-1 = {n} (row p: "
                         "the experts chosen when token p was the input; the last token never was)", key=where)
    outside = np.argwhere((array < 0) | (array > np.iinfo(np.int32).max))
    if len(outside):
        p, layer, j = (int(i) for i in outside[0])
        raise InputError(path, f"{column} holds {array[p, layer, j]} at position {p}, layer {layer}, slot {j}: "
                         "expert ids are integers >= 0", key=where)
    return array.astype(np.int32)


def _nested(value) -> np.ndarray:
    """A nest of lists (JSON), of arrays (Parquet through pandas) or a tensor as one numpy array; ValueError when
    ragged."""
    if isinstance(value, torch.Tensor):
        return value.numpy()
    if isinstance(value, np.ndarray) and value.dtype != object:
        return value
    if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__len__"):
        raise TypeError(type(value).__name__)
    if isinstance(value, (list, tuple)) and not any(isinstance(v, np.ndarray) for v in value):
        return np.asarray(value)
    return np.stack([_nested(v) for v in value])


def resolve_temperature(frame: pd.DataFrame, form: Format, temperature: float | None, path) -> list:
    """The frame's temperature column once `temperature` (the sampling temperature given for the file) is applied.
    A file whose writer applied a temperature without recording it needs one: read at T = 1, a tempered reference
    would compare as a silent wrong answer. A file that records temperatures must agree with a given one. Rows
    without one take the given temperature; None (with none given, native files only) means T = 1."""
    if temperature is not None and (isinstance(temperature, bool) or not isinstance(temperature, (int, float))
                                    or not math.isfinite(temperature) or temperature <= 0):
        raise InputError("--temperature", f"expected a finite number > 0, found {temperature!r}")
    temps = list(frame["temperature"])
    if temperature is None:
        if form.temperature_key and any(t is None for t in temps):
            raise InputError(path, f"a {form.name} file holds logprobs taken at a temperature it does not record: "
                             f"give it as --temperature T (the run's {form.temperature_key}; --temperature 1.0 if it "
                             "was 1)")
        return temps
    for t, sample_id in zip(temps, frame["sample_id"]):
        values = [] if t is None else t if isinstance(t, list) else [t]
        other = next((v for v in values if not math.isclose(v, temperature, rel_tol=1e-6)), None)
        if other is not None:
            raise InputError(path, f"records temperature {other:g} but --temperature {temperature:g} was given: leave "
                             "--temperature out for a file that records its own", key=f"sample {sample_id}")
    return [float(temperature) if t is None else t for t in temps]


def _first_outside(ids: list[int], vocab_size: int) -> int | None:
    """The first token id outside [0, vocab_size), or None (vectorised; Python's ints may exceed int64)."""
    try:
        array = np.asarray(ids, dtype=np.int64)  # [n]
    except OverflowError:
        return next((t for t in ids if not 0 <= t < vocab_size), None)
    outside = np.flatnonzero((array < 0) | (array >= vocab_size))
    return ids[int(outside[0])] if len(outside) else None


def reference_bytes(frame: pd.DataFrame, where: str | Path, metadata: dict[bytes, bytes] | None = None) -> bytes:
    """A reference DataFrame (validated first) in the native Parquet format, with `metadata` in its schema."""
    frame = validate(frame, where)
    table = pa.Table.from_pandas(frame[SCHEMA.names], schema=SCHEMA, preserve_index=False)
    temps, routes = list(frame["temperature"]), list(frame["routed_experts"])
    if any(t is not None for t in temps):
        table = table.append_column("temperature", _temperature_array(temps, frame["logprobs"]))
    if any(r is not None for r in routes):
        table = table.append_column("routed_experts", _routes_array(routes))
    if metadata:
        table = table.replace_schema_metadata({**(table.schema.metadata or {}), **metadata})
    buffer = io.BytesIO()
    pq.write_table(table, buffer)
    return buffer.getvalue()


def _temperature_array(temps: list, logprobs) -> pa.Array:
    """float64 when every row holds one temperature (or none), else one per position (a row's one expanded)."""
    if all(not isinstance(t, list) for t in temps):
        return pa.array(temps, pa.float64())
    return pa.array([t if t is None or isinstance(t, list) else [t] * len(lp) for t, lp in zip(temps, logprobs)],
                    pa.list_(pa.float64()))


def _routes_array(routes: list) -> pa.Array:
    """list<list<list<int32>>> from [n, L, k] arrays (None: null), built from offsets: tolist() on long dumps
    would cost seconds."""
    present = [r for r in routes if r is not None]
    values = pa.array(np.concatenate([r.reshape(-1) for r in present]), pa.int32())

    def offsets(sizes):
        return pa.array(np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]).astype(np.int32))

    experts = pa.ListArray.from_arrays(offsets(np.concatenate([np.full(r.shape[0] * r.shape[1], r.shape[2])
                                                               for r in present])), values)
    layers = pa.ListArray.from_arrays(offsets(np.concatenate([np.full(r.shape[0], r.shape[1]) for r in present])),
                                      experts)
    return pa.ListArray.from_arrays(offsets([0 if r is None else r.shape[0] for r in routes]), layers,
                                    mask=pa.array([r is None for r in routes]))


def write_reference(frame: pd.DataFrame, path: str | Path) -> Path:
    """Write a reference DataFrame (validated first) as the native Parquet format."""
    path = Path(path)
    path.write_bytes(reference_bytes(frame, path))
    return path


def reference_arg(ref) -> str:
    """A reference as given to compare or diagnose, for run.json's arguments: PATH, or NAME=PATH for an (adapter
    name, path) pair."""
    return f"{ref[0]}={ref[1]}" if isinstance(ref, tuple) else str(ref)


def reference_inputs(references) -> dict[str, str]:
    """The reference files under their names in a run's fingerprint: 'reference {i}/{file name}' -> path."""
    paths = [ref[1] if isinstance(ref, tuple) else ref for ref in references]
    return {f"reference {i}/{Path(path).name}": path for i, path in enumerate(paths)}
