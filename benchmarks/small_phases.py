"""The parts of a save and a restore of many small tensors, each timed alone in-process.

The whole-operation benchmark (`save_load.py`) cannot separate a change of a few
milliseconds from this VM's noise; the parts, timed alone (minimum of N calls, garbage
collector off as in a save), can. To compare two commits, run the script against each
checkout's sources alternately:

    PYTHONPATH=<checkout>/src .venv/bin/python benchmarks/small_phases.py [--tensors 10000]

It prints one line (milliseconds) and the same figures as JSON. It also runs on older
checkouts whose ``encode_generation`` has no ``layouts`` argument.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from save_load import build_state  # noqa: E402

from unbroken.state import parts as S  # noqa: E402

try:  # (an older checkout, benchmarked against through PYTHONPATH, has them in parts)
    from unbroken.state import generation as G  # noqa: E402
except ImportError:
    G = S
try:  # (moved out of parts in the thirty-fourth session)
    from unbroken.state.applying import apply as _apply  # noqa: E402
except ImportError:
    _apply = S.apply


def _min_ms(fn: Callable[[], Any], calls: int) -> float:
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times) * 1000


def _aligned(chunks: list[Any]) -> memoryview:
    """A tensor file's bytes in fresh (64-byte aligned) memory, as a restore reads them."""
    raw = b"".join(bytes(c) for c in chunks)
    buf = torch.empty(len(raw), dtype=torch.uint8)
    buf.numpy()[:] = memoryview(raw)
    return buf.numpy().data


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tensors", type=int, default=10000,
                    help="how many small tensors (Linear(32, 32) layers + AdamW state)")
    ap.add_argument("--calls", type=int, default=21, help="calls per part (the minimum is kept)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, opt = build_state(max(1, args.tensors // 8), 32, small=True)
    gc.disable()
    parts = {S.MODEL: model, S.OPTIMIZER: opt}
    tree = S.capture(parts, model)
    meta = {"unbroken.run_id": "0" * 32, "unbroken.generation": "1",
            "unbroken.incarnation": "0"}
    layouts: dict[str, Any] = {}
    with_layouts = "layouts" in G.encode_generation.__code__.co_varnames

    def encode() -> dict[str, Any]:
        if with_layouts:
            return G.encode_generation(tree, meta, layouts=layouts)
        return G.encode_generation(tree, meta)

    files = {name: _aligned(chunks) for name, chunks in encode().items()}
    saved, _ = G.decode_generation(files, "bench")

    def restore() -> None:
        _apply(S.validate_parts(saved, parts, model, "bench"), parts)

    out = {"tensors": sum(1 for _ in model.state_dict()) + sum(
               len(s) for s in opt.state.values()),
           "capture_ms": _min_ms(lambda: S.capture(parts, model), args.calls),
           "encode_generation_ms": _min_ms(encode, args.calls),
           "decode_generation_ms": _min_ms(lambda: G.decode_generation(files, "bench"),
                                           args.calls),
           "validate_apply_ms": _min_ms(restore, args.calls)}
    print(f"{out['tensors']} tensors, min of {args.calls} calls: capture "
          f"{out['capture_ms']:.1f} ms, encode_generation {out['encode_generation_ms']:.1f} ms, "
          f"decode_generation {out['decode_generation_ms']:.1f} ms, validate + apply "
          f"{out['validate_apply_ms']:.1f} ms")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
