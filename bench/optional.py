"""Optional dependencies of the benchmarks, checked when the arguments are parsed, before any request is sent."""
from __future__ import annotations

import importlib.util

BENCH_EXTRA = "pip install 'pdserve[bench]'"


def require_plotting(flag: str) -> None:
    """Raise ValueError naming `flag` and the extra to install when matplotlib is missing."""
    if importlib.util.find_spec("matplotlib") is None:
        raise ValueError(f"{flag} needs matplotlib, which is not installed: {BENCH_EXTRA}")
