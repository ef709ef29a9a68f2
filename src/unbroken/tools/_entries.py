"""The command-line entries of the tools whose work needs torch (``diff``, ``export``,
``verify-export``, ``import``): their arguments and help are declared here, without torch, so
``unbroken <command> --help`` and a usage error answer at once; each entry imports its tool
(and torch) only when it runs."""

from __future__ import annotations

import argparse
import os

from .._commands import arg, emit, tolerance, tool
from .._runview import UsageError, named_generation

EXPORT_DTYPES = ("bf16", "fp16", "fp32")  # `_export_io.DTYPES`' names (a test checks)


@tool("diff",
      arg("a", metavar="A", help="a run (folder or URL: its newest verified generation) or "
                                 "a generation (RUN/gen-NNNNNNNNN)"),
      arg("b", metavar="B", nargs="?", help="the same; omitted: A's run"),
      arg("--a-generation", type=int, metavar="N", help="generation N of run A"),
      arg("--b-generation", type=int, metavar="N", help="generation N of run B"))
def _diff(args: argparse.Namespace) -> int:
    """Compare two generations part by part (model, optimizer, scheduler, scaler, data, rng,
    counters, extras): tensors only in A or B, shape and dtype changes, and for tensors that
    differ the count of differing elements and the max abs / max rel difference; plain values
    (counters, data cursor, scheduler, learning rates in the optimizer's param groups) with
    both values; random streams by digest. Equality is bitwise (NaN equals NaN).

    A and B each name a run (a folder or URL such as s3://bucket/run: its newest generation
    that verifies, or generation N with --a-generation / --b-generation N) or one generation
    (a path or URL ending in gen-NNNNNNNNN). With B omitted both sides are generations of A's
    run: B is --b-generation or the newest that verifies, A is --a-generation (or the one A's
    path names) or else the newest verified generation before B's; so `unbroken diff RUN`
    shows what the last save changed, and `unbroken diff RUN/gen-N`, N the newest, what
    save N changed (A is never B's own generation). Every byte read is verified; a named
    generation that does not verify, or an input that is neither a run nor a generation,
    exits 2.
    Exit 0 equal, 1 different."""
    from .diff import _text, diff_sides, resolve, split_generation

    if args.b is None:
        run_a, named = split_generation(args.a)
        b = resolve("B", run_a, args.b_generation)
        wanted = {n for n in (named, args.a_generation) if n is not None}
        # (B's own generation named, and nothing else: what it changed, not B against B)
        explicit = bool(wanted) and wanted != {b.info.generation}
        a = resolve("A", run_a if not explicit else args.a,
                    args.a_generation if explicit else None,
                    None if explicit else b.info.generation)
    else:
        a = resolve("A", args.a, args.a_generation)
        b = resolve("B", args.b, args.b_generation)
    payload = diff_sides(a, b)
    return emit(args, payload, _text(payload), payload["equal"])


@tool("export",
      arg("run", metavar="RUN", help="the run folder (or URL)"),
      arg("out", metavar="OUT", help="the export folder to create (must not hold anything)"),
      arg("--generation", type=int, metavar="N", help="export generation N (default: "
          "the newest that verifies)"),
      arg("--dtype", choices=EXPORT_DTYPES, help="cast floating weights (default: as saved)"),
      arg("--adapter", action="append", metavar="NAME", help="export only this tensor "
          "(repeatable; 'prefix*' selects by prefix); needs --base-revision"),
      arg("--base-revision", metavar="REV", help="the immutable revision of the base model "
          "(e.g. org/model@<commit>, sha256:<digest>)"))
def _export(args: argparse.Namespace) -> int:
    """Write the model weights of RUN's newest verified generation (or --generation N) into
    the new folder OUT: model.safetensors (names as in the model's state_dict; any
    safetensors reader loads it) and export.json (identity: config, tokenizer, base revision;
    lineage: run, generation, step; each tensor's dtype and shape; the file's xxh3-128). No
    optimizer, data, sample or RNG state is written. --dtype casts floating weights. Exit 1
    when no generation verifies, 2 on a usage error or an OUT that holds anything."""
    from .export import export_generation

    if args.adapter and not args.base_revision:
        raise UsageError("--adapter exports only some tensors: name the immutable base model "
                         "revision they apply to with --base-revision REV")
    run, generation = named_generation(args.run, args.generation, "export")
    doc = export_generation(run, args.out, generation, args.dtype,
                            adapter=args.adapter, base_revision=args.base_revision)
    w, lin = doc["weights"], doc["lineage"]
    payload = {"ok": True, "out": doc["path"], "kind": doc["kind"], "lineage": lin,
               "dtype": w["dtype"], "tensors": len(w["tensors"]), "bytes": w["bytes"],
               "xxh3_128": w["xxh3_128"], "identity": sorted(doc["identity"]),
               "refused": doc["refused"]}
    lines = [f"exported gen {lin['generation']} (step {lin['step']}) of run {lin['run_id']} "
             f"to {doc['path']}",
             f"  {len(w['tensors'])} tensors, {w['bytes']:,} bytes, dtype "
             f"{w['dtype'] or 'as saved'}, xxh3-128 {w['xxh3_128']}",
             f"  identity: {', '.join(sorted(doc['identity'])) or 'none recorded'}"]
    lines += [f"  skipped {r['path']}: {r['reason']}" for r in doc["refused"]]
    return emit(args, payload, "\n".join(lines), True)


@tool("verify-export",
      arg("out", metavar="OUT", help="the export folder"),
      arg("--factory", required=True, metavar="MODULE:FUNCTION",
          help="a function that builds the model (imported; called without arguments)"),
      arg("--rtol", type=tolerance, help="relative tolerance (default: bitwise, or per "
          "dtype)"),
      arg("--atol", type=tolerance, help="absolute tolerance (default: per dtype)"))
def _verify_export(args: argparse.Namespace) -> int:
    """Re-hash OUT's files against its export.json, build the model with the named factory
    (MODULE:FUNCTION, imported from the current folder or the Python path: this runs your
    code, never anything from OUT), load model.safetensors into it (strict) and re-run the
    fixed inputs recorded at export, comparing the outputs bitwise (an uncast export on the
    CPU) or within a tolerance per dtype. Exit 1 when a file or an output differs."""
    import torch

    from ._export_io import EXPORT_JSON
    from ._factory import load_factory
    from .export import verify_export

    if not os.path.isfile(os.path.join(args.out, EXPORT_JSON)):
        # (nothing to check: the wrong path, not a bad export)
        raise UsageError(f"{args.out}: no {EXPORT_JSON} there (" + (
            "no such folder" if not os.path.lexists(args.out) else "not an export folder")
            + "); give the folder `unbroken export` wrote")
    model = load_factory(args.factory)()
    if not isinstance(model, torch.nn.Module):
        raise UsageError(f"--factory {args.factory}: returned a {type(model).__name__}, not a "
                         "torch.nn.Module")
    report = verify_export(args.out, model, rtol=args.rtol, atol=args.atol)
    lines = [f"export {report['out']}: weights verified ({report['weights']['xxh3_128']}), "
             f"{report['loaded']} tensors loaded"]
    if report["mode"] is None:
        lines.append("  no fixed inputs recorded: outputs not checked")
    for row in report["outputs"]:
        lines.append(f"  {row['name']}: {row['mode']} ok" + (
            f" (max |diff| {row['max_abs_diff']:.3g} <= {row['bound']:.3g})"
            if row["mode"] == "tolerance" else ""))
    return emit(args, report, "\n".join(lines), True)


@tool("import",
      arg("source", metavar="SRC", help="a checkpoint file or folder"),
      arg("run", metavar="RUN", help="a new run folder or URL"))
def _import(args: argparse.Namespace) -> int:
    """Read the model weights of SRC without executing anything (safetensors, or a torch.save
    zip archive whose pickle is interpreted, never run) and write them as the first
    generation of the new run RUN, its manifest naming the source and the hash of every file
    read. Continue training with restore(intent="warm_start", source=RUN): the source's
    optimizer, scheduler, RNG and data position are not imported."""
    from .importing import import_checkpoint

    done = import_checkpoint(args.source, args.run)
    text = (f"imported {done['tensors']} tensors ({done['bytes']} bytes) from {done['source']} "
            f"({done['format']}, step {done['step']}) into {done['run']} as generation "
            f"{done['step']}; warm-start from it: restore(intent=\"warm_start\", "
            f"source={done['run']!r})")
    return emit(args, done, text, True)
