"""Snapshots of an app state: ``snapshot_stateful`` and ``restore_stateful``.

An app state is a dict of named objects that each have ``state_dict()`` and
``load_state_dict(state)``: what ``torch.distributed.checkpoint`` calls ``Stateful``, and
how torchtitan keeps its model, optimizers, LR schedulers and training counters. Modules,
optimizers and LR schedulers have that shape already; ``RNGState`` gives it to the random
number generators::

    app_state = {"model": model, "optimizer": opt, "lr_scheduler": sched, "rng": RNGState()}
    start = ft_agent.restore_stateful(app_state) or load_disk_checkpoint(app_state)
    for step in range(start + 1, steps + 1):
        train_one_step()
        ft_agent.snapshot_stateful(app_state, step)

Both go through ``RankMonitorClient.snapshot`` and ``restore`` (docs/snapshots.md): the
launcher decides how often a snapshot is taken, and which step a restarted world resumes
from. This module imports torch only when an ``RNGState`` is read or loaded.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from ft_agent.client import RankMonitorClient, get_client

__all__ = ["RNGState", "Stateful", "StatefulList", "restore_stateful", "snapshot_stateful"]


@runtime_checkable
class Stateful(Protocol):
    """torch.distributed.checkpoint's ``Stateful``: an object whose state can be read and
    put back."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class RNGState:
    """The process's random number generators as one ``Stateful``: Python's ``random``,
    numpy's global generator, torch's CPU generator and, once the process has initialised
    CUDA, the current CUDA device's (a training that never touched CUDA gets no CUDA
    context from this)."""

    def state_dict(self) -> dict[str, Any]:
        import numpy as np  # noqa: PLC0415 - a dependency, imported by torch anyway
        import torch  # noqa: PLC0415

        state = {"python": random.getstate(), "numpy": np.random.get_state(),
                 "torch": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        import numpy as np  # noqa: PLC0415
        import torch  # noqa: PLC0415

        random.setstate(state_dict["python"])
        np.random.set_state(state_dict["numpy"])
        torch.set_rng_state(state_dict["torch"])
        if state_dict.get("cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(state_dict["cuda"])


class StatefulList:
    """Several ``Stateful`` objects of one kind (a list of optimizers) as one: its state is
    the list of theirs, loaded back in the same order."""

    def __init__(self, items: Sequence[Any]) -> None:
        self.items = list(items)

    def state_dict(self) -> dict[str, Any]:
        return {"items": [item.state_dict() for item in self.items]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        states = state_dict["items"]
        if len(states) != len(self.items):
            raise ValueError(f"a snapshot of {len(states)} objects cannot be loaded into "
                             f"{len(self.items)}")
        for item, state in zip(self.items, states, strict=True):
            item.load_state_dict(state)


def _client(client: Any) -> Any:
    """``client``, or the process-wide one, connected to the launcher on first use (outside
    the launcher this warns once, and every call after is a no-op)."""
    if client is not None:
        return client
    client = get_client()
    client.init_workload_monitoring()
    return client


def _check(app_state: Mapping[str, Any]) -> None:
    if not isinstance(app_state, Mapping):
        raise TypeError(f"app_state: expected a dict of Stateful objects, got "
                        f"{type(app_state).__name__}")
    for name, obj in app_state.items():
        if not isinstance(name, str):
            raise TypeError(f"app_state: key {name!r} is not a str")
        if not isinstance(obj, Stateful):
            raise TypeError(f"app_state[{name!r}]: {type(obj).__name__} has no state_dict() "
                            "and load_state_dict()")


def snapshot_stateful(app_state: Mapping[str, Any], step: int,
                      client: RankMonitorClient | None = None) -> Any:
    """Offer ``{name: obj.state_dict()}`` of ``app_state`` as the snapshot of ``step``.

    Call it after every step: the frequency the ranks agree on through the launcher (or
    its ``--ft-snapshot-every``) decides which calls take one. Returns
    ``client.snapshot``'s status (None when none was taken). ``client``: default, the
    process-wide ``ft_agent.get_client()``, connected if it is not.
    """
    _check(app_state)
    state = {name: obj.state_dict() for name, obj in app_state.items()}
    return _client(client).snapshot(state, int(step))


def restore_stateful(app_state: Mapping[str, Any], newer_than: int | None = None,
                     client: RankMonitorClient | None = None) -> int | None:
    """Load the snapshot the launcher chose for this restart into ``app_state``'s objects
    (each through ``load_state_dict``, in the dict's order) and return its step; None, with
    nothing loaded, in the first cycle, without a snapshot, outside the launcher, or when
    the snapshot's step is not newer than ``newer_than`` (a disk checkpoint loaded already).

    Call it once per process, before training. Raises ``ValueError`` naming an object of
    ``app_state`` the snapshot does not hold (the app state changed shape), and
    ``SnapshotError`` when the chosen copy fails its checks (see ``RankMonitorClient.restore``).
    """
    _check(app_state)
    restored = _client(client).restore(newer_than)
    if restored is None:
        return None
    state, step = restored
    if not isinstance(state, Mapping):
        raise ValueError(f"the snapshot of step {step} is not a dict of states")
    missing = [name for name in app_state if name not in state]
    if missing:
        raise ValueError(f"the snapshot of step {step} holds no state for {missing[0]!r} "
                         f"(it holds {sorted(map(str, state))})")
    for name, obj in app_state.items():
        obj.load_state_dict(state[name])
    return step
