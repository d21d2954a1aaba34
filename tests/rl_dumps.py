"""RL frameworks' dump files built to each framework's published schema (each writer names the source file and
commit it follows), from samples given as dicts: ids (N token ids), mask (N-1 bools, position p scores token p+1),
trainer and sampler (N-1 logprobs), temperature (N-1), routes ([N-1, layers, top_k]) and prompt (the prompt's token
count: the mask is False before it). Used by test_frameworks.py and by test_docs.py's workspace."""

from __future__ import annotations

import json
import math
from pathlib import Path

import msgpack
import numpy as np
import pandas as pd
import torch

def nemo_rl_file(path: Path, truth: list[dict], nested: bool = True) -> Path:
    """NVIDIA-NeMo/RL @ 7ea279a nemo_rl/algorithms/grpo.py (~3155-3270, ~3629-3653) through nemo_rl/utils/logger.py
    log_batched_dict_as_jsonl: token_ids right-padded to S (a multiple of 8), position i = token i (index 0 is 0),
    each value a length-1 slice ([x], [[...]]) when `nested`."""
    s = 8 * math.ceil(max(len(t["ids"]) for t in truth) / 8)
    wrap = (lambda v: [v]) if nested else (lambda v: v)
    lines = []
    for idx, t in enumerate(truth):
        size = len(t["ids"])

        def padded(first, values, pad=0.0):
            return [first, *values] + [pad] * (s - size)

        lines.append({"content": wrap(["What is 2+2?", "4"]), "rewards": wrap(1.0), "input_lengths": wrap(size),
                      "token_ids": wrap(t["ids"].tolist() + [0] * (s - size)),
                      "token_loss_mask": wrap(padded(0, t["mask"].astype(int).tolist(), 0)),
                      "sample_loss_mask": wrap(1.0), "advantages": wrap(padded(0.0, [0.5] * (size - 1))),
                      "generation_logprobs": wrap(padded(0.0, t["sampler"].tolist())),
                      "prev_logprobs": wrap(padded(0.0, t["trainer"].tolist())), "idx": idx})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def prime_export_file(path: Path, truth: list[dict]) -> Path:
    """PrimeIntellect-ai/prime-rl @ 559b447 src/prime_rl/trainer/rl/token_export.py (SCHEMA_VERSION 1): per-token
    lists of length N, position i = token i; trainer index 0 = log(1/V)."""
    lines = []
    for i, t in enumerate(truth):
        size = len(t["ids"])
        lines.append(dict(schema_version=1, step=3, rank=0, micro_step=0, micro_sequence_idx=i, export_sequence_idx=i,
                          env_name="math", token_ids=t["ids"].tolist(), position_ids=list(range(size)),
                          loss_mask=[False, *t["mask"].tolist()], advantages=[0.5] * size,
                          inference_logprobs=[0.0, *t["sampler"].tolist()],
                          trainer_logprobs=[-math.log(151936), *t["trainer"].tolist()], entropy=[1.0] * size,
                          mismatch_kl=[None] * size, is_masked=[False] * size, rl_weights=[None] * size))
    path.write_text("".join(json.dumps(line, separators=(",", ":")) + "\n" for line in lines))
    return path


def prime_rollouts_file(path: Path, truth: list[dict], per_batch: int = 2, pad_to: int = 8) -> Path:
    """PrimeIntellect-ai/prime-rl @ 559b447 src/prime_rl/transports/rollouts/filesystem.py: msgpack of
    list[MicroBatch] (types.py: array_like, all 16 fields positional, None as nil); samples packed back to back,
    position_ids restarting at 0; trainer/batch.py pad_micro_batch's padding (token 1, loss_mask False, position_ids
    restarting, temperature 1.0, counted in the last sequence_lengths); routed_experts [bytes, [S, L, K], "uint8"]
    with each sample's last row a copy (verifiers graph.py _attribute_routed_experts)."""
    batches = []
    for b in range(0, len(truth), per_batch):
        group = truth[b:b + per_batch]
        ids, mask, lp, pos, temps, routes = [], [], [], [], [], []
        for t in group:
            size = len(t["ids"])
            ids += t["ids"].tolist()
            mask += [False, *t["mask"].tolist()]
            lp += [0.0, *t["sampler"].tolist()]
            pos += list(range(size))
            temps += [float(t["temperature"][0]), *t["temperature"].tolist()]
            routes.append(np.concatenate([t["routes"], t["routes"][-1:]]))
        lengths = [len(t["ids"]) for t in group]
        pad = (pad_to - len(ids) % pad_to) % pad_to
        ids += [1] * pad
        mask += [False] * pad
        lp += [0.0] * pad
        pos += list(range(pad))
        temps += [1.0] * pad
        lengths[-1] += pad
        packed = np.concatenate(routes + [np.zeros((pad, *routes[0].shape[1:]), dtype=np.int64)]).astype(np.uint8)
        batches.append([ids, mask, [0.5] * len(ids), lp, pos, lengths, temps, ["math"] * len(ids), list(lengths),
                        None, [packed.tobytes(), list(packed.shape), "uint8"], None, None, None, None, None])
    path.write_bytes(msgpack.packb(batches, use_bin_type=True))
    return path


def slime_rollout_file(path: Path, truth: list[dict]) -> Path:
    """THUDM/slime @ 624b824 slime/observability/rollout_data_utils.py save_debug_rollout_data:
    torch.save({rollout_id, samples: [Sample.to_dict()]}) (slime/utils/types.py): tokens (N), response_length R,
    loss_mask (R), rollout_log_probs (R, the sampler), rollout_routed_experts int32 [N-1, L, K]."""
    out = []
    for i, t in enumerate(truth):
        r = len(t["ids"]) - t["prompt"]
        out.append(dict(group_index=i // 2, index=i, prompt="p", response="r", tokens=t["ids"].tolist(),
                        response_length=r, loss_mask=t["mask"][-r:].astype(int).tolist(),
                        rollout_log_probs=t["sampler"][-r:].tolist(), reward=1.0, status="completed", metadata={},
                        rollout_routed_experts=torch.tensor(t["routes"], dtype=torch.int32)))
    torch.save(dict(rollout_id=3, samples=out), path)
    return path


def slime_train_file(path: Path, truth: list[dict]) -> Path:
    """THUDM/slime @ 624b824 slime/observability/train_data_utils.py _build_dump_payload: format_version 2, samples
    of tensors: tokens, response_lengths, total_lengths, loss_masks, rollout_log_probs, log_probs (the trainer),
    rollout_routed_experts."""
    out = []
    for i, t in enumerate(truth):
        r = len(t["ids"]) - t["prompt"]
        out.append(dict(data_parallel_rank=0, sample_index=i, rollout_position=i, tokens=torch.tensor(t["ids"]),
                        response_lengths=r, total_lengths=len(t["ids"]),
                        loss_masks=torch.tensor(t["mask"][-r:].astype(int)),
                        rollout_log_probs=torch.tensor(t["sampler"][-r:], dtype=torch.float32),
                        log_probs=torch.tensor(t["trainer"][-r:], dtype=torch.float32), rewards=1.0,
                        rollout_routed_experts=torch.tensor(t["routes"], dtype=torch.int32)))
    torch.save(dict(format_version=2, rollout_id=3, rank=0, samples=out, dp_shards=[], raw_reward=[1.0]), path)
    return path




def framework_kit(root: Path, frame: pd.DataFrame, config: dict, seed: int = 0) -> None:
    """The frameworks' files of README's examples in `root`, holding the samples of a validated reference frame
    (adapter `mine`): logs/train_data_step3.jsonl (NeMo-RL), token_exports/step_3/rank_0.jsonl and
    rollouts/step_3/rank_0.bin (prime-rl, the latter at temperature 1.0 per token), dump/train_data/3.pt (slime) and
    gen_batch.dp (a pickle, as verl's: refused). Routes are random experts of the model `config` describes."""
    rng = np.random.default_rng(seed)
    experts = config.get("num_experts") or config["num_local_experts"]
    truth = []
    for ids, logprobs, mask, sampler in frame[["input_ids", "logprobs", "mask", "sampler_logprobs"]].itertuples(
            index=False, name=None):
        n = len(ids) - 1
        mask = np.ones(n, dtype=bool) if mask is None else np.asarray(mask, dtype=bool)
        lp = np.asarray(logprobs, dtype=np.float64)
        layers, k = config["num_hidden_layers"], config["num_experts_per_tok"]
        routes = np.stack([rng.permutation(experts)[:k] for _ in range(n * layers)]).reshape(n, layers, k)
        truth.append(dict(ids=np.asarray(ids), mask=mask, trainer=lp, prompt=int(np.argmax(mask)) + 1,
                          sampler=lp if sampler is None else np.asarray(sampler, dtype=np.float64),
                          temperature=np.ones(n), routes=routes))
    for name, write in [("logs/train_data_step3.jsonl", nemo_rl_file),
                        ("token_exports/step_3/rank_0.jsonl", prime_export_file),
                        ("rollouts/step_3/rank_0.bin", prime_rollouts_file),
                        ("dump/train_data/3.pt", slime_train_file)]:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        write(root / name, truth)
    (root / "gen_batch.dp").write_bytes(b"\x80\x04\x95\x10\x00\x00\x00\x00\x00\x00\x00\x8c\rverl.protocol\x94"
                                        b"\x8c\tDataProto\x94")
