"""Where an export may be written: OUT is a new (or empty) local folder whose parents are
folders, outside the run it exports. A folder written into a run folder would change the
run itself: inside a committed generation it makes that generation fail verification (the
next restore moves it aside and continues from an older step), and named like a generation
(``gen-000000009``) it reads as a torn one."""

from __future__ import annotations

import os

from ..errors import UnbrokenError
from ..store.opening import is_url


def local_out(out: str | os.PathLike[str]) -> str:
    """``out`` as an absolute local path; a URL is refused (an export is a local folder, and
    made absolute a URL would name a folder such as ``./s3:/bucket/...``)."""
    out = os.fspath(out)
    if is_url(out):
        raise UnbrokenError(f"{out}: an export is written to a local folder, not a URL; "
                            "export to a local OUT and copy the folder up afterwards")
    return os.path.abspath(out)


def check_out(out: str) -> None:
    """Refuse an OUT that holds anything (an export never overwrites or merges) or whose
    nearest existing parent is not a folder."""
    if os.path.lexists(out) and (not os.path.isdir(out) or os.path.islink(out)
                                 or os.listdir(out)):
        raise UnbrokenError(f"{out}: exists and is not an empty folder; an export never "
                            "overwrites: choose a new OUT or remove this one")
    parent = os.path.dirname(out)
    while parent and not os.path.lexists(parent) and os.path.dirname(parent) != parent:
        parent = os.path.dirname(parent)
    if parent and os.path.lexists(parent) and not os.path.isdir(parent):
        raise UnbrokenError(f"{out}: its parent {parent} exists and is not a folder (a file, or "
                            "a link to none), so OUT cannot be created under it: choose an OUT "
                            f"whose parents are folders, or move {parent} away")


def check_outside_run(run: str, out: str) -> None:
    """Refuse an OUT inside the run folder ``run``, equal to it, or holding it; symlinks and
    other names of the same folder (bind mounts) are resolved. A run on an object store
    needs nothing more: `local_out` refuses every URL as OUT."""
    if is_url(run):
        return
    run = run.removeprefix("file://")
    real_run, real_out = os.path.realpath(run), os.path.realpath(out)
    try:
        run_stat = os.stat(real_run)
    except OSError:  # no run there: opening it reports that
        return
    inside = os.path.commonpath([real_run, real_out]) in (real_run, real_out)
    probe = real_out
    while not inside:  # another name of the run folder among OUT's existing parents
        try:
            inside = os.path.samestat(os.stat(probe), run_stat)
        except OSError:  # not there yet: its parent may be
            pass
        if os.path.dirname(probe) == probe:
            break
        probe = os.path.dirname(probe)
    if inside:
        raise UnbrokenError(
            f"{out}: inside, equal to or holding the run folder {run} (real paths {real_out} "
            f"and {real_run}); an export written there would change the run's committed "
            "generations (the next restore refuses them as corrupt): choose an OUT outside "
            "the run folder")
