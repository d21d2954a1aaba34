"""`lora-eval mmlu`: MMLU accuracy of the base model and of every adapter in one pass, with paired deltas.

A thin layer over `Engine.next_token_logprobs`: read the questions (mmlu_data.py) before any model is loaded,
tokenise the prompts (mmlu_prompts.py; loading onto a GPU, in a child process beside the model's load:
mmlu_tokenize.py), score the four answer letters of every question under the base model and each adapter in mixed
batches (the batches are the resumable units of a run folder), and build the tables (mmlu_stats.py).

Shared prefixes (on unless `EngineOptions.prefix_cache` is off, `--no-prefix-cache`): a subject's prompts all begin
with its header and k-shot examples, so that part is computed once per (subject, adapter) and each question runs only
its own part (`Batch.prefixes`, lora_eval/prefixes.py). The boundary is the longest common run of leading token ids
of the prompts as they are tokenised whole (per subject and number of shots kept), so the tokens computed are
exactly the full prompts' tokens: no text is tokenised apart, and the prompts stay byte for byte lm-eval's. Batches
then take a subject's questions together (by length inside it), so that a batch needs few prefixes and the cache
rarely evicts. Under expert parallel prefixes are off (a prefix pass is a forward one rank would run alone, and every
rank must take part in every MoE layer's exchange).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from ...distributed import Ranks, together
from ...engine.batching import batches_in_order, make_batches, padding_waste
from ...engine.engine import DTYPES, Batch, Engine, EngineOptions, first_non_finite, overflow_error, read_adapters
from ...engine.plan import check_fits
from ...engine.prefixes import common_length, grouped_order, prefix_bytes_per_token
from ...errors import InputError
from ...inputs.checks import adapter_names, model_config, positive_int, threshold
from ...inputs.mmlu_data import LETTERS, check_shots, read_split, select
from ...names import BASE
from ...render.files import report_files
from ...results.mmlu_stats import question_table, subject_table, summary_table
from ...results.runfolder import InputDigests, RunFolder, check_out, fingerprint, now, run_inputs, versions
from ...results.tables import MmluResult, Phases, read_run, table_files
from ...runners.compile_clock import COMPILE_CLOCK
from .prompts import Tokenized, tokenize
from .tokenize import TokenizeBeside

BATCH_TOKENS = 16384


def subject_prefixes(questions: pd.DataFrame, used: list[int], ids: list[list[int]]) -> tuple[list, list[int]]:
    """Per question, its prefix group ((subject, shots kept): sortable) and how many leading tokens it shares with
    the group: the longest common run of leading token ids of the group's prompts, at most every prompt's length
    minus 1 (a question keeps at least one token of its own); 0 where the group has one question (nothing to
    share)."""
    groups = list(zip(questions["subject"].tolist(), [-u for u in used]))
    members: dict = {}
    for q, g in enumerate(groups):
        members.setdefault(g, []).append(q)
    shared = [0] * len(ids)
    for rows in members.values():
        if len(rows) < 2:
            continue
        first = ids[rows[0]]
        n = min(len(ids[q]) for q in rows) - 1
        for q in rows[1:]:  # (slices compared in C; a run of tokens through Python only where n shrinks)
            if ids[q][:n] != first[:n]:
                n = common_length(first[:n], ids[q])
        for q in rows:
            shared[q] = max(n, 0)
    return groups, shared


def tokenizes_beside(engine: Engine | None, options: EngineOptions) -> bool:
    """Whether the tokenizer's load and the prompts go to a child process beside the model's load
    (mmlu_tokenize.py): where a model is loaded here onto a GPU. On the CPU the load is short, and the child's start
    (~2 s of imports) would only compete with it for the cores."""
    return engine is None and options.device != "cpu"


def checked_tokens(tokens: Tokenized, vocab_size: int, model: str | Path) -> Tokenized:
    """`tokens`, once every id is inside the model's vocabulary (else the tokenizer belongs to another model)."""
    largest = max([*tokens.candidates, *(max(row) for row in tokens.ids if row)])
    if largest >= vocab_size:
        raise InputError(Path(model) / "config.json", f"the tokenizer makes token id {largest}, outside the model's "
                         f"vocabulary ({vocab_size}): the tokenizer in the model folder does not belong to this model",
                         key="vocab_size")
    return tokens


def mmlu(model: str | Path, adapters: dict[str, str | Path] | None = None, data: str | Path | None = None, *,
         out: str | Path | None = None, split: str = "test", shots: int = 5, subjects=None, limit: int | None = None,
         max_drop: float | None = None, options: EngineOptions | None = None, batch_tokens: int = BATCH_TOKENS,
         quiet: bool = False, overwrite: bool = False, engine: Engine | None = None, notice=print) -> MmluResult:
    """Score every question of `split` for the base model and each adapter in one pass; return (and, with
    `out`, write) the per-question, per-subject and summary tables. `subjects`: names (list or comma string)
    to keep; `limit`: the first N questions of each subject; `max_drop`: percentage points. With `out`, the run
    is a run folder (runfolder.py): complete runs of the same inputs are returned as saved, partial ones resumed,
    others refused unless `overwrite`. `engine`: an engine already built (its adapters replace `adapters`; `model`
    is then the folder with config.json and the tokenizer only, e.g. for benchmarks on in-memory weights)."""
    phases = Phases()
    ranks = Ranks.from_env()
    with together(ranks):  # every rank checks the same inputs; one line says what is wrong
        options = (options or EngineOptions()).resolved()
        adapters = adapter_names(adapters if engine is None else {a.name: a.path for a in engine.adapters})
        if isinstance(subjects, str):
            subjects = [s.strip() for s in subjects.split(",") if s.strip()]
            if not subjects:
                raise InputError("--subjects", "no subject named (expected A,B,...; leave it out for all subjects)")
        if data is None:
            raise InputError("--data", "an MMLU data folder is needed")
        if split not in ("test", "val"):
            raise InputError("--split", f"'{split}' is not one of test, val")
        shots = positive_int(shots, "--shots", low=0)
        limit = None if limit is None else positive_int(limit, "--limit")
        batch_tokens = positive_int(batch_tokens, "--batch-tokens")
        max_drop = threshold(max_drop, "--max-drop")
        out = check_out(out, inputs=run_inputs(model, adapters, data=data))
        arguments = dict(model=str(model), adapters={k: str(v) for k, v in adapters.items()}, data=str(data),
                         split=split, shots=shots, subjects=subjects, limit=limit, max_drop=max_drop,
                         batch_tokens=batch_tokens)
    with RunFolder(out, "mmlu", overwrite=overwrite, notice=notice, ranks=ranks) as folder:  # the lock, first
        with together(ranks):
            with phases("data"):
                layout, files, questions = read_split(data, split)
                questions = select(questions, subjects, limit, data, split)
                dev = None
                if shots > 0:
                    _, dev_files, dev = read_split(data, "dev")
                    files += dev_files
                    dev = check_shots(dev, questions, shots, layout, data)

            with phases("load"):  # the model's config (its tokenizer comes with the prompts)
                args = model_config(model)[1]
                max_len = args.max_position_embeddings  # (checked by the config's reader: an integer >= 2)
            # the inputs are hashed on a thread meanwhile; loading onto a GPU, transformers' import (which holds the
            # GIL: beside it MMLU's load phase took ~1.5 s longer on an H100, BENCHMARKS-history section 13) is the
            # child's
            data_root = Path(data)
            digests = InputDigests(model, adapters, {f"data/{path.relative_to(data_root)}": path
                                                     for path in sorted(set(files))})  # (result() below)

            tokenizing = TokenizeBeside(model, questions, dev, shots, max_len) if tokenizes_beside(engine, options) \
                else None
            tokens = None
            if tokenizing is None:
                with phases("tokenize"):
                    tokens = checked_tokens(tokenize(model, questions, dev, shots, max_len), args.vocab_size, model)
            with phases("load"):  # the adapters' files (the model's follow once the run folder is ours)
                if engine is None:  # (with the prefix cache's bound where the subjects' shots are reused)
                    check_fits(model, adapters, options.device, options.dtype, batch_tokens,
                               ranks.world if ranks and options.expert_parallel else 1,
                               options.prefix_cache_memory if options.prefix_cache and not options.expert_parallel
                               else 0)
                parsed = None if engine is not None else read_adapters(model, adapters, options)
            models = [BASE, *adapters]
            tags = [None, *adapters]
            use_prefixes = bool(options.prefix_cache) and not options.expert_parallel
            task_options = dict(options.record(), split=split, shots=shots, subjects=subjects, limit=limit,
                                max_drop=max_drop, batch_tokens=batch_tokens, prefix_cache=use_prefixes,
                                engine="given" if engine is not None else "loaded")
            with phases("data"):  # the inputs' fingerprints (data files whole, weights sampled), hashed meanwhile
                inputs = digests.result()
                package_versions = versions("datasets", "tokenizers")
        folder.open(fingerprint("mmlu", inputs, task_options, package_versions), dict(arguments=arguments))
        if folder.stored is not None:
            if tokenizing is not None:
                tokenizing.cancel()  # (nothing to load or tokenise)
            return read_run(out)
        if tokenizing is not None:
            with tokenizing:  # (the child is stopped on the way out, whatever happens)
                with phases("load"):  # the model's weights, beside the child
                    engine = Engine.load(model, parsed, options)
                with together(ranks), phases("tokenize"):  # what of the child's work the load did not hide
                    tokens = checked_tokens(tokenizing.result(), args.vocab_size, model)
        with phases("tokenize"):
            ids, used, candidates = tokens.ids, tokens.used, tokens.candidates
            rows_ids = [row for row in ids for _ in tags]  # question-major: a question's rows share a batch
            rows_tags = tags * len(ids)
            lengths = [len(row) for row in rows_ids]
            if use_prefixes:  # (the shared prefixes and batches, from the token ids)
                groups, shared = subject_prefixes(questions, used, ids)
                rows_prefix = [shared[q] for q in range(len(ids)) for _ in tags]
                suffix = [n - p for n, p in zip(lengths, rows_prefix)]
                per_token = prefix_bytes_per_token(args, DTYPES[options.dtype])
                group_bytes = {g: shared[q] * per_token * len(tags) for q, g in enumerate(groups)}  # every model's
                cache = engine.prefix_cache.budget if engine is not None else options.prefix_cache_memory
                batches = batches_in_order(grouped_order(suffix, [groups[q] for q in range(len(ids)) for _ in tags],
                                                         group_bytes, cache), suffix, batch_tokens)
            else:
                rows_prefix, suffix = None, lengths
                batches = make_batches(lengths, batch_tokens)
        with phases("load"):
            engine = engine or Engine.load(model, parsed, options)
        # said once every input (the weights too) is checked: an input error stays the only line on stderr
        if options.prefix_cache and options.expert_parallel:
            notice("mmlu: shared prefixes are off under --expert-parallel (every rank takes part in every forward); "
                   "full prompts run")

        compiled = COMPILE_CLOCK.seconds  # Triton's compile seconds so far (runners/compile_clock.py)
        with phases("forward"), folder.work([len(b) for b in batches], "mmlu", "rows", quiet,
                                            lockstep=options.expert_parallel) as work:
            def start(b):
                if b is None:
                    return engine.stand_in()
                batch = batches[b]
                before = engine.tokens_computed
                scores = engine.start_next_token_logprobs(
                    Batch([rows_ids[i] for i in batch], [rows_tags[i] for i in batch],
                          None if rows_prefix is None else [rows_prefix[i] for i in batch]), candidates)
                return scores, engine.tokens_computed - before

            def finish(b, started):
                scores, computed = started[0].get(), started[1]
                bad = first_non_finite(scores)
                if bad is not None:  # (accuracy would be computed from NaN)
                    row = batches[b][bad]
                    q = questions.iloc[row // len(tags)]
                    raise overflow_error(model, adapters, rows_tags[row],
                                         f"{q['subject']} question {q['question_index']}", options.dtype)
                scores = scores.numpy()
                return pd.DataFrame({"row": batches[b], **{f"lp_{x}": scores[:, j] for j, x in enumerate(LETTERS)},
                                     "tokens_computed": np.asarray([computed] + [0] * (len(batches[b]) - 1),
                                                                   dtype=np.int64)})  # the unit's, on its first row

            work.overlapped(range(len(batches)), start, finish)
        phases.captured(engine.graph_stats(), COMPILE_CLOCK.seconds - compiled)

        def merge(frames: dict[int, pd.DataFrame]) -> MmluResult:
            with phases("metrics"):
                lp = np.empty((len(rows_ids), len(LETTERS)), dtype=np.float32)  # [rows, 4]
                tokens_computed = 0  # by whichever run and rank computed each unit
                for frame in frames.values():
                    lp[frame["row"].to_numpy()] = frame[[f"lp_{x}" for x in LETTERS]].to_numpy(dtype=np.float32)
                    tokens_computed += int(frame["tokens_computed"].sum()) if "tokens_computed" in frame else 0
                table = question_table(questions, models, lp.reshape(len(ids), len(models), len(LETTERS)))
                subject_rows = subject_table(table)
                summary = summary_table(table, max_drop)
            timings = phases.timings()
            prompt_lengths = np.array([len(row) for row in ids])
            computed_s = max(timings["forward_s"], 1e-9)
            run = folder.run_record(
                arguments=arguments, timings=timings,
                resolved=dict(device=options.device, dtype=options.dtype, ranks=ranks.world if ranks else 1,
                              batch_invariant=options.batch_invariant),
                work=work.stats(), questions=len(ids), rows=len(rows_ids), batches=len(batches),
                padding_waste=padding_waste(suffix, batches),
                tokens_computed=tokens_computed, tokens_full_prompts=int(sum(lengths)),
                prefix_cache=dict(enabled=use_prefixes, computed_share=tokens_computed / max(sum(lengths), 1),
                                  rows_with_prefix=sum(1 for p in rows_prefix or () if p),
                                  this_process=engine.prefix_stats()),
                questions_per_s=work.stats()["computed"] / len(models) / computed_s,
                rows_per_s=work.stats()["computed"] / computed_s,
                prompts=dict(shots=shots, tokens_mean=float(prompt_lengths.mean()) if len(ids) else 0.0,
                             tokens_max=int(prompt_lengths.max()) if len(ids) else 0, max_position_embeddings=max_len,
                             with_fewer_shots=int(sum(u < shots for u in used)),
                             tokenized_beside_load_s=None if tokenizing is None else tokenizing.seconds),
                answer_tokens={x: dict(id=t, token=name)
                               for x, t, name in zip(LETTERS, candidates, tokens.candidate_tokens)},
                data=dict(layout=layout, path=str(data), files=len(set(files))),
                quantization=engine.model.args.quantization, cuda_graphs=engine.graph_stats())
            result = MmluResult(questions=table, subjects=subject_rows, summary=summary, run=run)
            result.run["completed"] = dict(at=now(), passed=result.passed, exit_code=result.exit_code)
            with phases("write"):  # (the reports show the phases before this one: results.WRITTEN_AFTER_REPORTS)
                written = {**table_files(result), **report_files(result)}
            result.run["timings"] = phases.timings()
            folder.commit(written, result.run)
            return result

        return folder.finish(work, merge, lambda: read_run(out))
