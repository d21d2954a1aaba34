"""Progress bars for long work: on the terminal (stderr), silent under --quiet or CI=true."""

from __future__ import annotations

import os
import sys

from tqdm.auto import tqdm


def quiet_by_default() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes") or not sys.stderr.isatty()


def progress(total: int, desc: str, unit: str, quiet: bool = False, initial: int = 0) -> tqdm:
    """A bar of `total` (starting at `initial`: work resumed from an earlier run)."""
    return tqdm(total=total, desc=desc, unit=unit, unit_scale=True, disable=quiet or quiet_by_default(),
                leave=False, dynamic_ncols=True, initial=initial)
