"""A warm start that leaves some of the model as it is live (``restore(intent="warm_start",
fresh=[...])``): a new head, a layer of another shape, a layer the checkpoint lacks or one
the new model dropped. Every other name must still match; what is kept stays bitwise as it
was, what is loaded is the checkpoint's, and the new run's lineage records the patterns."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from torch import nn

import unbroken
from unbroken.cli import main as cli_main
from unbroken.errors import StateMismatch


def _base() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))


def _saved(tmp_path: Path, model: nn.Module | None = None) -> tuple[str, nn.Module]:
    model = model or _base()
    src = str(tmp_path / "pre")
    ck = unbroken.Checkpointer(src, model=model)
    ck.save(3)
    ck.close()
    return src, model


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], keys: list[str]) -> bool:
    return all(torch.equal(a[k], b[k]) for k in keys)


def test_a_new_head_and_an_added_layer_stay_fresh_and_the_rest_loads(tmp_path, capsys):
    src, old = _saved(tmp_path)
    torch.manual_seed(1)
    new = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 5), nn.Linear(5, 3))
    before = _state(new)
    ck = unbroken.Checkpointer(str(tmp_path / "ft"), model=new)
    assert ck.restore(intent="warm_start", source=src, fresh=["2.*", "3.*"]) == 0
    after = _state(new)
    assert _same(after, _state(old), ["0.weight", "0.bias"])
    assert _same(after, before, ["2.weight", "2.bias", "3.weight", "3.bias"])
    ck.save(1)
    ck.close()
    manifest = json.loads(next((tmp_path / "ft").glob("gen-*/MANIFEST.json")).read_text())
    assert manifest["origin"]["fresh"] == ["2.*", "3.*"]
    assert manifest["origin"]["operation"] == "warm_start"
    assert cli_main(["inspect", str(tmp_path / "ft")]) == 0
    assert "kept fresh: 2.*, 3.*" in capsys.readouterr().out
    again = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 5), nn.Linear(5, 3))
    resumed = unbroken.Checkpointer(str(tmp_path / "ft"), model=again)
    assert resumed.restore() == 1  # (the new run continues as any run does)
    assert _same(_state(again), after, list(after))
    resumed.close()


def test_a_layer_the_new_model_dropped_is_skipped_by_its_saved_names(tmp_path):
    torch.manual_seed(0)
    src, old = _saved(tmp_path, nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4),
                                              nn.Linear(4, 2)))
    new = nn.Sequential(nn.Linear(4, 4))
    unbroken.Checkpointer(str(tmp_path / "ft"), model=new).restore(
        intent="warm_start", source=src, fresh=["1.*", "2.*"])
    assert _same(_state(new), _state(old), ["0.weight", "0.bias"])


def test_without_fresh_the_refusal_names_the_remedy(tmp_path):
    src, _ = _saved(tmp_path)
    new = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 5))
    with pytest.raises(StateMismatch, match=r"'2.weight': expected \(5, 4\).*'2.bias'.*"
                                            r"fresh=\['2.\*'\]"):
        unbroken.Checkpointer(str(tmp_path / "a"), model=new).restore(
            intent="warm_start", source=src)
    more = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2), nn.Linear(2, 2))
    with pytest.raises(StateMismatch, match=r"missing \['3.weight', '3.bias'\].*fresh="):
        unbroken.Checkpointer(str(tmp_path / "b"), model=more).restore(
            intent="warm_start", source=src)


def test_a_pattern_that_matches_nothing_is_refused_and_nothing_changes(tmp_path):
    src, _ = _saved(tmp_path)
    new = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 5))
    before = _state(new)
    with pytest.raises(StateMismatch, match=r"fresh=\['hed\.\*'\] matches no name.*'2.weight'"):
        unbroken.Checkpointer(str(tmp_path / "ft"), model=new).restore(
            intent="warm_start", source=src, fresh=["2.*", "hed.*"])
    assert _same(_state(new), before, list(before))


def test_fresh_is_checked_before_anything_is_read(tmp_path):
    ck = unbroken.Checkpointer(str(tmp_path / "run"), model=_base())
    with pytest.raises(ValueError, match="for intent='warm_start'"):
        ck.restore(fresh=["2.*"])
    for bad in ([""], [3], [None]):
        with pytest.raises(ValueError, match="glob pattern"):
            ck.restore(intent="warm_start", source=str(tmp_path / "none"), fresh=bad)
    ck.close()


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(5, 3)
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.emb.weight


def test_a_kept_tensor_tied_to_a_loaded_one_is_refused_unless_both_are_kept(tmp_path):
    src, _ = _saved(tmp_path, _Tied())
    torch.manual_seed(5)
    live = _Tied()
    before = _state(live)
    with pytest.raises(StateMismatch, match=r"'head.weight', whose memory .* 'emb.weight'"):
        unbroken.Checkpointer(str(tmp_path / "a"), model=live).restore(
            intent="warm_start", source=src, fresh=["head.*"])
    unbroken.Checkpointer(str(tmp_path / "b"), model=live).restore(
        intent="warm_start", source=src, fresh=["head.*", "emb.*"])
    assert _same(_state(live), before, list(before))
    assert live.head.weight is live.emb.weight


class _Hooked(nn.Module):
    """A model that loads its own way (a load hook): torch's load_state_dict is used."""

    def __init__(self, out: int) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, out)
        self.loaded: list[list[str]] = []
        self._register_load_state_dict_pre_hook(self._seen)

    def _seen(self, state, prefix, *args) -> None:  # noqa: ANN001 -- torch's hook signature
        self.loaded.append(sorted(state))


def test_a_model_that_loads_its_own_way_keeps_its_fresh_names_too(tmp_path):
    src, old = _saved(tmp_path, _Hooked(2))
    torch.manual_seed(9)
    new = _Hooked(7)
    before = _state(new)
    unbroken.Checkpointer(str(tmp_path / "ft"), model=new).restore(
        intent="warm_start", source=src, fresh=["head.*"])
    assert new.loaded  # (its own load_state_dict ran, strict, with every name)
    assert _same(_state(new), _state(old), ["body.weight", "body.bias"])
    assert _same(_state(new), before, ["head.weight", "head.bias"])


def test_large_tensors_read_from_mapped_files_keep_or_load_alike(tmp_path):
    big = 9 << 20  # (36 MiB of float32: the files a restore maps, not reads whole)
    torch.manual_seed(0)
    old = nn.ParameterDict({"a": nn.Parameter(torch.randn(big)),
                            "b": nn.Parameter(torch.randn(big))})
    src, _ = _saved(tmp_path, old)
    new = nn.ParameterDict({"a": nn.Parameter(torch.zeros(big)),
                            "b": nn.Parameter(torch.full((big,), 2.0))})
    unbroken.Checkpointer(str(tmp_path / "ft"), model=new).restore(
        intent="warm_start", source=src, fresh=["b"])
    assert torch.equal(new["a"], old["a"])
    assert torch.equal(new["b"], torch.full((big,), 2.0))


class _Compiled(nn.Module):
    """Names as torch.compile's wrapper gives them (``_orig_mod.``)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self._orig_mod = inner


def test_patterns_name_the_live_model_s_names_across_torch_compile_s_prefix(tmp_path):
    src, old = _saved(tmp_path, _Compiled(_base()))
    new = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 9))
    before = _state(new)
    unbroken.Checkpointer(str(tmp_path / "ft"), model=new).restore(
        intent="warm_start", source=src, fresh=["2.*"])
    saved = {k.removeprefix("_orig_mod."): v for k, v in _state(old).items()}
    assert _same(_state(new), saved, ["0.weight", "0.bias"])
    assert _same(_state(new), before, ["2.weight", "2.bias"])


def test_lazy_and_meta_tensors_kept_fresh_need_no_data_and_others_are_still_refused(tmp_path):
    src, old = _saved(tmp_path)
    lazy_head = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.LazyLinear(3))
    unbroken.Checkpointer(str(tmp_path / "a"), model=lazy_head).restore(
        intent="warm_start", source=src, fresh=["2.*"])
    assert torch.equal(lazy_head[0].weight, old[0].weight)
    assert isinstance(lazy_head[2].weight, nn.parameter.UninitializedParameter)
    with torch.device("meta"):
        meta_head = nn.Linear(4, 9)
    meta = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), meta_head)
    unbroken.Checkpointer(str(tmp_path / "b"), model=meta).restore(
        intent="warm_start", source=src, fresh=["2.*"])
    assert meta[2].weight.is_meta
    lazy_body = nn.Sequential(nn.LazyLinear(4), nn.ReLU(), nn.Linear(4, 7))
    with pytest.raises(StateMismatch, match=r"'0.weight' is uninitialized"):
        unbroken.Checkpointer(str(tmp_path / "c"), model=lazy_body).restore(
            intent="warm_start", source=src, fresh=["2.*"])


def test_a_compiled_save_into_an_uncompiled_model_that_dropped_a_layer(tmp_path):
    torch.manual_seed(0)
    src, old = _saved(tmp_path, _Compiled(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4),
                                                        nn.Linear(4, 2))))
    for i, pattern in enumerate(("2.*", "_orig_mod.2.*")):
        new = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        unbroken.Checkpointer(str(tmp_path / f"ft{i}"), model=new).restore(
            intent="warm_start", source=src, fresh=[pattern])
        saved = {k.removeprefix("_orig_mod."): v for k, v in _state(old).items()}
        assert _same(_state(new), saved, ["0.weight", "1.bias"])
    torch.manual_seed(3)
    live = _Compiled(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 6)))
    before = _state(live)
    plain_src, plain = _saved(tmp_path / "plain")
    unbroken.Checkpointer(str(tmp_path / "c"), model=live).restore(
        intent="warm_start", source=plain_src, fresh=["2.*"])  # (the served names)
    assert torch.equal(live._orig_mod[0].weight, plain[0].weight)
    assert _same(_state(live), before, ["_orig_mod.2.weight", "_orig_mod.2.bias"])


class _Meta(nn.Module):
    """Extra state set in place (cleared, then filled), as a vocabulary holder may do."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.meta = {"k": k, "vocab": list(range(k))}

    def get_extra_state(self) -> dict:
        return self.meta

    def set_extra_state(self, state: dict) -> None:
        self.meta.clear()
        self.meta.update(state)


class _WithMeta(nn.Module):
    def __init__(self, k: int) -> None:
        super().__init__()
        self.body = nn.Linear(2, 2)
        self.head = _Meta(k)


class _Scaled(nn.Module):
    """A module whose state_dict holds its weight scaled, and whose load hook unscales it
    (a round trip through both is not bitwise)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(n, 4))
        self._register_state_dict_hook(_Scaled._save)
        self.register_load_state_dict_pre_hook(_Scaled._load)

    @staticmethod
    def _save(module, state, prefix, local) -> None:  # noqa: ANN001 -- torch's hook
        state[prefix + "w"] = state[prefix + "w"] * 3.0

    @staticmethod
    def _load(module, state, prefix, *args) -> None:  # noqa: ANN001 -- torch's hook
        state[prefix + "w"] = state[prefix + "w"] / 3.0  # (it needs its key)


class _ScaledHead(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.head = _Scaled(n)


def test_a_model_that_loads_its_own_way_gets_its_kept_names_back_bitwise(tmp_path):
    src, old = _saved(tmp_path, _WithMeta(3))
    new = _WithMeta(7)
    unbroken.Checkpointer(str(tmp_path / "a"), model=new).restore(
        intent="warm_start", source=src, fresh=["head.*"])
    assert new.head.meta == {"k": 7, "vocab": list(range(7))}
    assert torch.equal(new.body.weight, old.body.weight)
    torch.manual_seed(0)
    scaled_src, scaled = _saved(tmp_path / "s", _ScaledHead(2))
    torch.manual_seed(1)
    live = _ScaledHead(5)
    before = live.head.w.detach().clone()
    unbroken.Checkpointer(str(tmp_path / "b"), model=live).restore(
        intent="warm_start", source=scaled_src, fresh=["head.*"])
    assert torch.equal(live.head.w.detach(), before)  # (bitwise: no round trip)
    assert torch.equal(live.body.weight, scaled.body.weight)


class _Viewing(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        view = self.body.weight.detach()[:2] if how == "slice" else self.body.weight.detach().t()
        self.register_buffer("w", view)


@pytest.mark.parametrize("how", ["slice", "transpose"])
def test_a_kept_view_of_a_loaded_weight_is_refused_before_anything_changes(tmp_path, how):
    src, _ = _saved(tmp_path, _Viewing(how))
    torch.manual_seed(7)
    live = _Viewing(how)
    before = _state(live)
    with pytest.raises(StateMismatch, match=r"fresh keeps 'w', whose memory .* 'body.weight'"):
        unbroken.Checkpointer(str(tmp_path / "a"), model=live).restore(
            intent="warm_start", source=src, fresh=["w"])
    assert _same(_state(live), before, list(before))


def test_a_name_holding_glob_characters_is_matched_literally_when_given_whole(tmp_path):
    def model() -> nn.Module:
        return nn.ModuleDict({"h[0]": nn.Linear(2, 2), "h0": nn.Linear(2, 2)})

    torch.manual_seed(0)
    src, old = _saved(tmp_path, model())
    torch.manual_seed(1)
    for i, fresh in enumerate((["h[0].weight", "h[0].bias"], ["h[[]0].*"])):
        live = model()
        before = _state(live)
        unbroken.Checkpointer(str(tmp_path / f"a{i}"), model=live).restore(
            intent="warm_start", source=src, fresh=fresh)
        assert _same(_state(live), before, ["h[0].weight", "h[0].bias"])
        assert _same(_state(live), _state(old), ["h0.weight", "h0.bias"])


def test_fresh_none_is_none_and_keeping_everything_is_said(tmp_path):
    src, old = _saved(tmp_path)
    live = _base()
    unbroken.Checkpointer(str(tmp_path / "a"), model=live).restore(
        intent="warm_start", source=src, fresh=None)
    assert _same(_state(live), _state(old), list(_state(old)))
    with pytest.raises(ValueError, match="a list of glob patterns"):
        unbroken.Checkpointer(str(tmp_path / "b"), model=_base()).restore(
            intent="warm_start", source=src, fresh=b"2.*")
    with pytest.warns(unbroken.UnbrokenWarning, match="loads no weight") as said:
        unbroken.Checkpointer(str(tmp_path / "c"), model=_base()).restore(
            intent="warm_start", source=src, fresh=["*"])
    assert said[0].filename == __file__


class _Normed(nn.Module):
    """spectral_norm: its load hook and torch's own load need every name it lists."""

    def __init__(self, out: int) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.head = nn.utils.spectral_norm(nn.Linear(4, out))


def test_spectral_norm_keeps_its_fresh_head_bitwise_and_loads_the_body(tmp_path):
    torch.manual_seed(0)
    src, old = _saved(tmp_path, _Normed(2))
    torch.manual_seed(1)
    live = _Normed(5)
    before = _state(live)
    unbroken.Checkpointer(str(tmp_path / "a"), model=live).restore(
        intent="warm_start", source=src, fresh=["head.*"])
    after = _state(live)
    assert _same(after, before, [k for k in before if k.startswith("head.")])
    assert _same(after, _state(old), ["body.weight", "body.bias"])


def test_the_wrapper_hint_and_raw_compiled_names_hold_with_fresh(tmp_path):
    src, _ = _saved(tmp_path)
    wrapped = nn.DataParallel(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 5)))
    with pytest.raises(StateMismatch, match="'module.' before each"):
        unbroken.Checkpointer(str(tmp_path / "a"), model=wrapped).restore(
            intent="warm_start", source=src, fresh=["module.2.*"])
    compiled_src, old = _saved(tmp_path / "c", _Compiled(_base()))
    new = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 9))
    before = _state(new)
    unbroken.Checkpointer(str(tmp_path / "b"), model=new).restore(
        intent="warm_start", source=compiled_src,
        fresh=["_orig_mod.2.weight", "_orig_mod.2.bias"])  # (the checkpoint's own names)
    assert _same(_state(new), before, ["2.weight", "2.bias"])
    assert torch.equal(new[0].weight, old._orig_mod[0].weight)


def test_suggested_patterns_write_a_bracket_as_a_glob_reads_it(tmp_path):
    def model(out: int) -> nn.Module:
        return nn.ModuleDict({"h[0]": nn.Linear(2, out), "h0": nn.Linear(2, 2)})

    src, _ = _saved(tmp_path, model(2))
    with pytest.raises(StateMismatch, match=re.escape("fresh=['h[[]0].*']")):
        unbroken.Checkpointer(str(tmp_path / "a"), model=model(3)).restore(
            intent="warm_start", source=src)
    live = model(3)
    unbroken.Checkpointer(str(tmp_path / "b"), model=live).restore(
        intent="warm_start", source=src, fresh=["h[[]0].*"])
