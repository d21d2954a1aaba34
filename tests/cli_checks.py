"""Assertions on CLI results shared by the CLI test files, and a run folder written from a result."""


def assert_no_traceback(result):
    for stream in (result.stdout, result.stderr):
        assert "Traceback" not in stream, stream


def assert_input_error(result, *needles: str) -> str:
    """Exit 2, nothing on stdout, exactly one `error: ...` line on stderr containing every needle; returns it."""
    assert_no_traceback(result)
    assert result.exit_code == 2, (result.exit_code, result.stdout, result.stderr, result.exception)
    assert result.stdout == "", result.stdout
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    line = lines[0]
    assert line.startswith("error: "), line
    for needle in needles:
        assert needle in line, f"{needle!r} not in {line!r}"
    return line


def save_run(result, out):
    """A complete run folder of `result` (its tables, reports and run.json), written by the run-folder code itself,
    for tests that build or edit results by hand."""
    from lora_eval.render.files import report_files
    from lora_eval.results.tables import CompareResult, table_files
    from lora_eval.results.runfolder import RunFolder

    command = "compare" if isinstance(result, CompareResult) else "mmlu"
    with RunFolder(out, command, {"command": command}, overwrite=True) as folder:
        folder.commit({**table_files(result), **report_files(result)}, dict(result.run, command=command,
                                                                             status="complete"))


def assert_phases(result, run_dir, phases: list[str]):
    """run.json's timings are `phases` (in this order, each `name_s`) and total_s: non-negative floats, the phases
    summing to no more than the total; the terminal's `time:` line gives each of them and the total, as run.json."""
    import json
    from pathlib import Path

    timings = json.loads((Path(run_dir) / "run.json").read_text())["timings"]
    assert list(timings) == [f"{p}_s" for p in phases] + ["total_s"], timings
    assert all(isinstance(v, float) and v >= 0 for v in timings.values()), timings
    assert sum(timings[f"{p}_s"] for p in phases) <= timings["total_s"] + 1e-9, timings
    lines = [line for line in result.stdout.splitlines() if line.startswith("time: ")]
    assert lines == ["time: " + ", ".join(f"{p} {timings[f'{p}_s']:.2f} s" for p in phases) +
                     f"; total {timings['total_s']:.2f} s"], result.stdout
