"""`jsontext.json_pieces`: a state document in pieces, each planned text a piece of its own,
joins to exactly the bytes `dumps_json` writes for it, whatever the document and texts hold
(property-based: nested values, texts in any place, a text whose holder is absent, strings
UTF-8 cannot encode)."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from unbroken.state.jsontext import dumps_json, json_pieces

_TEXT = st.text(st.characters(codec="utf-8") | st.sampled_from(["\ud800", "\udfff", '"', "\\"]),
                max_size=8)
_LEAF = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False,
                                                            allow_infinity=False) | _TEXT
_TREE = st.recursive(_LEAF, lambda kids: st.lists(kids, max_size=4)
                     | st.dictionaries(_TEXT, kids, max_size=4), max_leaves=20)


@given(st.data())
def test_pieces_join_to_the_bytes_of_dumps_json(data: st.DataObject) -> None:
    holders = [f"holder.{i}" for i in range(data.draw(st.integers(0, 4)))]
    texts = {h: json.dumps(data.draw(_TREE), separators=(",", ":"), ensure_ascii=False)
             for h in holders}
    placed = [h for h in holders if data.draw(st.booleans())]  # (some held nowhere)
    doc = data.draw(_TREE)
    doc = {"parts": [doc, *placed], "more": {h: h for h in placed[:1]}}
    pieces = json_pieces(doc, texts)
    assert b"".join(pieces) == dumps_json(doc, sort_keys=False, texts=texts)
    if len(pieces) > 1:  # (not the ASCII fallback: each placed text is a piece of its own)
        assert len(pieces) == 2 * len([h for h in texts if f'"{h}"' in json.dumps(
            doc, ensure_ascii=False)]) + 1


def test_a_document_without_texts_is_one_piece() -> None:
    assert json_pieces({"a": [1, "é"]}, {}) == [dumps_json({"a": [1, "é"]}, sort_keys=False)]
