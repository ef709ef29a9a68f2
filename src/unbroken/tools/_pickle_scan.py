"""Reading pickles without executing them, for `unbroken audit`.

A pickle is a program for a small stack machine; unpickling runs it, and its GLOBAL /
STACK_GLOBAL / REDUCE instructions import and call whatever the file names. Here the program
is decoded by `._pickle_ops` (which reads every argument at least as permissively as
CPython's unpicklers, and executes nothing) and interpreted
*symbolically*: a global becomes a `Global` name, never an imported object; a call becomes a
`Call` record, never a call. The result is the object tree as far as plain data goes (dicts,
lists, strings, numbers), with tensors as `Tensor` placeholders (shape and dtype from the
arguments of torch's rebuild functions), and the list of every global the file references,
each classified against what torch's weights-only loader would allow.

Readers for the containers that hold such pickles: torch.save zip archives (``*/data.pkl``),
legacy torch.save files (a sequence of pickles followed by raw storage bytes) and plain
pickles. Nothing here imports ``pickle`` or calls ``torch.load``."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from ._pickle_globals import WEIGHTS_ONLY_GLOBALS, classify, dangerous, fixed
from ._pickle_ops import PickleSyntaxError, Readable, WorkExceeded, _Work, read_ops

__all__ = ["WEIGHTS_ONLY_GLOBALS", "classify", "dangerous", "fixed", "scan_pickle"]

# -- the symbolic values ------------------------------------------------------------------------


@dataclass(frozen=True)
class Global:
    """A global the pickle names (module and name), never imported."""
    module: str
    name: str

    @property
    def qualname(self) -> str:
        return f"{self.module}.{self.name}"


UNRESOLVED = Global("?", "?")  # a STACK_GLOBAL whose names were not plain strings


class Call:
    """What a REDUCE, NEWOBJ, INST or OBJ would have built: the callable, its arguments, and
    what the pickle then stored into it (BUILD state, SETITEMS, APPENDS)."""

    def __init__(self, func: Any, args: Any) -> None:
        self.func, self.args = func, args
        self.state: Any = None
        self.items: dict[Any, Any] = {}
        self.list: list[Any] = []

    @property
    def name(self) -> str:
        return self.func.qualname if isinstance(self.func, Global) else "?"


@dataclass
class Tensor:
    """A tensor the pickle would rebuild: shape and dtype as far as the arguments tell, and
    where its bytes are (the storage record's key, the element offset and strides), so that
    `tools.importing` can read them from the archive without unpickling."""
    shape: tuple[int, ...] | None
    dtype: str | None
    key: str | None = None
    offset: int = 0
    stride: tuple[int, ...] | None = None
    numel: int | None = None  # the storage's element count, as its persistent id says
    # the storage is untyped (torch's record of a dtype without a storage class of its own:
    # uint16, uint32, uint64): its persistent id counts bytes, not elements
    untyped: bool = False


@dataclass(frozen=True)
class PersistentId:
    """A persistent id (torch: a storage record); its payload is kept as data."""
    pid: Any


class _Mark:
    pass


class _Key:
    """Stands for a dict key that is not hashable (only a crafted pickle makes one)."""

    def __repr__(self) -> str:
        return "<an unhashable or too deeply nested key>"


_STORAGE_DTYPE = {"Float": "float32", "Double": "float64", "Half": "float16",
                  "BFloat16": "bfloat16", "Long": "int64", "Int": "int32", "Short": "int16",
                  "Char": "int8", "Byte": "uint8", "Bool": "bool", "ComplexFloat": "complex64",
                  "ComplexDouble": "complex128"}


def _tensor(args: Any, work: _Work) -> Tensor:
    """A Tensor from the arguments of torch._utils._rebuild_tensor*: (storage, offset, size,
    stride, ...) where storage is a persistent id ('storage', StorageClass, key, location,
    numel)."""
    if not isinstance(args, tuple) or len(args) < 3:
        return Tensor(None, None)
    shape = work.copy(args[2])
    if shape is not None and not all(type(d) is int for d in shape):
        shape = None
    dtype = None
    untyped = False
    pid = args[0].pid if isinstance(args[0], PersistentId) else None
    if isinstance(pid, tuple) and len(pid) > 1 and isinstance(pid[1], Global):
        dtype = _STORAGE_DTYPE.get(pid[1].name.removesuffix("Storage"))
        untyped = pid[1].name == "UntypedStorage"
    if len(args) > 6 and isinstance(args[6], Global):  # _rebuild_tensor_v3 names its dtype
        dtype = args[6].name
    key = pid[2] if isinstance(pid, tuple) and len(pid) > 2 and type(pid[2]) is str else None
    numel = pid[4] if isinstance(pid, tuple) and len(pid) > 4 and type(pid[4]) is int else None
    offset = args[1] if type(args[1]) is int else -1
    stride = work.copy(args[3]) if len(args) > 3 else None
    if stride is not None and not all(type(d) is int for d in stride):
        stride = None
    return Tensor(shape, dtype, key, offset, stride, numel, untyped)


def _reduce(func: Any, args: Any, work: _Work, depth: int = 0) -> Any:
    """The symbolic result of calling ``func(*args)``: plain data for the few callables whose
    meaning is known (OrderedDict, torch.Size, tensor rebuilds), else a `Call` record."""
    name = func.qualname if isinstance(func, Global) else ""
    if name in ("collections.OrderedDict", "builtins.dict", "collections.Counter"):
        out: dict[Any, Any] = {}
        if isinstance(args, tuple) and args and isinstance(args[0], (list, tuple)):
            work.charge(len(args[0]))
            for pair in args[0]:  # protocol 0/1 writes OrderedDict([[k, v], ...])
                if isinstance(pair, (list, tuple)) and len(pair) == 2:
                    _setitem(out, pair[0], pair[1], work)
        return out
    if name == "torch.Size" and isinstance(args, tuple) and args \
            and isinstance(args[0], (tuple, list)):
        return work.copy(args[0])
    if name.startswith("torch._utils._rebuild_tensor") or name in (
            "torch._utils._rebuild_device_tensor_from_cpu_tensor",):
        return _tensor(args, work)
    if name.startswith("torch._utils._rebuild_parameter") and isinstance(args, tuple) and args:
        return args[0]
    if name == "torch._tensor._rebuild_from_type_v2" and isinstance(args, tuple) \
            and len(args) > 2 and isinstance(args[2], tuple) and depth < 8:
        return _reduce(args[0], args[2], work, depth + 1)
    return Call(func, args)


def _setitem(target: Any, key: Any, value: Any, work: _Work) -> None:
    if type(key) not in (str, int) and not _cheap_hash(key, work):
        key = _Key()
    if isinstance(target, dict):
        target[key] = value
    elif isinstance(target, Call):
        target.items[key] = value


def _cheap_hash(key: Any, work: _Work) -> bool:
    """Whether ``key`` can be a dict key at a bounded cost. Hashing a tuple (or a persistent
    id, which hashes its payload) recurses in C without a depth guard: 300,000 levels
    overflow the C stack, and a tuple of two references to one tuple, 60 levels deep, takes
    2**60 steps (an equal key's comparison the same). So the key is walked first, as a tree,
    at most `_MAX_KEY_DEPTH` deep and `_MAX_KEY_NODES` nodes (charged to the work budget)."""
    todo: list[tuple[Any, int]] = [(key, 0)]
    nodes = 0
    while todo:
        node, depth = todo.pop()
        nodes += 1
        if nodes > _MAX_KEY_NODES or depth > _MAX_KEY_DEPTH:
            work.charge(nodes)
            return False
        if type(node) is tuple:
            todo += [(k, depth + 1) for k in node]
        elif type(node) is PersistentId:
            todo.append((node.pid, depth + 1))
        elif type(node) in (list, dict, Tensor, _Mark):
            work.charge(nodes)
            return False  # (unhashable)
    work.charge(nodes)
    try:
        hash(key)
    except TypeError:
        return False
    return True


_MAX_KEY_DEPTH = 64
_MAX_KEY_NODES = 10_000


def _extend(target: Any, values: list[Any]) -> None:
    if isinstance(target, list):
        target.extend(values)
    elif isinstance(target, Call):
        target.list.extend(values)


# -- the interpreter ----------------------------------------------------------------------------

_PUSH_ARG = {"INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4", "STRING",
             "BINSTRING", "SHORT_BINSTRING", "BINBYTES", "SHORT_BINBYTES", "BINBYTES8",
             "BYTEARRAY8", "UNICODE", "SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "FLOAT",
             "BINFLOAT"}
_CONSTANT = {"NONE": None, "NEWTRUE": True, "NEWFALSE": False}  # (no argument)
_NO_OP = {"PROTO", "FRAME", "READONLY_BUFFER"}


@dataclass
class PickleScan:
    """One pickle, read without executing it: its object tree, the globals it names (in
    order, each once) and an error when the stream could not be fully interpreted.
    ``not_pickle``: the stream fails on its very first instruction, where CPython's
    unpicklers fail too, before anything could be imported (a text file, say)."""
    root: Any = None
    globals: list[str] = field(default_factory=list)
    unresolved: int = 0
    error: str | None = None
    not_pickle: bool = False
    _seen: set[str] = field(default_factory=set, repr=False)

    def _add(self, g: Global) -> None:
        if g is UNRESOLVED:
            self.unresolved += 1
        elif g.qualname not in self._seen:  # (a set: a million globals, each looked up)
            self._seen.add(g.qualname)
            self.globals.append(g.qualname)


class _Machine:
    """The pickle stack machine (after CPython's own), with symbolic values."""

    def __init__(self, scan: PickleScan) -> None:
        self.scan = scan
        self.stack: list[Any] = []
        self.marks: list[list[Any]] = []
        self.memo: dict[int, Any] = {}
        self.work = _Work()

    def pop_mark(self) -> list[Any]:
        items, self.stack = self.stack, self.marks.pop()
        return items

    def step(self, name: str, arg: Any) -> bool:
        """Run one instruction; True at STOP."""
        s = self.stack
        if name in _PUSH_ARG:
            s.append(arg)
        elif name in _CONSTANT:
            s.append(_CONSTANT[name])
        elif name in _NO_OP:
            pass
        elif name == "MARK":
            self.marks.append(s)
            self.stack = []
        elif name == "STOP":
            self.scan.root = s.pop()
            return True
        elif name in ("EMPTY_LIST", "EMPTY_DICT", "EMPTY_TUPLE", "EMPTY_SET"):
            s.append({"EMPTY_LIST": [], "EMPTY_DICT": {}, "EMPTY_TUPLE": ()}.get(name, []))
        elif name in ("LIST", "TUPLE", "FROZENSET"):
            items = self.pop_mark()
            self.stack.append(tuple(items) if name == "TUPLE" else items)
        elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
            n = int(name[-1])
            items = s[-n:]
            del s[-n:]
            s.append(tuple(items))
        elif name == "DICT":
            items = self.pop_mark()
            out: dict[Any, Any] = {}
            for i in range(0, len(items) - 1, 2):
                _setitem(out, items[i], items[i + 1], self.work)
            self.stack.append(out)
        elif name in ("APPEND", "ADDITEMS", "APPENDS"):
            values = [s.pop()] if name == "APPEND" else self.pop_mark()
            _extend(self.stack[-1], values)
        elif name == "SETITEM":
            value, key = s.pop(), s.pop()
            _setitem(s[-1], key, value, self.work)
        elif name == "SETITEMS":
            items = self.pop_mark()
            for i in range(0, len(items) - 1, 2):
                _setitem(self.stack[-1], items[i], items[i + 1], self.work)
        elif name == "POP":
            if s:
                s.pop()
            else:
                self.pop_mark()
        elif name == "POP_MARK":
            self.pop_mark()
        elif name == "DUP":
            s.append(s[-1])
        elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
            self.memo[arg] = s[-1]
        elif name == "MEMOIZE":
            self.memo[len(self.memo)] = s[-1]
        elif name in ("GET", "BINGET", "LONG_BINGET"):
            s.append(self.memo[arg])
        elif name in ("GLOBAL", "INST"):
            module, _, gname = str(arg).partition(" ")
            g = Global(module, gname)
            self.scan._add(g)
            if name == "GLOBAL":
                s.append(g)
            else:
                self.stack.append(Call(g, tuple(self.pop_mark())))
        elif name == "STACK_GLOBAL":
            gname, module = s.pop(), s.pop()
            g = Global(module, gname) if isinstance(module, str) and isinstance(gname, str) \
                else UNRESOLVED
            self.scan._add(g)
            s.append(g)
        elif name in ("EXT1", "EXT2", "EXT4"):  # a global named by the copyreg registry
            self.scan._add(UNRESOLVED)
            s.append(UNRESOLVED)
        elif name == "OBJ":
            items = self.pop_mark()
            self.stack.append(Call(items[0], tuple(items[1:])))
        elif name == "REDUCE":
            args = s.pop()
            s[-1] = _reduce(s[-1], args, self.work)
        elif name == "NEWOBJ":
            args = s.pop()
            s[-1] = Call(s[-1], args)
        elif name == "NEWOBJ_EX":
            s.pop()  # keyword arguments
            args = s.pop()
            s[-1] = Call(s[-1], args)
        elif name == "BUILD":
            state = s.pop()
            if isinstance(s[-1], Call):
                s[-1].state = state
        elif name == "PERSID":
            s.append(PersistentId(arg))
        elif name == "BINPERSID":
            s[-1] = PersistentId(s[-1])
        elif name == "NEXT_BUFFER":
            s.append(Call(Global("pickle", "PickleBuffer"), ()))
        else:
            raise ValueError(f"unknown opcode {name}")
        return False


# Instructions interpreted per pickle: a torch.save of 100,000 tensors takes about 2.5 million.
MAX_INSTRUCTIONS = 8_000_000
# Instructions decoded per pickle, interpreted or not: the rest is not read (a 1 MB archive
# inflating to 1 GiB of one-byte instructions took 463 s to list its globals).
MAX_DECODED = 2 * MAX_INSTRUCTIONS
_IDENTIFIER = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def scan_pickle(stream: Readable) -> PickleScan:
    """Read one pickle from ``stream`` (up to and including its STOP) without executing it.

    When the stack machine cannot follow (a malformed or crafted stream, or one past the
    instruction or work budget), the rest of the stream is still decoded for GLOBAL
    instructions and every later STACK_GLOBAL counts as an unresolved global, so nothing a
    real unpickler would import goes unreported; the scan then has an ``error``, which
    flags it. Past `MAX_DECODED` instructions nothing more is read, and an unresolved global
    stands for whatever the rest would import."""
    scan = PickleScan()
    machine: _Machine | None = _Machine(scan)
    decoded = 0  # instructions decoded
    try:
        for ops, (name, arg, pos) in enumerate(read_ops(stream)):
            decoded = ops + 1
            if ops >= MAX_DECODED:  # (what it would import past here is unknown: unresolved)
                scan.error = (f"more than {MAX_DECODED:,} instructions: not read past byte "
                              f"{pos}, where globals may still be imported")
                scan._add(UNRESOLVED)
                return scan
            if machine is not None and ops >= MAX_INSTRUCTIONS:
                # (each instruction may keep an object: a 20 KB file of 20 million empty
                # dicts held 4 GB)
                scan.error = (f"more than {MAX_INSTRUCTIONS:,} instructions: not interpreted "
                              "further (its globals are still listed)")
                machine = None
            if machine is not None:
                try:
                    if machine.step(name, arg):
                        return scan
                    continue
                except (IndexError, KeyError, TypeError, AttributeError, RecursionError,
                        ValueError) as e:
                    scan.error = f"malformed pickle at byte {pos}: {name} ({e!r:.200})"
                    machine = None
                    # Nothing ran before a first instruction no unpickler can run (a text
                    # file); a global it names with a plausible module still counts.
                    scan.not_pickle = ops == 0 and not (
                        name in ("GLOBAL", "INST")
                        and _IDENTIFIER.fullmatch(str(arg).partition(" ")[0]))
                except WorkExceeded as e:
                    scan.error = f"not interpreted further at byte {pos}: {e}"
                    machine = None
            if name in ("GLOBAL", "INST"):
                module, _, gname = str(arg).partition(" ")
                scan._add(Global(module, gname))
            elif name in ("STACK_GLOBAL", "EXT1", "EXT2", "EXT4"):
                scan._add(UNRESOLVED)
    except PickleSyntaxError as e:  # an instruction that cannot be decoded, no STOP
        scan.error = scan.error or f"malformed pickle: {e}"
        scan.not_pickle = scan.not_pickle or (decoded == 0 and e.certain)
    except (ValueError, OSError, MemoryError, OverflowError) as e:  # (the container's read)
        scan.error = scan.error or f"unreadable pickle: {e!s:.200}"
    return scan
