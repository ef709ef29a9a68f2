"""Trace records and digests: layout-independent, robust to torn writes."""

from __future__ import annotations

import torch

from unbroken.state._digest import digest_optimizer, digest_tree
from unbroken.trace import Tracer, read_trace


def test_digest_depends_on_values_not_memory_layout():
    a = torch.randn(2, 3, 4, 5)
    b = a.contiguous(memory_format=torch.channels_last)
    assert digest_tree({"w": a}) == digest_tree({"w": b})
    assert digest_tree(a.t() if a.dim() == 2 else a[:, :, ::2]) == digest_tree(
        a[:, :, ::2].contiguous())
    assert digest_tree(a) != digest_tree(a + 1e-7)
    assert digest_tree(torch.Size([2, 3])) == digest_tree((2, 3))


def test_optimizer_digest_is_layout_independent_and_sees_a_reset():
    def opt_with(weight):
        p = torch.nn.Parameter(weight)
        o = torch.optim.SGD([p], lr=0.1, momentum=0.9)
        p.grad = torch.ones_like(p)
        o.step()
        return o
    w = torch.randn(2, 3, 4, 5)
    plain, strided = opt_with(w.clone()), opt_with(
        w.clone().contiguous(memory_format=torch.channels_last))
    assert digest_optimizer(plain) == digest_optimizer(strided)
    fresh = torch.optim.SGD([torch.nn.Parameter(w.clone())], lr=0.1, momentum=0.9)
    assert digest_optimizer(fresh, moments=False) != digest_optimizer(plain, moments=False)


def test_a_torn_line_then_a_new_process_appending(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text('{"event":"update","step":1}\n{"event":"update","st')  # killed mid-write
    t = Tracer(path)
    t.write({"event": "restore", "step": 1})
    t.write({"event": "update", "step": 2})
    t.close()
    assert [(r["event"], r["step"]) for r in read_trace(path)] == [
        ("update", 1), ("restore", 1), ("update", 2)]
