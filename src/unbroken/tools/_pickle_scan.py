"""Reading pickles without executing them, for `unbroken audit`.

A pickle is a program for a small stack machine; unpickling runs it, and its GLOBAL /
STACK_GLOBAL / REDUCE instructions import and call whatever the file names. Here the program
is walked with ``pickletools``' ``genops`` (which only decodes instructions) and interpreted
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
from pickletools import genops
from typing import Any, BinaryIO

# -- what a global is ---------------------------------------------------------------------------

# The allowlist of torch's weights_only unpickler (torch/_weights_only_unpickler.py,
# `_get_allowed_globals`); written out so that auditing needs no torch internals. A test
# checks that it covers torch's own list.
_REBUILD = {"_rebuild_parameter", "_rebuild_parameter_with_state", "_rebuild_qtensor",
            "_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3",
            "_rebuild_sparse_tensor", "_rebuild_meta_tensor_no_storage",
            "_rebuild_nested_tensor", "_rebuild_wrapper_subclass",
            "_rebuild_device_tensor_from_numpy", "_rebuild_device_tensor_from_cpu_tensor"}
_DTYPES = ("float32 float64 float16 bfloat16 complex32 complex64 complex128 bool uint8 int8 "
           "int16 int32 int64 uint16 uint32 uint64 qint8 quint8 qint32 quint4x2 quint2x4 "
           "float8_e4m3fn float8_e5m2 float8_e4m3fnuz float8_e5m2fnuz float8_e8m0fnu "
           "float4_e2m1fn_x2 bits8 bits16 bits1x8 bits2x4 bits4x2 per_tensor_affine "
           "per_tensor_symmetric per_channel_affine per_channel_symmetric "
           "per_channel_affine_float_qparams").split() + [
    f"{u}int{n}" for u in ("", "u") for n in range(1, 8)]
WEIGHTS_ONLY_GLOBALS = frozenset(
    {"_codecs.encode", "builtins.bytearray", "builtins.complex", "builtins.set",
     "collections.Counter", "collections.OrderedDict", "torch.nn.parameter.Parameter",
     "torch.serialization._get_layout", "torch.Size", "torch.Tensor", "torch.device",
     "torch.storage.TypedStorage", "torch.storage.UntypedStorage",
     "torch._tensor._rebuild_from_type_v2"}
    | {f"torch._utils.{f}" for f in _REBUILD} | {f"torch.{d}" for d in _DTYPES})
# Legacy tensor and storage classes (torch.FloatStorage, torch.cuda.LongTensor, ...).
_TENSOR_CLASS = re.compile(
    r"torch\.(cuda\.)?(sparse\.)?(BFloat16|Bool|Byte|Char|ComplexDouble|ComplexFloat|Double|"
    r"Float|Half|Int|Long|Short|QInt32|QInt8|QUInt2x4|QUInt4x2|QUInt8)(Storage|Tensor)")

# NumPy arrays and RNG states (Trainer and Accelerate save ``np.random.get_state()``): loading
# them needs these globals allowlisted, which torch's weights-only loader refuses by default.
_NUMPY = re.compile(r"numpy\.(_core|core)\.multiarray\.(_reconstruct|scalar)|numpy\.(ndarray|dtype)"
                    r"|numpy\.dtypes\.\w+DType|numpy\.random\._pickle\.__\w+_ctor")
# The dataclasses and enum of a DCP ``.metadata`` file (and the pathlib path of its
# checkpoint id): torch's own, constructed with no code of the file's choosing, but outside
# the weights_only allowlist (DCP reads the file with plain pickle).
_DCP = re.compile(r"torch\.distributed\.checkpoint\.(metadata\.(Metadata|TensorStorageMetadata|"
                  r"BytesStorageMetadata|ChunkStorageMetadata|TensorProperties|MetadataIndex|"
                  r"StorageMeta|_MEM_FORMAT_ENCODING)|filesystem\._StorageInfo)"
                  r"|pathlib\.(_local\.)?(Pure)?(Posix|Windows)?Path")
# Globals that run commands or code as soon as they are called: named as dangerous.
_DANGEROUS_MODULES = {"os", "posix", "nt", "sys", "subprocess", "shutil", "socket", "runpy",
                      "importlib", "ctypes", "pty", "code", "codeop", "webbrowser", "marshal",
                      "pickle", "_pickle", "types", "operator", "functools", "torch.hub"}
_DANGEROUS_BUILTINS = {"eval", "exec", "compile", "getattr", "setattr", "delattr", "open",
                       "__import__", "globals", "locals", "vars", "input", "breakpoint"}


def classify(qualname: str) -> str:
    """``"weights_only"`` (torch's weights-only loader allows it), ``"numpy"`` (NumPy array
    or RNG state), ``"dcp"`` (DCP metadata classes) or ``"code"`` (importing it runs code
    the file chose: a user class, a library class, or worse)."""
    if qualname in WEIGHTS_ONLY_GLOBALS or _TENSOR_CLASS.fullmatch(qualname):
        return "weights_only"
    if _NUMPY.fullmatch(qualname):
        return "numpy"
    if _DCP.fullmatch(qualname):
        return "dcp"
    return "code"


def dangerous(qualname: str) -> bool:
    """A global that executes commands or arbitrary code when called (os.system, eval...)."""
    module, _, name = qualname.rpartition(".")
    return (module in _DANGEROUS_MODULES or module.split(".")[0] in _DANGEROUS_MODULES
            or (module == "builtins" and name in _DANGEROUS_BUILTINS) or module == "?")


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


@dataclass(frozen=True)
class PersistentId:
    """A persistent id (torch: a storage record); its payload is kept as data."""
    pid: Any


class _Mark:
    pass


class _Key:
    """Stands for a dict key that is not hashable (only a crafted pickle makes one)."""


_STORAGE_DTYPE = {"Float": "float32", "Double": "float64", "Half": "float16",
                  "BFloat16": "bfloat16", "Long": "int64", "Int": "int32", "Short": "int16",
                  "Char": "int8", "Byte": "uint8", "Bool": "bool", "ComplexFloat": "complex64",
                  "ComplexDouble": "complex128"}


def _tensor(args: Any) -> Tensor:
    """A Tensor from the arguments of torch._utils._rebuild_tensor*: (storage, offset, size,
    stride, ...) where storage is a persistent id ('storage', StorageClass, key, ...)."""
    if not isinstance(args, tuple) or len(args) < 3:
        return Tensor(None, None)
    shape = tuple(args[2]) if isinstance(args[2], (tuple, list)) else None
    if shape is not None and not all(type(d) is int for d in shape):
        shape = None
    dtype = None
    pid = args[0].pid if isinstance(args[0], PersistentId) else None
    if isinstance(pid, tuple) and len(pid) > 1 and isinstance(pid[1], Global):
        dtype = _STORAGE_DTYPE.get(pid[1].name.removesuffix("Storage"))
    if len(args) > 6 and isinstance(args[6], Global):  # _rebuild_tensor_v3 names its dtype
        dtype = args[6].name
    key = pid[2] if isinstance(pid, tuple) and len(pid) > 2 and type(pid[2]) is str else None
    offset = args[1] if type(args[1]) is int else -1
    stride = tuple(args[3]) if len(args) > 3 and isinstance(args[3], (tuple, list)) and all(
        type(d) is int for d in args[3]) else None
    return Tensor(shape, dtype, key, offset, stride)


def _reduce(func: Any, args: Any) -> Any:
    """The symbolic result of calling ``func(*args)``: plain data for the few callables whose
    meaning is known (OrderedDict, torch.Size, tensor rebuilds), else a `Call` record."""
    name = func.qualname if isinstance(func, Global) else ""
    if name in ("collections.OrderedDict", "builtins.dict", "collections.Counter"):
        out: dict[Any, Any] = {}
        if isinstance(args, tuple) and args and isinstance(args[0], (list, tuple)):
            for pair in args[0]:  # protocol 0/1 writes OrderedDict([[k, v], ...])
                if isinstance(pair, (list, tuple)) and len(pair) == 2:
                    _setitem(out, pair[0], pair[1])
        return out
    if name == "torch.Size" and isinstance(args, tuple) and args \
            and isinstance(args[0], (tuple, list)):
        return tuple(args[0])
    if name.startswith("torch._utils._rebuild_tensor") or name in (
            "torch._utils._rebuild_device_tensor_from_cpu_tensor",):
        return _tensor(args)
    if name.startswith("torch._utils._rebuild_parameter") and isinstance(args, tuple) and args:
        return args[0]
    if name == "torch._tensor._rebuild_from_type_v2" and isinstance(args, tuple) \
            and len(args) > 2 and isinstance(args[2], tuple):
        return _reduce(args[0], args[2])
    return Call(func, args)


def _setitem(target: Any, key: Any, value: Any) -> None:
    try:
        if not _shallow(key):  # (hash() of a tuple nested 300,000 deep overflows C's stack)
            raise TypeError
        hash(key)
    except TypeError:
        key = _Key()
    if isinstance(target, dict):
        target[key] = value
    elif isinstance(target, Call):
        target.items[key] = value


def _shallow(key: Any, depth: int = 0) -> bool:
    """Whether ``key`` nests tuples at most `_MAX_KEY_DEPTH` deep (a dict key's hash recurses
    into them in C, without a depth guard)."""
    if type(key) is not tuple:
        return True
    return depth < _MAX_KEY_DEPTH and all(_shallow(k, depth + 1) for k in key)


_MAX_KEY_DEPTH = 64


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
_CONSTANT = {"NONE": None, "NEWTRUE": True, "NEWFALSE": False}  # genops gives no argument
_NO_OP = {"PROTO", "FRAME", "READONLY_BUFFER"}


@dataclass
class PickleScan:
    """One pickle, read without executing it: its object tree, the globals it names (in
    order, each once) and an error when the stream could not be fully interpreted."""
    root: Any = None
    globals: list[str] = field(default_factory=list)
    unresolved: int = 0
    error: str | None = None

    def _add(self, g: Global) -> None:
        if g is UNRESOLVED:
            self.unresolved += 1
        elif g.qualname not in self.globals:
            self.globals.append(g.qualname)


class _Machine:
    """The pickle stack machine (after CPython's own), with symbolic values."""

    def __init__(self, scan: PickleScan) -> None:
        self.scan = scan
        self.stack: list[Any] = []
        self.marks: list[list[Any]] = []
        self.memo: dict[int, Any] = {}

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
                _setitem(out, items[i], items[i + 1])
            self.stack.append(out)
        elif name in ("APPEND", "ADDITEMS", "APPENDS"):
            values = [s.pop()] if name == "APPEND" else self.pop_mark()
            _extend(self.stack[-1], values)
        elif name == "SETITEM":
            value, key = s.pop(), s.pop()
            _setitem(s[-1], key, value)
        elif name == "SETITEMS":
            items = self.pop_mark()
            for i in range(0, len(items) - 1, 2):
                _setitem(self.stack[-1], items[i], items[i + 1])
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
            s[-1] = _reduce(s[-1], args)
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


def scan_pickle(stream: BinaryIO) -> PickleScan:
    """Read one pickle from ``stream`` (up to and including its STOP) without executing it.

    When the stack machine cannot follow (a malformed or crafted stream), the rest of the
    stream is still decoded for GLOBAL instructions and every later STACK_GLOBAL counts as an
    unresolved global, so nothing a real unpickler would import goes unreported."""
    scan = PickleScan()
    machine: _Machine | None = _Machine(scan)
    try:
        for ops, (op, arg, _pos) in enumerate(genops(stream)):
            if machine is not None and ops >= MAX_INSTRUCTIONS:
                # (each instruction may keep an object: a 20 KB file of 20 million empty
                # dicts held 4 GB)
                scan.error = (f"more than {MAX_INSTRUCTIONS:,} instructions: not interpreted "
                              "further (its globals are still listed)")
                machine = None
            if machine is not None:
                try:
                    if machine.step(op.name, arg):
                        return scan
                    continue
                except (IndexError, KeyError, TypeError, AttributeError, RecursionError) as e:
                    scan.error = f"malformed pickle at byte {_pos}: {op.name} ({e!r})"
                    machine = None
            if op.name in ("GLOBAL", "INST"):
                module, _, gname = str(arg).partition(" ")
                scan._add(Global(module, gname))
            elif op.name in ("STACK_GLOBAL", "EXT1", "EXT2", "EXT4"):
                scan._add(UNRESOLVED)
    except (ValueError, MemoryError, OverflowError) as e:  # genops: unknown opcode, bad
        scan.error = scan.error or f"malformed pickle: {e}"  # argument, no STOP
    return scan
