"""The corruption fuzz's own judgement (`torture.corrupt`)."""

from __future__ import annotations


def test_the_fuzz_judges_a_refusal_naming_a_file_and_a_part_as_a_live_check():
    """(The corruption fuzz's judge: a resealed scheduler state refused as
    ``gen-.../state.json [scheduler]: ...`` fits the live objects, which verify cannot do.)"""
    from unbroken.torture.corrupt import _live_check
    gen = "/r/gen-000000006"
    assert _live_check(gen, f"{gen}/state.json [scheduler]: lacks ['last_epoch']")
    assert _live_check(gen, f"{gen} [optimizer]: 3 groups, 2 live")
    assert not _live_check(gen, f"{gen}/model.safetensors: content hash 1, the manifest lists 2")
    assert not _live_check(gen, f"{gen}/sub/x [y]: z")
