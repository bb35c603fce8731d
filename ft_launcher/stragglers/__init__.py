"""Stragglers: the detector, the exchange of section medians between nodes, the rank_slow
throttle."""
