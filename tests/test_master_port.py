"""One node: the workers' master port is picked anew for every cycle (unless given)."""

from __future__ import annotations

import socket

from ft_launcher.nodes.rendezvous import StaticRendezvous, free_port


def _hold(port: int) -> socket.socket:
    """What a cycle's store may leave on its port: a socket still bound there."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


def test_each_round_gets_a_port_other_than_the_last_ones_still_bound():
    rdzv = StaticRendezvous(node_rank=0, nnodes=1, master_addr="127.0.0.1", master_port=None)
    held = []
    try:
        ports = []
        for _ in range(20):
            rnd = rdzv.next_round()
            assert (rnd.group_rank, rnd.group_world_size, rnd.master_addr) == \
                (0, 1, "127.0.0.1")
            ports.append(rnd.master_port)
            held.append(_hold(rnd.master_port))  # the kernel cannot hand it out again
        assert len(set(ports)) == 20, ports
    finally:
        for s in held:
            s.close()


def test_a_given_master_port_is_kept_for_every_round():
    port = free_port()
    rdzv = StaticRendezvous(node_rank=0, nnodes=1, master_addr="127.0.0.1", master_port=port)
    assert [rdzv.next_round().master_port for _ in range(3)] == [port] * 3
