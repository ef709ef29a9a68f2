"""Trace digests of tensors in every form torch makes: a digest is of the values, so a lazy
view (conjugate, negative), a strided slice, a one-element tensor of any stride, a sparse, a
nested or a quantized tensor digests as the plain tensor holding the same values, and never
stops the loop with torch's own error. A resumed run's restored tensors are always plain: a
live view that digested otherwise made the trace comparison report a divergence that was not
there, and a negative view digested its memory, so values that differ digested equal."""

from __future__ import annotations

import warnings

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken.state._digest import digest_tree


def _quiet() -> warnings.catch_warnings:
    """Torch's prototype and deprecation warnings for these forms, silenced."""
    return warnings.catch_warnings(action="ignore")


_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
           torch.int8, torch.bool, torch.complex64, torch.complex128, torch.float8_e4m3fn]


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A fresh, plain, contiguous tensor holding ``t``'s values."""
    out = torch.empty(t.shape, dtype=t.dtype)
    out.copy_(t.resolve_conj().resolve_neg())
    return out


def _views(t: torch.Tensor) -> list[torch.Tensor]:
    """The forms a tensor of ``t``'s values may be met in."""
    out = [t, t.t() if t.dim() == 2 else t, t.unsqueeze(0).expand(2, *t.shape)]
    if t.dim() >= 1 and t.shape[-1] > 0:
        wide = torch.zeros((*t.shape[:-1], t.shape[-1] * 3), dtype=t.dtype)
        wide[..., ::3] = t
        out.append(wide[..., ::3])  # (stride 3: one element of it has stride 3 too)
    if t.is_complex():
        out += [t.conj(), t.conj().imag, t.conj().real, torch.neg(t.conj()).conj()]
    elif t.is_floating_point() and t.dtype != torch.float8_e4m3fn:
        z = torch.complex(torch.zeros(t.shape, dtype=torch.float32),
                          t.to(torch.float32)).conj()
        out.append(z.imag.to(t.dtype) if t.dtype != torch.float32 else z.imag)
    return out


@settings(max_examples=80, deadline=None)
@given(dtype=st.sampled_from(_DTYPES), shape=st.lists(st.integers(0, 3), max_size=3),
       seed=st.integers(0, 2**16))
def test_every_form_digests_as_the_plain_tensor_of_its_values(dtype, shape, seed):
    g = torch.Generator().manual_seed(seed)
    base = (torch.randn(shape, generator=g, dtype=torch.float64) * 4)
    t = base.to(dtype) if not dtype.is_complex else torch.complex(base, -base).to(dtype)
    for view in _views(t):
        assert digest_tree({"t": view}) == digest_tree({"t": _plain(view)}), (
            view.stride(), view.is_conj(), view.is_neg())


def test_a_negative_view_digests_its_values_not_its_memory():
    x = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    assert digest_tree(x.conj().imag) == digest_tree(torch.tensor([-2.0, 4.0]))
    assert digest_tree(x.conj().imag) != digest_tree(x.imag)  # (the same memory)
    assert digest_tree(x.conj()) != digest_tree(x)


def test_sparse_nested_quantized_and_meta_tensors_digest_by_their_values():
    dense = torch.tensor([[0.0, 1.5, 0.0], [2.0, 0.0, 0.0]])
    coo = dense.to_sparse()
    with _quiet():
        twice = torch.sparse_coo_tensor(torch.tensor([[0, 0, 1], [1, 1, 0]]),
                                        torch.tensor([1.0, 0.5, 2.0]), (2, 3))  # uncoalesced
        csr = dense.to_sparse_csr()
    assert digest_tree(coo) == digest_tree(twice) == digest_tree(csr)
    assert digest_tree(coo) != digest_tree((dense * 2).to_sparse())
    assert digest_tree(coo) != digest_tree(dense)  # (its form is part of what it is)
    with _quiet():
        nested = torch.nested.nested_tensor([torch.ones(2), torch.zeros(3)])
        other = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    assert digest_tree(nested) == digest_tree(nested.clone())
    assert digest_tree(nested) != digest_tree(other)
    with _quiet():
        q = torch.quantize_per_tensor(torch.tensor([0.5, 1.0]), 0.1, 2, torch.qint8)
        q2 = torch.quantize_per_tensor(torch.tensor([0.5, 1.0]), 0.05, 2, torch.qint8)
        qc = torch.quantize_per_channel(torch.ones(2, 2), torch.tensor([0.1, 0.2]),
                                        torch.tensor([0, 1]), 0, torch.qint8)
    assert digest_tree(q) != digest_tree(q2)  # (the same integers, another scale)
    assert digest_tree(qc) == digest_tree(qc.clone())
    with _quiet():
        jagged_meta = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)],
                                                 layout=torch.jagged).to("meta")
    assert digest_tree(jagged_meta) == digest_tree(jagged_meta)
    meta = torch.empty(3, device="meta")
    assert digest_tree(meta) == digest_tree(torch.empty(3, device="meta"))
    assert digest_tree(meta) != digest_tree(torch.empty(4, device="meta"))


def test_a_nested_tensor_digests_its_pieces_and_their_splits_in_any_layout():
    with _quiet():
        a = torch.nested.nested_tensor([torch.tensor([1.0, 2.0]), torch.tensor([3.0])])
        b = torch.nested.nested_tensor([torch.tensor([1.0]), torch.tensor([2.0, 3.0])])
        jagged = torch.nested.nested_tensor([torch.tensor([1.0, 2.0]), torch.tensor([3.0])],
                                            layout=torch.jagged)
        rows = torch.nested.nested_tensor([torch.ones(2, 3), torch.zeros(3, 3)])
        flipped = rows.transpose(1, 2)
        plain = torch.nested.nested_tensor([torch.ones(3, 2), torch.zeros(3, 3)])
    assert digest_tree(a) != digest_tree(b)  # (the same values, split otherwise)
    assert digest_tree(a) != digest_tree(torch.tensor([1.0, 2.0, 3.0]))
    assert digest_tree(a) == digest_tree(jagged)
    assert digest_tree({"batch": jagged}) == digest_tree({"batch": a})
    assert digest_tree(flipped) == digest_tree(plain)  # (a view digests as its values)


def test_a_sparse_form_torch_cannot_coalesce_is_a_type_error_naming_it():
    with _quiet():
        odd = torch.sparse_coo_tensor(torch.tensor([[0, 0]]), torch.tensor([1, 2]), (3,)
                                      ).to(torch.uint16)
    try:
        digest_tree(odd)
    except TypeError as e:
        assert "torch.sparse_coo" in str(e) and "torch.uint16" in str(e)
    else:  # (a torch that can coalesce it digests it)
        assert digest_tree(odd) == digest_tree(odd.coalesce())


def test_a_wrapper_subclass_without_data_is_a_type_error_not_a_recursion():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = torch.ones(3)
    try:
        digest_tree({"w": fake})
    except TypeError as e:
        assert "FakeTensor" in str(e)
    else:
        raise AssertionError("a FakeTensor has no values to digest")
