"""The filesystem that holds a run folder, and whether a rename on it is atomic (the commit
protocol's last step renames a generation into place)."""

from __future__ import annotations

import os


def filesystem_type(path: str) -> str:
    """The mount type holding ``path`` (from /proc/mounts), or "unknown"."""
    best, fstype = "", "unknown"
    real = os.path.realpath(path)
    try:
        with open("/proc/mounts", encoding="utf-8") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mount = parts[1].replace("\\040", " ")
                inside = real == mount or real.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= len(best):
                    best, fstype = mount, parts[2]
    except OSError:
        pass
    return fstype


# Directory rename is not guaranteed atomic (or durable on fsync) on these.
NON_ATOMIC_RENAME = ("nfs", "nfs4", "cifs", "smb3", "smbfs", "9p", "fuse", "sshfs", "glusterfs",
                     "ceph", "lustre", "virtiofs")


def rename_is_atomic(fstype: str) -> bool:
    return not any(fstype == t or fstype.startswith(t + ".") for t in NON_ATOMIC_RENAME)
