"""Mutations of which files exist and what they are: deleted, extra and swapped files and
generations, artifact names that escape the generation, symlinks, FIFOs, devices and sockets,
and hostile run-folder layouts (lock, aside, staging and trash)."""

from __future__ import annotations

import os
import shutil
import socket
import stat

import xxhash

from ..store.manifest import MANIFEST
from ._case import Case, Catalogue, header_end, registrar

LAYOUT: Catalogue = {}
mutation = registrar(LAYOUT)


@mutation("delete-file", 2)
def _delete(c: Case) -> str:
    g = c.pick_target()
    name = c.rng.choice(c.names(g))
    os.unlink(os.path.join(g, name))
    desc = f"{os.path.basename(g)}/{name} deleted"
    if name != MANIFEST and c.rng.random() < 0.4:
        doc = c.manifest(g)
        doc["artifacts"] = [a for a in doc["artifacts"] if a["name"] != name]
        c.save_manifest(g, doc)
        desc += " and dropped from the manifest (resealed)"
    return desc


@mutation("extra-file", 2)
def _extra(c: Case) -> str:
    g = c.pick_target()
    how = c.rng.choice(["file", "hidden", "folder", "symlink", "empty"])
    name = {"file": "extra.bin", "hidden": ".extra", "folder": "extra.d", "symlink": "link",
            "empty": "zero.safetensors"}[how]
    path = os.path.join(g, name)
    if how == "folder":
        os.mkdir(path)
    elif how == "symlink":
        os.symlink(os.path.join(c.outside, "precious.txt"), path)
    else:
        with open(path, "wb") as f:
            f.write(b"" if how == "empty" else os.urandom(64))
    return f"unlisted {how} {os.path.basename(g)}/{name}"


@mutation("swap-files", 2)
def _swap_files(c: Case) -> str:
    g = c.pick_target()
    o = c.other(g)
    name = c.rng.choice(c.names(g, manifest=c.rng.random() < 0.3))
    a, b = c.read(g, name), c.read(o, name)
    c.write(g, name, b)
    c.write(o, name, a)
    desc = f"{name} swapped between {os.path.basename(g)} and {os.path.basename(o)}"
    if name != MANIFEST and c.rng.random() < 0.6:
        c.restamp(g, name)
        c.restamp(o, name)
        desc += ", both manifests re-stamped"
    return desc


@mutation("swap-generation", 2)
def _swap_generation(c: Case) -> str:
    g = c.pick_target()
    o = c.other(g)
    for name in c.names(g):
        os.unlink(os.path.join(g, name))
    for name in c.names(o):
        shutil.copyfile(os.path.join(o, name), os.path.join(g, name))
    doc = c.manifest(g)
    number = int(os.path.basename(g).split("-")[1])
    doc["generation"] = number
    desc = (f"{os.path.basename(g)} replaced by a copy of {os.path.basename(o)}, manifest "
            "renumbered and resealed")
    if c.rng.random() < 0.6:
        doc["step"] = number
        desc += " (generation and step)"
    c.save_manifest(g, doc)
    return desc


_ESCAPES = ["../{other}/{name}", "{abs_outside}", "/etc/passwd", "sub/{name}", ".{name}",
            "", "..", ".", "x" * 300, "{name}\x00.txt", "{abs_self}", "MANIFEST.json",
            "../../{outside_rel}"]


@mutation("path-escape", 3)
def _path_escape(c: Case) -> str:
    g = c.pick_target()
    doc = c.manifest(g)
    entry = c.rng.choice(doc["artifacts"])
    outside_file = os.path.join(c.outside, "precious.txt")
    pattern = c.rng.choice(_ESCAPES)
    new = pattern.format(other=os.path.basename(c.other(g)), name=entry["name"],
                         abs_outside=outside_file, abs_self=os.path.join(g, entry["name"]),
                         outside_rel=os.path.relpath(outside_file, c.run))
    if c.rng.random() < 0.5 and pattern not in ("{abs_self}", "../{other}/{name}"):
        # point at a real file outside the generation, with its true size and hash
        with open(outside_file, "rb") as f:
            data = f.read()
        entry["size"], entry["xxh3_128"] = len(data), xxhash.xxh3_128(data).hexdigest()
    entry["name"] = new
    c.save_manifest(g, doc)  # resealed: the name check, not the checksum, must refuse it
    return f"artifact name {new!r:.60} in {os.path.basename(g)}/{MANIFEST} (resealed)"


@mutation("symlink", 3)
def _symlink(c: Case) -> str:
    g = c.pick_target()
    how = c.rng.choice(["same-bytes-outside", "outside-file", "older-generation", "dev-zero",
                        "manifest", "generation-folder", "dangling", "loop"])
    if how == "generation-folder":
        copy = os.path.join(c.outside, f"copy-{c.number}")
        shutil.copytree(g, copy)
        shutil.rmtree(g)
        os.symlink(copy, g)
        return f"{os.path.basename(g)} is a symlink to a copy outside the run"
    name = MANIFEST if how == "manifest" else c.rng.choice(c.names(g, manifest=False))
    path = os.path.join(g, name)
    if how in ("same-bytes-outside", "manifest"):
        target = os.path.join(c.outside, f"same-{c.number}-{name}")
        shutil.copyfile(path, target)
    elif how == "outside-file":
        target = os.path.join(c.outside, "precious.txt")
    elif how == "older-generation":
        target = os.path.join(c.other(g), name)
    elif how == "dev-zero":
        target = "/dev/zero"
    elif how == "dangling":
        target = os.path.join(c.outside, "does-not-exist")
    else:
        target = path  # a link to itself: ELOOP
    os.unlink(path)
    os.symlink(target, path)
    return f"{os.path.basename(g)}/{name} is a symlink ({how})"


@mutation("special-file", 3)
def _special(c: Case) -> str:
    g = c.pick_target()
    how = c.rng.choice(["fifo", "char-device", "socket", "folder"])
    name = MANIFEST if c.rng.random() < 0.25 else c.rng.choice(c.names(g, manifest=False))
    path = os.path.join(g, name)
    if name != MANIFEST and c.rng.random() < 0.7:
        doc = c.manifest(g)  # list it with the size a special file reports, 0 (resealed)
        for entry in doc["artifacts"]:
            if entry["name"] == name:
                entry["size"] = 0
        c.save_manifest(g, doc)
    os.unlink(path)
    if how == "fifo":
        os.mkfifo(path)
    elif how == "char-device":
        try:
            os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 5))  # /dev/zero
        except PermissionError:
            os.mkfifo(path)
            how = "fifo (mknod needs root)"
    elif how == "socket":
        s = socket.socket(socket.AF_UNIX)
        try:
            s.bind(path)
        except OSError:  # path too long for a socket address
            os.mkfifo(path)
            how = "fifo (socket path too long)"
        finally:
            s.close()
    else:
        os.mkdir(path)
    return f"{os.path.basename(g)}/{name} is a {how}"



@mutation("hostile-layout", 2)
def _layout(c: Case) -> str:
    c.layout = True
    how = c.rng.choice(["lock-symlink", "aside-symlink", "staging-symlink", "trash-symlink",
                        "staging-holds-symlink", "staging-file", "lock-fifo"])
    outside_file = os.path.join(c.outside, "precious.txt")
    if how.startswith("lock-"):
        os.unlink(os.path.join(c.run, "LOCK"))
    if how == "lock-symlink":
        os.symlink(outside_file, os.path.join(c.run, "LOCK"))
    elif how == "lock-fifo":
        os.mkfifo(os.path.join(c.run, "LOCK"))
    elif how == "aside-symlink":
        os.symlink(c.outside, os.path.join(c.run, "aside"))
        data = c.read(c.gens[-1], "model.safetensors")  # so that restore moves one aside
        c.flip(c.gens[-1], "model.safetensors", header_end(data), len(data))
    elif how in ("staging-symlink", "trash-symlink"):
        prefix = ".staging-000000008-0123456789ab" if how == "staging-symlink" \
            else ".trash-0123456789ab"
        os.symlink(c.outside, os.path.join(c.run, prefix))
    elif how == "staging-holds-symlink":
        staging = os.path.join(c.run, ".staging-000000008-0123456789ab")
        os.mkdir(staging)
        os.symlink(outside_file, os.path.join(staging, "model.safetensors"))
        os.symlink(c.outside, os.path.join(staging, "sub"))
    else:
        with open(os.path.join(c.run, ".staging-000000008-0123456789ab"), "wb") as f:
            f.write(b"not a folder")
    return f"hostile run folder: {how}"
