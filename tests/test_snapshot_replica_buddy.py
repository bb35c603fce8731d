"""Buddy choice for snapshot replicas: never the node itself, k distinct nodes, stable for
an ordering, and any single lost node leaves every node's data on a survivor (hypothesis)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ft_launcher.snapshots.buddy import buddies, held_by, surviving_copies

node_lists = st.lists(st.text(min_size=1, max_size=6), min_size=0, max_size=40, unique=True)


def test_ring_of_four_with_one_and_two_replicas():
    nodes = ["n0", "n1", "n2", "n3"]
    assert buddies(nodes) == {"n0": ("n1",), "n1": ("n2",), "n2": ("n3",), "n3": ("n0",)}
    assert buddies(nodes, 2)["n3"] == ("n0", "n1")
    assert held_by(nodes, 1) == {"n0": ("n3",), "n1": ("n0",), "n2": ("n1",), "n3": ("n2",)}


def test_one_node_has_no_buddy_and_k_is_capped():
    assert buddies(["only"], 3) == {"only": ()}
    assert buddies([], 1) == {}
    assert buddies(["a", "b"], 5) == {"a": ("b",), "b": ("a",)}
    assert buddies(["a", "b", "c"], 0) == {"a": (), "b": (), "c": ()}


def test_bad_input_is_refused():
    with pytest.raises(ValueError):
        buddies(["a", "b"], -1)
    with pytest.raises(ValueError):
        buddies(["a", "b", "a"], 1)


@given(node_lists, st.integers(0, 8))
def test_never_itself_k_distinct_and_stable(nodes, k):
    chosen = buddies(nodes, k)
    assert list(chosen) == nodes
    for node, targets in chosen.items():
        assert node not in targets
        assert len(set(targets)) == len(targets) == min(k, len(nodes) - 1)
        assert set(targets) <= set(nodes)
    assert buddies(list(nodes), k) == chosen  # same ordering, same answer


@given(node_lists, st.integers(0, 8))
def test_load_is_even(nodes, k):
    # every node holds exactly as many nodes' replicas as it sends out
    held = held_by(nodes, k)
    for node in nodes:
        assert len(held[node]) == min(k, len(nodes) - 1)


@given(node_lists.filter(lambda n: len(n) >= 2), st.integers(1, 8), st.data())
def test_any_single_lost_node_leaves_every_nodes_data_on_a_survivor(nodes, k, data):
    lost = data.draw(st.sampled_from(nodes))
    copies = surviving_copies(nodes, k, {lost})
    for node, holders in copies.items():
        assert holders, f"{node}'s data is gone with {lost}"
        assert lost not in holders


@given(node_lists.filter(lambda n: len(n) >= 2), st.integers(1, 8), st.data())
def test_up_to_k_lost_nodes_leave_a_copy(nodes, k, data):
    width = min(k, len(nodes) - 1)
    lost = set(data.draw(st.lists(st.sampled_from(nodes), max_size=width, unique=True)))
    assert all(surviving_copies(nodes, k, lost).values())
