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
    from lora_eval.report import report_files
    from lora_eval.results import CompareResult, table_files
    from lora_eval.runfolder import RunFolder

    command = "compare" if isinstance(result, CompareResult) else "mmlu"
    with RunFolder(out, command, {"command": command}, overwrite=True) as folder:
        folder.commit({**table_files(result), **report_files(result)}, dict(result.run, command=command,
                                                                             status="complete"))
