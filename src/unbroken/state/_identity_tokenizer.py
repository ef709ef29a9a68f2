"""Fingerprints of tokenizer objects: everything that changes what they encode to.

A Hugging Face fast tokenizer (or a bare ``tokenizers.Tokenizer``) is recorded by its
backend's full serialization (normalizer, pre-tokenizer, model with merges, post-processor,
decoder, added tokens, padding and truncation) plus the Python-side settings that change the
ids it returns (padding and truncation side, maximum length, named special tokens, ...); any
other tokenizer with ``save_pretrained`` by the files it writes. Both are kind
``hf-tokenizer``. An object with only ``get_vocab()`` stays kind ``vocab`` (class, vocab and
special tokens): nothing more can be read from it, and its entries compare as before."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from typing import Any

from ..errors import UnbrokenError, UnsupportedValue
from ._identity_json import json_entry, jsonable, xxh
from .jsontext import dumps_json

# Attributes of transformers tokenizers that change the ids or the padding of their output;
# those an object lacks are left out.
_SETTINGS = ("padding_side", "truncation_side", "model_max_length",
             "clean_up_tokenization_spaces", "split_special_tokens", "add_bos_token",
             "add_eos_token", "add_prefix_space", "do_lower_case", "model_input_names",
             "chat_template", "special_tokens_map", "all_special_tokens")
# Keys of a saved tokenizer_config.json that say how the tokenizer was loaded (from_pretrained's
# options, recorded there by transformers), not how it encodes.
_LOAD_OPTIONS = frozenset({"is_local", "local_files_only", "cache_dir", "force_download",
                           "resume_download", "proxies", "token", "use_auth_token", "revision",
                           "subfolder", "trust_remote_code", "_commit_hash", "name_or_path"})
# A tokenizer entry never keeps its whole value (a serialization runs to megabytes); its
# per-key digests name what changed.
_NEVER_KEEP = 0


def _vocab(tokenizer: Any, field: str) -> Mapping[str, Any]:
    vocab = tokenizer.get_vocab()
    if not isinstance(vocab, Mapping):
        raise UnsupportedValue(f"{field}: {type(tokenizer).__name__}.get_vocab() returned a "
                               f"{type(vocab).__name__}, not a mapping of token to id; pass "
                               "the tokenizer's folder or a revision string instead")
    return vocab


def _legacy_payload(tokenizer: Any, field: str) -> tuple[dict[str, Any], int]:
    """What unbroken recorded for every tokenizer object before ``hf-tokenizer`` existed."""
    vocab = _vocab(tokenizer, field)
    special = getattr(tokenizer, "all_special_tokens", None)
    return ({"class": type(tokenizer).__name__, "vocab": vocab,
             "special_tokens": special and list(special)}, len(vocab))


def _setting(value: Any, path: str) -> Any:
    try:
        return jsonable(value, path)
    except UnsupportedValue:  # an AddedToken or the like: its text is what encoding uses
        return f"<{type(value).__name__}> {value}"


def _settings(tokenizer: Any, field: str) -> dict[str, Any]:
    found = {}
    for name in _SETTINGS:
        value = getattr(tokenizer, name, _SETTINGS)
        if value is not _SETTINGS and not callable(value):
            found[name] = _setting(value, f"{field}.settings.{name}")
    return found


def _saved_files(tokenizer: Any, field: str) -> dict[str, Any]:
    """What ``save_pretrained`` writes: JSON files as trees (so a change is named by key),
    others by size and digest."""
    files: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="unbroken-tokenizer-") as folder:
        tokenizer.save_pretrained(folder)
        for parent, dirs, names in os.walk(folder):
            dirs.sort()
            for name in sorted(names):
                full = os.path.join(parent, name)
                rel = os.path.relpath(full, folder).replace(os.sep, "/")
                with open(full, "rb") as f:
                    data = f.read()
                try:
                    tree = json.loads(data)
                    if rel == "tokenizer_config.json" and isinstance(tree, dict):
                        # How it was loaded (offline, from a folder), and settings left at
                        # their default: not how it encodes
                        tree = {k: v for k, v in tree.items()
                                if k not in _LOAD_OPTIONS and v is not None}
                    files[rel] = jsonable(tree, f"{field}.files.{rel}")
                except (ValueError, UnicodeDecodeError, RecursionError, UnbrokenError):
                    files[rel] = {"bytes": len(data), "xxh3": xxh(data)}
    return files


def _payload(tokenizer: Any, field: str) -> tuple[dict[str, Any], str] | None:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None and callable(getattr(tokenizer, "to_str", None)):
        backend = tokenizer  # a bare tokenizers.Tokenizer
    name = type(tokenizer).__name__
    if backend is not None and callable(getattr(backend, "to_str", None)):
        serialized = json.loads(backend.to_str())
        if backend is not tokenizer and isinstance(serialized, dict):
            # A Transformers wrapper sets its backend's padding and truncation anew at every
            # call (from that call's arguments): what the last call left there is not the
            # tokenizer's, and fingerprinted it refused a resume that never called it. As a
            # fresh tokenizer has them (None): a bare tokenizers.Tokenizer keeps its own.
            serialized.update({k: None for k in ("padding", "truncation") if k in serialized})
        payload = {"class": name, "backend": serialized, "settings": _settings(tokenizer, field)}
        return payload, "tokenizer.json and settings"
    if callable(getattr(tokenizer, "save_pretrained", None)):
        return {"class": name, "files": _saved_files(tokenizer, field),
                "settings": _settings(tokenizer, field)}, "save_pretrained files and settings"
    return None


def tokenizer_entry(tokenizer: Any, field: str, keep_bytes: int) -> dict[str, Any]:
    """The identity entry of a tokenizer object; ``UnsupportedValue`` naming ``field`` when
    reading it fails."""
    name = type(tokenizer).__name__
    try:
        legacy, size = _legacy_payload(tokenizer, field)
        legacy_hash = xxh(dumps_json(jsonable(legacy, field)))
        full = _payload(tokenizer, field)
        if full is None:
            return json_entry("vocab", legacy, field, f"{name} with {size} tokens", keep_bytes)
        payload, how = full
        entry = json_entry("hf-tokenizer", payload, field,
                           f"{name} with {size} tokens ({how})", _NEVER_KEEP)
    except UnbrokenError:
        raise
    except Exception as e:  # the object's own code failed: say which call, keep the cause
        raise UnsupportedValue(
            f"{field}: fingerprinting the {name} failed ({type(e).__name__}: {e!s:.200}); "
            "pass the tokenizer's folder (save_pretrained) as a path, or a revision string"
        ) from e
    # The hash an older unbroken wrote for this object: lets a checkpoint saved then be
    # compared on what it recorded (see check_identity).
    entry["vocab_hash"] = legacy_hash
    return entry
