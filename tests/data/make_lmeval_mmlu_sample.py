"""Write tests/data/lmeval_mmlu_contexts.json: the 5-shot contexts lm-evaluation-harness's default `mmlu` task builds
for the first two test questions of every subject, read from the original MMLU release (the test compares ours).

    python -m venv --system-site-packages /tmp/lmenv && /tmp/lmenv/bin/pip install lm_eval==0.4.13
    /tmp/lmenv/bin/python tests/data/make_lmeval_mmlu_sample.py ../shared/data/mmlu

lm-eval reads `cais/mmlu` from the Hugging Face hub; nothing is downloaded here: its `datasets.load_dataset` is
replaced by the release's CSV files in cais/mmlu's schema (question, subject, choices, answer 0-3), which is what
the hub's copy holds. Only lm-eval's own prompt code builds the contexts.
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import datasets
from lm_eval.tasks import TaskManager

SHOTS, PER_SUBJECT = 5, 2


def split(data: Path, subject: str, name: str) -> datasets.Dataset:
    rows = []
    with open(data / name / f"{subject}_{name}.csv", newline="", encoding="utf-8") as f:
        for q, a, b, c, d, answer in csv.reader(f):
            rows.append(dict(question=q, subject=subject, choices=[a, b, c, d], answer="ABCD".index(answer)))
    return datasets.Dataset.from_list(rows)


def main(data: Path) -> None:
    def local(path=None, name=None, **kwargs):
        return datasets.DatasetDict({"test": split(data, name, "test"), "dev": split(data, name, "dev"),
                                     "validation": split(data, name, "val")})

    datasets.load_dataset = local
    import lm_eval.api.task as api_task

    api_task.datasets.load_dataset = local
    subjects = sorted(p.name[:-len("_test.csv")] for p in (data / "test").glob("*_test.csv"))
    manager = TaskManager()
    tasks = manager.load_task_or_group([f"mmlu_{s}" for s in subjects])
    out = []
    for subject in subjects:
        task = tasks[f"mmlu_{subject}"]
        task.set_config(key="num_fewshot", value=SHOTS)
        docs = list(task.test_docs())[:PER_SUBJECT]
        for index, doc in enumerate(docs):
            context = task.fewshot_context(doc, num_fewshot=SHOTS)
            choices = [task.config.target_delimiter + c for c in task.doc_to_choice(doc)]
            out.append(dict(subject=subject, question_index=index, context=context, continuations=choices))
    target = Path(__file__).with_name("lmeval_mmlu_contexts.json")
    target.write_text(json.dumps(dict(lm_eval=__import__("lm_eval").__version__, shots=SHOTS, contexts=out),
                                 indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {len(out)} contexts to {target}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
