"""The load-id format has one owner: what it builds reads back exactly, any string reads without raising (the
logs' ids come from disk), and the Consumer names its loads through it."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvlifecycle.transfer_ids import RANKS_SEPARATOR, load_id, refused_load_id, source_transfers

transfer = st.text(min_size=1).filter(lambda t: "<-" not in t and "+" not in t)


@given(st.text())
def test_any_string_reads_as_a_load_id(text: str) -> None:
    parts = source_transfers(text)
    assert parts == [text] or (all(parts) and text.endswith(RANKS_SEPARATOR + "+".join(parts)))


@given(st.text(), st.lists(transfer, min_size=1, max_size=8))
def test_a_built_id_reads_back_its_transfers_in_part_order(request: str, transfers: list[str]) -> None:
    assert source_transfers(load_id(request, transfers)) == transfers


@given(st.text(), transfer)
def test_a_load_of_one_transfer_is_named_after_it(request: str, one: str) -> None:
    assert load_id(request, [one]) == one


@pytest.mark.parametrize("transfers", [[], ["a<-b"], ["a+b", "c"], ["", "c"]])
def test_transfer_ids_that_would_not_read_back_are_refused(transfers: list[str]) -> None:
    with pytest.raises(ValueError):
        load_id("r", transfers)


def test_the_documented_examples() -> None:
    assert load_id("req", ["p0.1", "p1.1"]) == "req<-p0.1+p1.1"
    assert source_transfers("a<-b<-p0.1+p1.1") == ["p0.1", "p1.1"]  # a request holding the separator
    assert source_transfers("req<-") == ["req<-"] and source_transfers("req<-a++b") == ["req<-a++b"]
    assert refused_load_id("p0.7") == "p0.7/refused-by-d"
