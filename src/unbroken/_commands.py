"""The command registry of the ``unbroken`` command line and its output conventions, below
``cli.py`` so that the tools' own modules (`tools`) register their commands here without
importing the command line itself. (Moved out of ``cli.py`` unchanged.)"""

from __future__ import annotations

import argparse
import errno
import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

EXIT_OK, EXIT_PROBLEM, EXIT_USAGE = 0, 1, 2


# -- command registry ---------------------------------------------------------------------------

Argument = tuple[tuple[str, ...], dict[str, Any]]
Runner = Callable[[argparse.Namespace], int]


def count(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``minimum``."""
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text}: at least {minimum}")
        return value
    parse.__name__ = "integer"
    return parse


def tolerance(text: str) -> float:
    """An argparse type: a finite float >= 0."""
    value = float(text)
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text}: a finite number >= 0")
    return value


def seconds(text: str) -> float:
    value = tolerance(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"{text}: more than 0 seconds")
    return value


def arg(*flags: str, **kwargs: Any) -> Argument:
    """An ``add_argument`` call, written down for ``@command``."""
    return flags, kwargs


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    run: Runner
    arguments: tuple[Argument, ...]


COMMANDS: dict[str, Command] = {}

# The tools' commands: each one's module in `unbroken.tools` and its one-line help. The command
# line lists them from here and imports only the module of the command it runs. The tools that
# need torch (2 s to import) declare their commands in `tools._entries`, which imports each
# tool when its command runs: ``--help`` and usage errors never wait for torch.
TOOLS: dict[str, tuple[str, str]] = {
    "audit": ("audit", "read a foreign checkpoint safely and say which continuation state it "
                       "lacks"),
    "diff": ("_entries", "what differs between two generations: tensors, counters, RNG, "
                         "learning rates"),
    "export": ("_entries", "write a generation's weights for inference (safetensors + "
                           "identity)"),
    "verify-export": ("_entries", "reload an export into a rebuilt model and re-run its fixed "
                                  "inputs"),
    "import": ("_entries", "turn a Trainer, Accelerate, Lightning or torch.save checkpoint "
                           "into an unbroken warm-start run"),
    "plan": ("plan", "save interval, overhead fraction and expected lost work"),
}


def command(name: str, help: str, *arguments: Argument
            ) -> Callable[[Runner], Runner]:
    """Register a subcommand; ``--json`` is added to every command."""
    def register(run: Runner) -> Runner:
        if name in COMMANDS:
            raise ValueError(f"command {name!r} registered twice")
        COMMANDS[name] = Command(name, help, run, arguments)
        return run
    return register


def tool(name: str, *arguments: Argument) -> Callable[[Runner], Runner]:
    """Register a tool's subcommand (`command`), with its help from `TOOLS`; only from the
    module `TOOLS` names for it (the only one the command line imports to run it)."""
    module, help = TOOLS[name]

    def register(run: Runner) -> Runner:
        if run.__module__ != f"unbroken.tools.{module}":
            raise ValueError(f"command {name!r} is registered in {run.__module__}; TOOLS "
                             f"names unbroken.tools.{module}")
        return command(name, help, *arguments)(run)
    return register


# -- output -------------------------------------------------------------------------------------


def fail(args: argparse.Namespace, message: str, code: int) -> int:
    """Report an error: on stderr, and with ``--json`` also as a JSON document on stdout."""
    error(message)
    if getattr(args, "json", False):
        print(json.dumps({"ok": False, "error": message, "exit_status": code}, indent=2))
    return code


# -- output -------------------------------------------------------------------------------------


# What to do about an OS error met while reading a run (the message says what failed).
_READ_REMEDY = {errno.EACCES: "let this user read it (check the permissions of the run folder "
                "and its generations)", errno.EPERM: "let this user read it (check the "
                "permissions of the run folder and its generations)",
                errno.EIO: "the device failed a read: check the disk (dmesg), or restore from a "
                "copy of the run", errno.ENOENT: "it was removed while the command ran, or the "
                "path is wrong: check it and run again"}


# What an object store's client (s3fs, gcsfs over aiohttp and botocore) says, as an OSError,
# when it cannot reach the server or the server refuses the credentials: told apart from a
# local disk's errors, whose remedies (check the disk) would send the user the wrong way.
_UNREACHABLE = ("EndpointConnectionError", "Could not connect to the endpoint",
                "ClientConnectorError", "ConnectTimeoutError", "Name or service not known")
_REFUSED = ("InvalidAccessKeyId", "Access Key Id you provided does not exist",
            "SignatureDoesNotMatch", "InvalidClientTokenId", "ExpiredToken")
_SETTINGS = ("AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), and "
             "AWS_ENDPOINT_URL (or FSSPEC_S3_ENDPOINT_URL) for an S3-compatible server")


def os_message(e: OSError, where: str | None = None) -> str:
    """An OS error as a message with what to do: an object store's missing or refused
    credentials (s3fs raises them as an OSError) name the settings that give them, an
    unreachable server the endpoint. ``where``: the run or path the command was given,
    named when the error itself names none."""
    name = errno.errorcode.get(e.errno or 0)
    text = (f"{e.filename}: {e.strerror}" + (f" [{name}]" if name else "")
            if e.filename is not None and e.strerror else str(e) or type(e).__name__)
    if where and where not in text:
        text = f"{where}: {text}"
    if "NoCredentialsError" in text or "Unable to locate credentials" in text:
        return f"{text}; give the object store credentials: {_SETTINGS}"
    if any(s in text for s in _REFUSED):
        return f"{text}; the object store refused these credentials: check {_SETTINGS}"
    if any(s in text for s in _UNREACHABLE):
        return (f"{text}; the object store cannot be reached: check the endpoint "
                "(AWS_ENDPOINT_URL or FSSPEC_S3_ENDPOINT_URL) and the network")
    remedy = _READ_REMEDY.get(e.errno or 0)
    return f"{text}; {remedy}" if remedy else text


def error(message: str) -> None:
    print(f"unbroken: error: {printable(message)}", file=sys.stderr)


def printable(text: str) -> str:
    """Escape control characters: names and summaries come from files we do not trust."""
    return "".join(c if c.isprintable() or c in "\n\t" else repr(c)[1:-1] for c in text)


def json_safe(obj: Any) -> Any:
    """Standard JSON: NaN and infinities (a NaN loss metric) become "nan", "inf", "-inf"."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return repr(obj)
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def emit(args: argparse.Namespace, payload: dict[str, Any], text: str, ok: bool) -> int:
    """Print ``payload`` as JSON (``--json``) or ``text``; return the exit status for ``ok``.
    Every document says ``ok`` (added last when the payload has none)."""
    if args.json:
        payload = payload if "ok" in payload else {**payload, "ok": ok}
        print(json.dumps(json_safe(payload), indent=2, allow_nan=False))
    else:
        print(printable(text))
    return EXIT_OK if ok else EXIT_PROBLEM
