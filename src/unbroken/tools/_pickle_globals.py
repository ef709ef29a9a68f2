"""What a global a pickle names would do if imported, for `unbroken audit` and `unbroken
import`: allowed by torch's weights-only loader, a NumPy array or RNG state, a DCP metadata
class, or code of the file's choosing (and whether that code runs commands). Names are judged
as the unpickler resolves them: a protocol 0-2 pickle's Python 2 names (``__builtin__.eval``,
``commands.getoutput``) are mapped to their Python 3 modules first, as ``pickle``'s
``fix_imports`` (on by default, and used by ``torch.load``) does. (Moved out of
``_pickle_scan.py``.)"""

from __future__ import annotations

import re
from _compat_pickle import IMPORT_MAPPING, NAME_MAPPING

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


def fixed(qualname: str) -> str:
    """The global the unpickler imports for ``qualname`` (module.name) when it applies
    Python 2's names (``fix_imports``, for protocols 0-2): ``__builtin__.eval`` is
    ``builtins.eval``, ``commands.getoutput`` is ``subprocess.getoutput``."""
    module, _, name = qualname.rpartition(".")
    if (module, name) in NAME_MAPPING:
        module, name = NAME_MAPPING[(module, name)]
    elif module in IMPORT_MAPPING:
        module = IMPORT_MAPPING[module]
    return f"{module}.{name}"


def classify(qualname: str) -> str:
    """``"weights_only"`` (torch's weights-only loader allows it), ``"numpy"`` (NumPy array
    or RNG state), ``"dcp"`` (DCP metadata classes) or ``"code"`` (importing it runs code
    the file chose: a user class, a library class, or worse). A Python 2 name is judged as
    the Python 3 global the unpickler maps it to."""
    for name in dict.fromkeys((qualname, fixed(qualname))):
        if name in WEIGHTS_ONLY_GLOBALS or _TENSOR_CLASS.fullmatch(name):
            return "weights_only"
        if _NUMPY.fullmatch(name):
            return "numpy"
        if _DCP.fullmatch(name):
            return "dcp"
    return "code"


def dangerous(qualname: str) -> bool:
    """A global that executes commands or arbitrary code when called (os.system, eval...),
    under its own name or the Python 3 name the unpickler maps it to."""
    return any(_dangerous(name) for name in (qualname, fixed(qualname)))


def _dangerous(qualname: str) -> bool:
    module, _, name = qualname.rpartition(".")
    return (module in _DANGEROUS_MODULES or module.split(".")[0] in _DANGEROUS_MODULES
            or (module == "builtins" and name in _DANGEROUS_BUILTINS) or module == "?")
