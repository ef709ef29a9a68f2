"""Save and restore on an S3-compatible server against s3fs's own put/get of the same bytes.

Starts moto's S3 server as a separate process on 127.0.0.1 (so it does not share this process's
GIL), then, for each state size (model + AdamW), runs interleaved repetitions of:

* ``unbroken save``: ``Checkpointer.save`` to ``s3://`` (upload, manifest last, and the
  read-back that verifies every byte: a download and hash);
* ``s3fs put``: ``pipe_file`` of the same artifact bytes, and ``s3fs put+get``: that and a
  download of them (what the verified save does, at the client library's own speed);
* ``unbroken restore``: ``Checkpointer.restore`` of the newest generation into the live model
  and optimizer (listing, download, hash, apply);
* ``s3fs get``: ``cat_file`` of the same objects.

Every figure is the median of ``--repeats`` runs with its interquartile range; one whose IQR
exceeds 25% of its median is flagged unstable. Prints a table; ``--json FILE`` writes it all.

    python benchmarks/object_store.py [--sizes 64M,256M] [--repeats 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import uuid
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from save_load import GB, build_state, parse_size, summarize  # noqa: E402

import unbroken  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server() -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                             str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return proc, endpoint
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("moto server did not start")


def timed(fn: Any) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def run_size(size: int, options: dict[str, Any], repeats: int) -> dict[str, Any]:
    import s3fs

    layers, width = 4, max(64, int((size / (4 * 3 * 4)) ** 0.5))  # 3 copies: weights, 2 moments
    model, opt = build_state(layers, width)
    url = f"s3://bench/{uuid.uuid4().hex[:8]}"
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **options)
    ckpt = unbroken.Checkpointer(url, model=model, optimizer=opt, keep=unbroken.Keep(last=2),
                                 storage_options=options)
    ckpt.restore()
    times: dict[str, list[float]] = {k: [] for k in ("unbroken save", "s3fs put", "s3fs put+get",
                                                     "unbroken restore", "s3fs get")}
    payload = 0
    for step in range(1, repeats + 2):  # the first round warms up, not counted
        took = {"unbroken save": timed(lambda: ckpt.save(step))}
        info = ckpt.store.scan()[-1]
        assert info.manifest is not None
        names = [f"{info.path}/{a.name}" for a in info.manifest.artifacts]
        blobs = {n: fs.cat_file(n) for n in names}
        payload = sum(len(b) for b in blobs.values())
        base = f"s3://bench/raw-{uuid.uuid4().hex[:8]}"

        def put() -> None:
            for i, data in enumerate(blobs.values()):
                fs.pipe_file(f"{base}/{i}", data)

        took["s3fs put"] = timed(put)
        took["s3fs get"] = timed(lambda: [fs.cat_file(f"{base}/{i}") for i in range(len(blobs))])
        took["s3fs put+get"] = took["s3fs put"] + took["s3fs get"]
        fs.rm(base, recursive=True)
        ckpt.close()
        ckpt = unbroken.Checkpointer(url, model=model, optimizer=opt, storage_options=options,
                                     keep=unbroken.Keep(last=2))
        took["unbroken restore"] = timed(ckpt.restore)
        if step > 1:
            for k, v in took.items():
                times[k].append(v)
        print(f"  {size / 2**20:.0f} MiB round {step}: " + ", ".join(
            f"{k} {v:.3f}s" for k, v in took.items()), file=sys.stderr)
    ckpt.close()
    out = {k: summarize(v, payload) for k, v in times.items()}
    out["payload_bytes"] = payload  # type: ignore[assignment]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="64M,256M")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    proc, endpoint = start_server()
    options = {"endpoint_url": endpoint, "key": "bench", "secret": "bench"}
    try:
        import s3fs

        s3fs.S3FileSystem(skip_instance_cache=True, **options).mkdir("bench")
        results = {s: run_size(parse_size(s), options, args.repeats)
                   for s in args.sizes.split(",")}
    finally:
        proc.kill()
    lines = [f"{'state':>6}  {'method':<17} {'median s':>9} {'GB/s':>6} {'IQR %':>6}  "
             "ratio vs s3fs"]
    for size, r in results.items():
        for method, base in (("unbroken save", "s3fs put"), ("unbroken save", "s3fs put+get"),
                             ("s3fs put", None), ("s3fs put+get", None),
                             ("unbroken restore", "s3fs get"), ("s3fs get", None)):
            s = r[method]
            ratio = f"{r[base]['median_s'] / s['median_s']:.2f}x of {base}" if base else ""
            flag = " UNSTABLE" if s["unstable"] else ""
            lines.append(f"{size:>6}  {method:<17} {s['median_s']:9.3f} {s['gbps']:6.2f} "
                         f"{s['iqr_pct']:6.1f}  {ratio}{flag}")
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"endpoint": "moto server (separate process) on 127.0.0.1",
                       "repeats": args.repeats, "gb": GB, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
