"""Assertions on CLI results shared by the CLI test files."""


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
