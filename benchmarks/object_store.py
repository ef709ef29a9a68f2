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

With ``--frozen SIZE``, a 99%-frozen state of that size (a frozen base under a small trainable
adapter) is also saved with ``incremental=True`` after an update of the adapter each time: the
bytes each save uploads (every artifact goes through ``ObjectFS.write_file``), the bytes its
read-back downloads (``ObjectFS.hash_file``) and its time until verified (``save`` and
``wait``), the first save against the later ones, whose unchanged stable file the store copies
itself.

Every figure is the median of ``--repeats`` runs with its interquartile range; one whose IQR
exceeds 25% of its median is flagged unstable. Prints a table; ``--json FILE`` writes it all.

    python benchmarks/object_store.py [--sizes 64M,256M] [--repeats 5] [--frozen 256M]
                                     [--json out.json]
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
from save_load import GB, build_state, parse_size, summarize, train_once  # noqa: E402

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


def run_frozen(size: int, options: dict[str, Any], repeats: int) -> dict[str, Any]:
    """Incremental saves of a 99%-frozen state: bytes uploaded and read back, and the time
    until verified, first and later."""
    from unbroken.store.backends.objects import ObjectFS

    width = 1024
    model, opt = build_state(max(1, round(size / (4 * (width * width + width)))), width,
                             frozen=True)
    uploaded, downloaded = [0], [0]
    write, hash_file = ObjectFS.write_file, ObjectFS.hash_file

    def counted(self: ObjectFS, path: str, chunks: Any) -> tuple[int, str]:
        size, digest = write(self, path, chunks)
        uploaded[0] += size
        return size, digest

    def hashed(self: ObjectFS, path: str, limit: int, drop_cache: bool = False
               ) -> tuple[int, str]:
        size, digest = hash_file(self, path, limit, drop_cache)
        downloaded[0] += size
        return size, digest

    ObjectFS.write_file = counted  # type: ignore[method-assign]
    ObjectFS.hash_file = hashed  # type: ignore[method-assign]
    try:
        ckpt = unbroken.Checkpointer(f"s3://bench/{uuid.uuid4().hex[:8]}", model=model,
                                     optimizer=opt, keep=unbroken.Keep(last=2),
                                     storage_options=options, incremental=True)
        rounds = []
        for step in range(1, repeats + 2):
            if step > 1:
                train_once(model, opt)
            uploaded[0] = downloaded[0] = 0
            took = timed(lambda: (ckpt.save(step), ckpt.wait()))
            rounds.append((took, uploaded[0], downloaded[0]))
            print(f"  frozen {size / 2**20:.0f} MiB save {step}: {took:.3f}s, "
                  f"{uploaded[0]} bytes uploaded, {downloaded[0]} read back", file=sys.stderr)
        ckpt.close()
    finally:
        ObjectFS.write_file = write  # type: ignore[method-assign]
        ObjectFS.hash_file = hash_file  # type: ignore[method-assign]
    first_s, first_b, first_read = rounds[0]
    later = rounds[1:]
    return {"first_s": first_s, "first_bytes": first_b, "first_read_back_bytes": first_read,
            "later": summarize([t for t, _, _ in later], first_b),
            "later_bytes": [b for _, b, _ in later],
            "later_read_back_bytes": [r for _, _, r in later],
            "later_bytes_pct_of_first": max(b for _, b, _ in later) / first_b * 100,
            "later_read_back_pct_of_first": max(r for _, _, r in later) / first_b * 100}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="64M,256M")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--frozen", help="also a 99%%-frozen state of this size, incremental")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    proc, endpoint = start_server()
    options = {"endpoint_url": endpoint, "key": "bench", "secret": "bench"}
    try:
        import s3fs

        s3fs.S3FileSystem(skip_instance_cache=True, **options).mkdir("bench")
        results = {s: run_size(parse_size(s), options, args.repeats)
                   for s in args.sizes.split(",")}
        frozen = (run_frozen(parse_size(args.frozen), options, args.repeats)
                  if args.frozen else None)
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
    if frozen is not None:
        lines.append(f"{args.frozen} 99% frozen, incremental: first save {frozen['first_s']:.3f} "
                     f"s uploading {frozen['first_bytes']} bytes; later saves "
                     f"{frozen['later']['median_s']:.3f} s (IQR {frozen['later']['iqr_pct']:.0f}"
                     f"%) uploading at most {frozen['later_bytes_pct_of_first']:.2f}% of that "
                     f"and reading back at most {frozen['later_read_back_pct_of_first']:.2f}%")
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"endpoint": "moto server (separate process) on 127.0.0.1",
                       "repeats": args.repeats, "gb": GB, "results": results,
                       "frozen": frozen}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
