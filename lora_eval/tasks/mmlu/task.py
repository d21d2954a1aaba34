"""`lora-eval mmlu`: MMLU accuracy of the base model and of every adapter in one pass, with paired deltas.

A thin layer over `Engine.next_token_logprobs`: read the questions (inputs/mmlu_data.py) before any model is loaded,
tokenise the prompts (prompts.py; loading onto a GPU, in a child process beside the model's load:
tokenize.py), score the four answer letters of every question under the base model and each adapter in mixed
batches (the resumable units of the run protocol, tasks/run.py), and build the tables (results/mmlu_stats.py).

Shared prefixes (on unless `EngineOptions.prefix_cache` is off, `--no-prefix-cache`): a subject's prompts all begin
with its header and k-shot examples, so that part is computed once per (subject, adapter) and each question runs only
its own part (`Batch.prefixes`, engine/prefixes.py). The boundary is the longest common run of leading token ids
of the prompts as they are tokenised whole (per subject and number of shots kept), so the tokens computed are
exactly the full prompts' tokens: no text is tokenised apart, and the prompts stay byte for byte lm-eval's. Batches
then take a subject's questions together (by length inside it), so that a batch needs few prefixes and the cache
rarely evicts. Under expert parallel prefixes are off (a prefix pass is a forward one rank would run alone, and every
rank must take part in every MoE layer's exchange).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from ...distributed import together
from ...engine.batching import batches_in_order, make_batches, padding_waste
from ...engine.engine import DTYPES, Batch, Engine, EngineOptions, first_non_finite, overflow_error, read_adapters
from ...engine.plan import check_fits
from ...engine.prefixes import common_length, grouped_order, prefix_bytes
from ...errors import InputError
from ...inputs.checks import adapter_names, model_config, positive_int, threshold
from ...inputs.mmlu_data import LETTERS, check_shots, read_split, select
from ...names import BASE
from ...render.files import report_files
from ...results.mmlu_stats import question_table, subject_table, summary_table
from ...results.runfolder import Work, run_inputs
from ...results.tables import MmluResult, read_run, table_files
from ..run import Hashed, Plan, Run, Task, Units, run_task
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
    (tokenize.py): where a model is loaded here onto a GPU. On the CPU the load is short, and the child's start
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
    is a run folder (results/runfolder.py): complete runs of the same inputs are returned as saved, partial ones
    resumed, others refused unless `overwrite`. `engine`: an engine already built (its adapters replace `adapters`;
    `model` is then the folder with config.json and the tokenizer only, e.g. for benchmarks on in-memory weights)."""
    task = MmluTask(model, adapters, data, split=split, shots=shots, subjects=subjects, limit=limit,
                    max_drop=max_drop, options=options, batch_tokens=batch_tokens, engine=engine)
    return run_task(task, out, overwrite=overwrite, quiet=quiet, notice=notice)


@dataclass
class MmluTask(Task):
    """mmlu through the run protocol (tasks/run.py), with the arguments of `mmlu`. Units: batches of rows, a row
    being a question under one model (base or an adapter); a question's rows share a batch."""

    command = "mmlu"
    tokenizing = None  # the prompts, tokenised in a child process beside the model's load (tokenize.py)
    model: str | Path
    adapters: dict | None
    data: str | Path | None
    split: str
    shots: int
    subjects: list | str | None
    limit: int | None
    max_drop: float | None
    options: EngineOptions | None
    batch_tokens: int
    engine: Engine | None

    def check(self, run: Run) -> dict:
        self.options = (self.options or EngineOptions()).resolved()
        self.adapters = adapter_names(self.adapters if self.engine is None
                                      else {a.name: a.path for a in self.engine.adapters})
        if isinstance(self.subjects, str):
            self.subjects = [s.strip() for s in self.subjects.split(",") if s.strip()]
            if not self.subjects:
                raise InputError("--subjects", "no subject named (expected A,B,...; leave it out for all subjects)")
        if self.data is None:
            raise InputError("--data", "an MMLU data folder is needed")
        if self.split not in ("test", "val"):
            raise InputError("--split", f"'{self.split}' is not one of test, val")
        self.shots = positive_int(self.shots, "--shots", low=0)
        self.limit = None if self.limit is None else positive_int(self.limit, "--limit")
        self.batch_tokens = positive_int(self.batch_tokens, "--batch-tokens")
        self.max_drop = threshold(self.max_drop, "--max-drop")
        run.arguments = dict(model=str(self.model), adapters={k: str(v) for k, v in self.adapters.items()},
                             data=str(self.data), split=self.split, shots=self.shots, subjects=self.subjects,
                             limit=self.limit, max_drop=self.max_drop, batch_tokens=self.batch_tokens)
        return run_inputs(self.model, self.adapters, data=self.data)

    def plan(self, run: Run) -> Plan:
        options, phases, model, shots = self.options, run.phases, self.model, self.shots
        with phases("data"):
            layout, files, questions = read_split(self.data, self.split)
            self.questions = questions = select(questions, self.subjects, self.limit, self.data, self.split)
            dev = None
            if shots > 0:
                _, dev_files, dev = read_split(self.data, "dev")
                files += dev_files
                dev = check_shots(dev, questions, shots, layout, self.data)
            self.data_record = dict(layout=layout, path=str(self.data), files=len(set(files)))
        with phases("load"):  # the model's config (its tokenizer comes with the prompts)
            self.args = model_config(model)[1]
            self.max_len = self.args.max_position_embeddings  # (checked by the config's reader: an integer >= 2)
        # the data files are hashed on a thread meanwhile (Plan.hashed); loading onto a GPU, transformers' import
        # (which holds the GIL) is the child's (BENCHMARKS-history section 13)
        root = Path(self.data)
        data_files = Hashed(files={f"data/{path.relative_to(root)}": path for path in sorted(set(files))})
        self.tokens = None
        if tokenizes_beside(self.engine, options):
            self.tokenizing = TokenizeBeside(model, questions, dev, shots, self.max_len)
        else:
            with phases("tokenize"):
                self.tokens = checked_tokens(tokenize(model, questions, dev, shots, self.max_len),
                                             self.args.vocab_size, model)
        with phases("load"):  # the adapters' files (the model's follow once the run folder is ours)
            if self.engine is None:  # (with the prefix cache's bound where the subjects' shots are reused)
                check_fits(model, self.adapters, options.device, options.dtype, self.batch_tokens,
                           run.ranks.world if run.ranks and options.expert_parallel else 1,
                           options.prefix_cache_memory if options.prefix_cache and not options.expert_parallel
                           else 0)
            self.parsed = None if self.engine is not None else read_adapters(model, self.adapters, options)
        self.models, self.tags = [BASE, *self.adapters], [None, *self.adapters]
        self.use_prefixes = bool(options.prefix_cache) and not options.expert_parallel
        task_options = dict(options.record(), split=self.split, shots=shots, subjects=self.subjects,
                            limit=self.limit, max_drop=self.max_drop, batch_tokens=self.batch_tokens,
                            prefix_cache=self.use_prefixes, engine="given" if self.engine is not None else "loaded")
        return Plan(task_options, ("datasets", "tokenizers"), phase="data", hashed=[data_files])

    def hashed(self) -> list[Hashed]:
        return [Hashed(self.model, self.adapters)]

    def cancel(self) -> None:
        if self.tokenizing is not None:
            self.tokenizing.cancel()  # (nothing to load or tokenise)

    def read(self, out: Path) -> MmluResult:
        return read_run(out)

    def load(self, run: Run) -> Units:
        phases = run.phases
        if self.tokenizing is not None:
            with self.tokenizing:  # (the child is stopped on the way out, whatever happens)
                with phases("load"):  # the model's weights, beside the child
                    self.engine = Engine.load(self.model, self.parsed, self.options)
                with together(run.ranks), phases("tokenize"):  # what of the child's work the load did not hide
                    self.tokens = checked_tokens(self.tokenizing.result(), self.args.vocab_size, self.model)
        with phases("tokenize"):
            self._plan_rows()
        with phases("load"):
            self.engine = self.engine or Engine.load(self.model, self.parsed, self.options)
        # said once every input (the weights too) is checked: an input error stays the only line on stderr
        if self.options.prefix_cache and self.options.expert_parallel:
            run.notice("mmlu: shared prefixes are off under --expert-parallel (every rank takes part in every "
                       "forward); full prompts run")
        return Units([len(b) for b in self.batches], "rows", lockstep=self.options.expert_parallel)

    def _plan_rows(self) -> None:
        """The rows (every question under every model, question-major: a question's rows share a batch), their
        shared prefixes and the batches, from the token ids."""
        ids, tags = self.tokens.ids, self.tags
        self.rows_ids = [row for row in ids for _ in tags]
        self.rows_tags = tags * len(ids)
        self.lengths = lengths = [len(row) for row in self.rows_ids]
        if self.use_prefixes:
            groups, shared = subject_prefixes(self.questions, self.tokens.used, ids)
            self.rows_prefix = [shared[q] for q in range(len(ids)) for _ in tags]
            self.suffix = suffix = [n - p for n, p in zip(lengths, self.rows_prefix)]
            dtype = DTYPES[self.options.dtype]
            group_bytes = {g: prefix_bytes(self.args, dtype, shared[q]) * len(tags)  # every model's
                           for q, g in enumerate(groups)}
            cache = self.engine.prefix_cache.budget if self.engine is not None else self.options.prefix_cache_memory
            order = grouped_order(suffix, [groups[q] for q in range(len(ids)) for _ in tags], group_bytes, cache)
            self.batches = batches_in_order(order, suffix, self.batch_tokens)
        else:
            self.rows_prefix, self.suffix = None, lengths
            self.batches = make_batches(lengths, self.batch_tokens)

    def run(self, work: Work, run: Run) -> None:
        work.overlapped(range(len(self.batches)), self._start, self._finish)

    def _start(self, b):
        if b is None:
            return self.engine.stand_in()
        batch = self.batches[b]
        before = self.engine.tokens_computed
        scores = self.engine.start_next_token_logprobs(
            Batch([self.rows_ids[i] for i in batch], [self.rows_tags[i] for i in batch],
                  None if self.rows_prefix is None else [self.rows_prefix[i] for i in batch]), self.tokens.candidates)
        return scores, self.engine.tokens_computed - before

    def _finish(self, b, started) -> pd.DataFrame:
        scores, computed = started[0].get(), started[1]
        bad = first_non_finite(scores)
        if bad is not None:  # (accuracy would be computed from NaN)
            row = self.batches[b][bad]
            q = self.questions.iloc[row // len(self.tags)]
            raise overflow_error(self.model, self.adapters, self.rows_tags[row],
                                 f"{q['subject']} question {q['question_index']}", self.options.dtype)
        scores = scores.numpy()
        n = len(self.batches[b])
        return pd.DataFrame({"row": self.batches[b], **{f"lp_{x}": scores[:, j] for j, x in enumerate(LETTERS)},
                             "tokens_computed": np.asarray([computed] + [0] * (n - 1), dtype=np.int64)})  # (row 1)

    def merge(self, frames: dict[int, pd.DataFrame], run: Run) -> MmluResult:
        ids, models, tokens = self.tokens.ids, self.models, self.tokens
        with run.phases("metrics"):
            lp = np.empty((len(self.rows_ids), len(LETTERS)), dtype=np.float32)  # [rows, 4]
            tokens_computed = 0  # by whichever run and rank computed each unit
            for frame in frames.values():
                lp[frame["row"].to_numpy()] = frame[[f"lp_{x}" for x in LETTERS]].to_numpy(dtype=np.float32)
                tokens_computed += int(frame["tokens_computed"].sum()) if "tokens_computed" in frame else 0
            table = question_table(self.questions, models, lp.reshape(len(ids), len(models), len(LETTERS)))
            subject_rows = subject_table(table)
            summary = summary_table(table, self.max_drop)
        computed_s = max(run.phases.timings()["forward_s"], 1e-9)
        prompt_lengths = np.array([len(row) for row in ids])
        options, ranks, engine, computed = self.options, run.ranks, self.engine, run.work.stats()["computed"]
        record = run.record(
            resolved=dict(device=options.device, dtype=options.dtype, ranks=ranks.world if ranks else 1,
                          batch_invariant=options.batch_invariant),
            questions=len(ids), rows=len(self.rows_ids), batches=len(self.batches),
            padding_waste=padding_waste(self.suffix, self.batches),
            tokens_computed=tokens_computed, tokens_full_prompts=int(sum(self.lengths)),
            prefix_cache=dict(enabled=self.use_prefixes, computed_share=tokens_computed / max(sum(self.lengths), 1),
                              rows_with_prefix=sum(1 for p in self.rows_prefix or () if p),
                              this_process=engine.prefix_stats()),
            questions_per_s=computed / len(models) / computed_s, rows_per_s=computed / computed_s,
            prompts=dict(shots=self.shots, tokens_mean=float(prompt_lengths.mean()) if len(ids) else 0.0,
                         tokens_max=int(prompt_lengths.max()) if len(ids) else 0, max_position_embeddings=self.max_len,
                         with_fewer_shots=int(sum(u < self.shots for u in tokens.used)),
                         tokenized_beside_load_s=None if self.tokenizing is None else self.tokenizing.seconds),
            answer_tokens={x: dict(id=t, token=name)
                           for x, t, name in zip(LETTERS, tokens.candidates, tokens.candidate_tokens)},
            data=self.data_record, quantization=engine.model.args.quantization, cuda_graphs=engine.graph_stats())
        return MmluResult(questions=table, subjects=subject_rows, summary=summary, run=record)

    def files(self, result: MmluResult) -> dict[str, bytes]:
        return {**table_files(result), **report_files(result)}
