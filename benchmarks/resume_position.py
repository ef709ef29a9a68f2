"""Cost of resuming the data position: time and peak Python memory to restore a cursor at
sample 0, 10**6 and 10**9 of datasets of 10**6, 10**9 and 3*10**9 samples, and hand out the
first batch.

Memory is the peak of Python/NumPy allocations (tracemalloc). The point: the cost is
independent of the position and of the dataset size, because the
order is a keyed bijection evaluated per position (no permutation is materialized, no
skipped batch is read). Prints a table, then one JSON object.

    PYTHONPATH=src python benchmarks/resume_position.py [--repeats 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import tracemalloc
from typing import Any

import torch
import torch.utils.data

from unbroken.data import ResumableLoader, ResumableSampler

SIZES = (10**6, 10**9, 3 * 10**9)
POSITIONS = (0, 10**6, 10**9)
BATCH = 32


class _Lazy(torch.utils.data.Dataset):
    """A dataset that is only a length: sample i is i (nothing is stored)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return int(i)


def _resume(n: int, position: int) -> list[int]:
    # Everything a restarted process does: build sampler and loader, load the saved cursor,
    # take the first batch.
    sampler = ResumableSampler(n, BATCH, seed=0)
    loader = ResumableLoader(_Lazy(n), sampler)
    loader.load_state_dict({**sampler.state_dict(), "epoch": 3, "consumed": position})
    return next(iter(loader)).tolist()


def _measure(n: int, position: int, repeats: int) -> dict[str, Any]:
    first = _resume(n, position)  # warm-up (imports, caches)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        _resume(n, position)
        times.append(time.perf_counter() - t0)
    tracemalloc.start()
    _resume(n, position)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {"num_samples": n, "position": position, "median_ms": statistics.median(times) * 1e3,
            "max_ms": max(times) * 1e3, "peak_kib": peak / 1024, "first_ids": first[:3]}


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print the table and the JSON summary."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", help="also write the JSON summary to this file")
    args = parser.parse_args(argv)
    rows = [_measure(n, p, args.repeats) for n in SIZES for p in POSITIONS if p < n]
    print(f"{'num_samples':>13} {'position':>13} {'median ms':>10} {'max ms':>8} {'peak KiB':>9}")
    for r in rows:
        print(f"{r['num_samples']:>13,} {r['position']:>13,} {r['median_ms']:>10.3f} "
              f"{r['max_ms']:>8.3f} {r['peak_kib']:>9.1f}")
    for n in SIZES:
        for p in POSITIONS:
            if p >= n:
                print(f"{n:>13,} {p:>13,} {'n/a (position >= dataset size)':>29}")
    times = [r["median_ms"] for r in rows]
    peaks = [r["peak_kib"] for r in rows]
    summary = {
        "benchmark": "resume_position", "batch_size": BATCH, "repeats": args.repeats,
        "python": sys.version.split()[0], "torch": torch.__version__, "machine": platform.machine(),
        "rows": rows,
        # Independence of position and size: the spread across all cells stays within noise.
        "median_ms_range": [min(times), max(times)], "peak_kib_range": [min(peaks), max(peaks)],
        "materialized_permutation_bytes_at_3e9": 8 * 3 * 10**9,
    }
    print(json.dumps(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
