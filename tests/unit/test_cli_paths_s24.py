"""The command line given a path to nothing, found from outside (twenty-fourth session):
`verify` of a misspelled object-store bucket or prefix passed (exit 0, "ok": true) as a CI
gate would take it; a missing relative generation folder was named ".", and an unreachable
object store or refused credentials were blamed on the disk."""

from __future__ import annotations

import errno
import json
import os

import pytest
import torch

import unbroken
from unbroken._commands import os_message
from unbroken.cli import main


def test_verify_of_an_object_store_prefix_holding_nothing_is_no_pass(capsys) -> None:
    assert main(["verify", "memory://no-such-bucket/run", "--json"]) == 2
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is False and "nothing a Checkpointer writes is there" in doc["error"]
    assert main(["inspect", "memory://no-such-bucket/run"]) == 0
    assert "nothing a Checkpointer writes is there" in capsys.readouterr().out


def test_verify_of_an_object_store_run_still_passes(capsys) -> None:
    url = "memory://s24-cli/run"
    with unbroken.Checkpointer(url, model=torch.nn.Linear(2, 2)) as ckpt:
        ckpt.restore()
        ckpt.step_done(1)
        ckpt.save()
    assert main(["verify", url]) == 0
    assert "1 checked: 1 verified, 0 failed" in capsys.readouterr().out
    assert main(["inspect", url]) == 0
    assert "nothing a Checkpointer writes" not in capsys.readouterr().out


def test_a_missing_generation_folder_is_named_as_typed(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["verify", "gen-000000006"]) == 2
    err = capsys.readouterr().err
    assert "gen-000000006: no such generation folder" in err and ".:" not in err
    assert main(["verify", os.path.join("run", "gen-000000006")]) == 2
    assert "run/gen-000000006: no such generation folder" in capsys.readouterr().err


@pytest.mark.parametrize(("error", "says"), [
    (OSError(errno.EIO, 'EndpointConnectionError: Could not connect to the endpoint URL: '
                        '"http://127.0.0.1:1/bkt"'), "cannot be reached: check the endpoint"),
    (PermissionError("The AWS Access Key Id you provided does not exist in our records."),
     "refused these credentials"),
    (OSError("NoCredentialsError: Unable to locate credentials"), "give the object store"),
])
def test_an_object_store_error_says_what_to_do_not_check_the_disk(error, says) -> None:
    text = os_message(error, "s3://bkt/run")
    assert says in text and "check the disk" not in text
    assert text.startswith("s3://bkt/run: ")


def test_a_disk_error_keeps_its_remedy_and_its_own_file_name() -> None:
    text = os_message(OSError(errno.EIO, "Input/output error", "/r/gen-1/x"), "/r")
    assert text.startswith("/r/gen-1/x: Input/output error [EIO]") and "disk" in text


def test_messages_name_an_object_store_generations_manifest_where_it_is(monkeypatch) -> None:
    """Found from outside: a restore's warnings named the manifest inside the generation's
    upload folder (gen-N/u-XXXX/MANIFEST.json), where there is none."""
    import warnings

    url = "memory://s24-where/run"
    with unbroken.Checkpointer(url, model=torch.nn.Linear(2, 2)) as ckpt:
        ckpt.restore()
        ckpt.step_done(1)
        ckpt.save()
        [info] = ckpt.store.scan()
        assert "/u-" in info.path  # (its upload folder)
        assert ckpt.store.manifest_path(info) == f"{ckpt.store.root}/gen-000000001/MANIFEST.json"
        assert ckpt.store.fs.exists(ckpt.store.manifest_path(info))
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)  # (an environment that differs: a warning names it)
    try:
        with warnings.catch_warnings(record=True) as caught, \
                unbroken.Checkpointer(url, model=torch.nn.Linear(2, 2)) as again:
            warnings.simplefilter("always")
            assert again.restore() == 1
    finally:
        torch.set_num_threads(threads)
    named = [str(w.message) for w in caught if "MANIFEST.json" in str(w.message)]
    assert named and all("/u-" not in m and "gen-000000001/MANIFEST.json" in m for m in named)


@pytest.mark.parametrize("raised", [PermissionError("The AWS Access Key Id you provided does "
                                                    "not exist in our records."),
                                    FileNotFoundError("gone"), OSError("plain")])
def test_an_object_store_error_without_a_path_is_raised_naming_the_object(raised) -> None:
    """s3fs raises a refused credential as a bare PermissionError: it came out of restore()
    naming no object, under the client's own frames."""
    from unbroken.store.backends.objects import _translated

    def call():
        raise raised

    with pytest.raises(type(raised)) as e:
        _translated("s3://bkt/run/gen-000000001/MANIFEST.json", call)
    assert e.value.filename == "s3://bkt/run/gen-000000001/MANIFEST.json"
    assert str(raised) in str(e.value) and e.value.errno
    assert e.value.__cause__ is None and e.value.__suppress_context__
