"""PyTorch Lightning integration: ``FaultToleranceCallback`` and ``SimulatedFaultParams``.

Names and arguments match NVRx's PTL callback, so code ports by changing an import::

    from ft_agent.lightning import FaultToleranceCallback
    trainer = Trainer(callbacks=[FaultToleranceCallback(autoresume=True,
                                                        calculate_timeouts=True)])

The callback is active in the ``fit`` stage. Under ``ft_launcher`` it sends heartbeats during
training, validation and around checkpoint saves, calculates heartbeat timeouts at the end of
training and persists them for the next job, reports an exception before the rank dies, and
can simulate a dead or hung rank. With ``autoresume=True``, rank 0 creates the file named by
``FAULT_TOL_FINISHED_FLAG_FILE`` once training is complete, so a job-resubmitting wrapper
knows to stop. Outside ``ft_launcher`` the heartbeat calls are no-ops (after one warning) and
only the finished flag is written.

Lightning is an optional dependency (the ``[lightning]`` extra); ``import ft_agent`` never
imports it, only ``import ft_agent.lightning`` does.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

# Prefer the unified ``lightning`` package and fall back to the older ``pytorch_lightning``.
# find_spec decides which one is installed, so that a broken ``lightning`` install shows its
# own import error instead of a misleading "not installed".
if importlib.util.find_spec("lightning") is not None:
    from lightning.pytorch import Callback, LightningModule, Trainer
elif importlib.util.find_spec("pytorch_lightning") is not None:
    from pytorch_lightning import Callback, LightningModule, Trainer
else:
    raise ImportError(
        "ft_agent.lightning needs PyTorch Lightning, which is not installed: "
        "pip install 'ft-launcher[lightning]' (or install lightning / pytorch_lightning)"
    )

from ft_agent import simulated_fault
from ft_agent.client import REPORT_FLUSH_S, RankMonitorClient, get_client
from ft_agent.stateful import StatefulList, restore_stateful, snapshot_stateful

__all__ = [
    "FINISHED_FLAG_ENV",
    "FaultToleranceCallback",
    "PlannedFault",
    "SimulatedFaultParams",
    "plan_fault",
    "training_completed",
]

FINISHED_FLAG_ENV = "FAULT_TOL_FINISHED_FLAG_FILE"
FT_DIR_NAME = "ft_state"
TIMEOUTS_FILE_NAME = "ft_timeouts.json"
FAULT_TYPES = ("random", "rank_killed", "rank_hung")
# Timeouts calculated from fewer training iterations than this would rest on the start-up
# intervals alone; such a run is not used.
MIN_ITERS_FOR_TIMEOUTS = 2


# -- simulated faults ------------------------------------------------------------------------


@dataclass
class SimulatedFaultParams:
    """A simulated fault in one rank, for proving that a job survives it.

    ``fault_type``: ``rank_killed`` (the rank SIGKILLs itself), ``rank_hung`` (it SIGSTOPs
    itself, so only hang detection recovers it) or ``random`` (one of the two). The fault
    fires ``base_delay + U(0, rand_delay)`` seconds after training starts, in the rank
    ``rank_to_fail`` (default: a rank drawn from the run id and the restart cycle, the same on
    every rank). It is armed in the first cycle only, so a recovered job can finish, unless
    ``rearm_in_every_cycle`` is set (NVRx's behavior: every restarted process fails again).
    """

    fault_type: str
    base_delay: float
    rand_delay: float = 0.0
    rank_to_fail: int | None = None
    rearm_in_every_cycle: bool = False

    def __post_init__(self) -> None:
        if self.fault_type not in FAULT_TYPES:
            raise ValueError(
                f"SimulatedFaultParams.fault_type: {self.fault_type!r} is not one of "
                f"{', '.join(FAULT_TYPES)}"
            )
        for name in ("base_delay", "rand_delay"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value) or value < 0:
                raise ValueError(
                    f"SimulatedFaultParams.{name}: expected seconds >= 0, got {value!r}"
                )
            setattr(self, name, float(value))
        rank = self.rank_to_fail
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 0):
            raise ValueError(
                f"SimulatedFaultParams.rank_to_fail: expected a rank >= 0 or None, got {rank!r}"
            )

    @classmethod
    def coerce(cls, value: Any) -> SimulatedFaultParams | None:
        """Accept None, an instance, or a mapping (dict, OmegaConf DictConfig) of its fields."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, Mapping) and not hasattr(value, "keys"):
            raise ValueError(
                "simulated_fault_params: expected SimulatedFaultParams or a mapping of its "
                f"fields, got {type(value).__name__}"
            )
        items = {str(k): value[k] for k in value.keys()}
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(items) - known)
        if unknown:
            raise ValueError(
                f"simulated_fault_params: unknown field {unknown[0]!r}; expected "
                f"{', '.join(f.name for f in fields(cls))}"
            )
        missing = [n for n in ("fault_type", "base_delay") if n not in items]
        if missing:
            raise ValueError(f"simulated_fault_params: missing field {missing[0]!r}")
        return cls(**items)


@dataclass
class PlannedFault:
    """The fault of one cycle: which type, in which rank, how long after training starts."""

    fault_type: str  # resolved: never "random"
    rank: int
    delay: float


def plan_fault(
    params: SimulatedFaultParams, world_size: int, run_id: str, cycle: int
) -> PlannedFault | None:
    """The fault for this cycle, or None when it is not armed in this cycle.

    Every rank calls this with the same arguments and gets the same answer. The victim is
    derived, not broadcast: NVRx broadcasts a CUDA tensor (so it needs a GPU and an
    initialised process group, and a collective at setup that can itself hang); a seeded
    draw over values every rank already has (the launcher's run id and restart cycle) needs
    neither, works before the process group exists, and cannot deadlock.
    """
    if cycle > 0 and not params.rearm_in_every_cycle:
        return None
    if params.rank_to_fail is not None and params.rank_to_fail >= world_size:
        raise ValueError(
            f"SimulatedFaultParams.rank_to_fail: rank {params.rank_to_fail} does not exist "
            f"in a world of {world_size} ranks"
        )
    fault = simulated_fault.draw(f"ft_agent.lightning:{run_id}", cycle, world_size,
                                 params.fault_type, params.base_delay, params.rand_delay,
                                 params.rank_to_fail)
    fault_type, rank, delay = fault.fault_type, fault.rank, fault.delay
    return PlannedFault(fault_type, rank, delay)


# -- training state --------------------------------------------------------------------------


def training_completed(trainer: Trainer) -> bool:
    """True when the fit loop reached ``max_steps`` or ``max_epochs``.

    A run stopped early (``max_time``, an early-stopping callback, a fault) is not complete:
    the job has to be resumed.
    """
    max_steps = trainer.max_steps
    if isinstance(max_steps, int) and max_steps > 0 and trainer.global_step >= max_steps:
        return True
    max_epochs = trainer.max_epochs
    return isinstance(max_epochs, int) and max_epochs > 0 and trainer.current_epoch >= max_epochs


def fit_app_state(trainer: Trainer, pl_module: LightningModule) -> dict[str, Any]:
    """What a snapshot of ``fit`` holds, as an app state for ``ft_agent.stateful``."""
    return {"model": pl_module, "optimizers": StatefulList(trainer.optimizers)}


def snapshot_fit_state(client: Any, trainer: Trainer, pl_module: LightningModule,
                       every: int | None) -> Any:
    """Every ``every`` steps, offer the module's and optimizers' state to
    ``client.snapshot`` (the launcher's ``--ft-snapshot-every`` decides whether it is
    taken); its status, or None."""
    if not every or trainer.global_step % every:
        return None
    return snapshot_stateful(fit_app_state(trainer, pl_module), trainer.global_step,
                             client=client)


def restore_fit_state(client: Any, trainer: Trainer, pl_module: LightningModule) -> int | None:
    """Load the snapshot the launcher chose for this cycle into the module and optimizers
    and move the step counter there, when it is newer than where ``fit`` starts (a disk
    checkpoint already loaded); the step restored, or None."""
    step = restore_stateful(fit_app_state(trainer, pl_module), newer_than=trainer.global_step,
                            client=client)
    if step is None:
        return None
    loop = trainer.fit_loop.epoch_loop
    # global_step counts optimizer steps: set where Lightning keeps them.
    if pl_module.automatic_optimization:
        loop.automatic_optimization.optim_progress.optimizer.step.total.completed = step
    else:
        loop.manual_optimization.optim_step_progress.total.completed = step
    return step


def _cycle() -> int:
    try:
        return int(os.environ.get("FT_CYCLE") or os.environ.get("TORCHELASTIC_RESTART_COUNT")
                   or 0)
    except ValueError:
        return 0


# -- the callback ----------------------------------------------------------------------------


class FaultToleranceCallback(Callback):
    """Heartbeats, calculated timeouts, the finished flag and simulated faults for ``fit``.

    Args:
        autoresume: create the file named by ``FAULT_TOL_FINISHED_FLAG_FILE`` (rank 0) when
            training is complete (``max_steps`` or ``max_epochs`` reached), so a wrapper that
            resubmits the job stops. A run that ends early does not create it.
        calculate_timeouts: at the end of training, have the launcher calculate heartbeat
            timeouts from the intervals this run showed, and save them to
            ``<exp_dir>/ft_state/ft_timeouts.json``; every later start (a restarted cycle or
            the next job) loads them, so they are in force from the end of the first run.
        simulated_fault_params: a ``SimulatedFaultParams`` or a mapping of its fields.
        exp_dir: directory under which ``ft_state/`` lives; default ``trainer.log_dir``.
            Must be the same for every job of a training (a logger that adds a new
            ``version_N`` directory per job changes ``trainer.log_dir``).
        logger_name: the ``logging`` logger this callback writes to.
        snapshot_every_n_steps: offer model and optimizer state to the launcher's in-memory
            snapshots every N steps, and resume from them at fit start (docs/snapshots.md).
    """

    def __init__(
        self,
        autoresume: bool,
        calculate_timeouts: bool,
        simulated_fault_params: SimulatedFaultParams | Mapping[str, Any] | None = None,
        exp_dir: str | os.PathLike[str] | None = None,
        logger_name: str = "nemo_logger.FaultToleranceCallback",
        snapshot_every_n_steps: int | None = None,
    ) -> None:
        super().__init__()
        self.autoresume = bool(autoresume)
        self.calculate_timeouts = bool(calculate_timeouts)
        self.simulated_fault_params = SimulatedFaultParams.coerce(simulated_fault_params)
        self.exp_dir = Path(exp_dir) if exp_dir is not None else None
        self.logger = logging.getLogger(logger_name)
        self.client: RankMonitorClient | None = None
        self.timeouts_path: Path | None = None
        self._active = False
        self._train_iters = 0
        self._failed = False
        self._timeouts_done = False
        self._fault_armed = False
        self._cancel_fault = threading.Event()
        self._original_save: Callable[..., Any] | None = None
        self.snapshot_every_n_steps = snapshot_every_n_steps

    # -- properties ------------------------------------------------------------------------

    @property
    def is_initialized(self) -> bool:
        """True while connected to an ``ft_launcher`` monitor (between setup and teardown)."""
        return self._active and self.client is not None and self.client.is_initialized

    # -- Lightning hooks -------------------------------------------------------------------

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Connect to the launcher, load persisted timeouts, and heartbeat (``fit`` only)."""
        if stage != "fit" or self._active:
            return
        self._active = True
        self._train_iters = 0
        self._failed = False
        self._timeouts_done = False
        self._fault_armed = False
        self._cancel_fault.clear()
        self.client = get_client()
        self.client.init_workload_monitoring()
        if self.autoresume and not os.environ.get(FINISHED_FLAG_ENV):
            self._info(trainer, f"autoresume: {FINISHED_FLAG_ENV} is not set, so no finished "
                       "flag will be written", level=logging.WARNING)
        if not self.client.is_initialized:
            return  # not under ft_launcher: only the finished flag is left to do
        if self.calculate_timeouts:
            ft_dir = Path(self.exp_dir or trainer.log_dir or trainer.default_root_dir)
            self.timeouts_path = ft_dir / FT_DIR_NAME / TIMEOUTS_FILE_NAME
            # Each node's launcher has its own monitor: its local rank 0 sets the timeouts.
            if trainer.local_rank == 0:
                self._load_timeouts(trainer)
        self._wrap_save_checkpoint(trainer)
        self._heartbeat()

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Write the finished flag when training is complete, then say goodbye."""
        if stage != "fit" or not self._active:
            return
        self._active = False
        self._cancel_fault.set()
        self._unwrap_save_checkpoint(trainer)
        if self.autoresume and trainer.global_rank == 0 and not self._failed:
            if training_completed(trainer):
                self._create_finished_flag(trainer)
            else:
                self._info(trainer, f"training not complete at step {trainer.global_step}; "
                           "no finished flag")
        if self.client is not None and self.client.is_initialized:
            self.client.send_heartbeat()
            self.client.shutdown_workload_monitoring()

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Heartbeat, resume from a snapshot, and start the simulated fault's clock."""
        if self.snapshot_every_n_steps and self.client is not None:
            restore_fit_state(self.client, trainer, pl_module)
        self._heartbeat()
        if self.is_initialized and self.simulated_fault_params and not self._fault_armed:
            self._fault_armed = True
            self._arm_fault(trainer)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Heartbeat; a fault not fired yet stays unfired; calculate and save timeouts."""
        self._heartbeat()
        self._cancel_fault.set()
        self._maybe_calculate_timeouts(trainer)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        """Heartbeat and progress (the launcher's goodput ledger) after every training step."""
        self._train_iters += 1
        if self._active and self.client is not None:
            self.client.report_progress(trainer.global_step)  # implies a heartbeat
            snapshot_fit_state(self.client, trainer, pl_module, self.snapshot_every_n_steps)
        self._heartbeat()

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Heartbeat (validation inside fit, sanity check included)."""
        self._heartbeat()

    def on_validation_batch_end(self, trainer: Trainer, pl_module: LightningModule,
                                outputs: Any, batch: Any, batch_idx: int,
                                dataloader_idx: int = 0) -> None:
        """Heartbeat after every validation step."""
        self._heartbeat()

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Heartbeat."""
        self._heartbeat()

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        """Heartbeat as the checkpoint is assembled (the write is bracketed separately)."""
        self._heartbeat()

    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        """Heartbeat: restoring a large checkpoint can take long."""
        self._heartbeat()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule,
                     exception: BaseException) -> None:
        """Report the exception to the launcher before the rank dies."""
        graceful = isinstance(exception, SystemExit) and not exception.code
        self._failed = self._failed or not graceful
        self._cancel_fault.set()
        if not self.is_initialized or self.client is None:
            return
        text = "".join(traceback.format_exception(type(exception), exception,
                                                  exception.__traceback__))
        self.client.send_report("exception", f"{type(exception).__name__}: {exception}\n{text}")
        self.client.send_heartbeat()
        self._info(trainer, f"reported {type(exception).__name__} to the launcher",
                   all_ranks=True, level=logging.WARNING)

    # -- heartbeats ------------------------------------------------------------------------

    def _heartbeat(self) -> None:
        if self._active and self.client is not None:
            self.client.send_heartbeat()  # a few µs, never blocks: no throttling needed

    def _wrap_save_checkpoint(self, trainer: Trainer) -> None:
        # Lightning has no callback hook after a checkpoint is written. A heartbeat right
        # before and right after the write makes the save its own interval: the calculated
        # timeout then covers the longest save seen, and a save is never added on top of
        # a training step's interval.
        original = trainer.save_checkpoint

        def save_checkpoint(*args: Any, **kwargs: Any) -> Any:
            self._heartbeat()
            try:
                result = original(*args, **kwargs)
            finally:
                self._heartbeat()
            if self._active and self.client is not None:  # written: the ledger's restart point
                self.client.report_checkpoint(trainer.global_step)
            return result

        self._original_save = original
        trainer.save_checkpoint = save_checkpoint  # type: ignore[method-assign]

    def _unwrap_save_checkpoint(self, trainer: Trainer) -> None:
        if self._original_save is not None:
            trainer.__dict__.pop("save_checkpoint", None)
            self._original_save = None

    # -- timeouts --------------------------------------------------------------------------

    def _load_timeouts(self, trainer: Trainer) -> None:
        assert self.client is not None and self.timeouts_path is not None
        path = self.timeouts_path
        try:
            state = json.loads(path.read_text())
        except FileNotFoundError:
            self._info(trainer, f"no calculated timeouts in {path} yet")
            return
        except (OSError, ValueError) as exc:
            self._info(trainer, f"ignoring unreadable timeouts file {path}: {exc}",
                       level=logging.WARNING)
            return
        try:
            self.client.load_state_dict(state)
        except ValueError as exc:
            self._info(trainer, f"ignoring timeouts file {path}: {exc}", level=logging.WARNING)
            return
        self._info(trainer, f"loaded timeouts from {path}: {self.client.timeouts}")

    def _maybe_calculate_timeouts(self, trainer: Trainer) -> None:
        if not (self.calculate_timeouts and self.is_initialized) or self._timeouts_done:
            return
        self._timeouts_done = True
        if self._failed or self._train_iters < MIN_ITERS_FOR_TIMEOUTS:
            self._info(trainer, f"timeouts not calculated: {self._train_iters} training "
                       "iterations in this run")
            return
        if trainer.local_rank != 0:
            return  # the node's monitor sees every local rank's intervals: one request
        assert self.client is not None and self.timeouts_path is not None
        if not self.client.calculate_and_set_hb_timeouts(skip_if_not_ready=True):
            self._info(trainer, "the launcher did not calculate timeouts",
                       level=logging.WARNING)
            return
        self._info(trainer, f"calculated timeouts: {self.client.timeouts}")
        if trainer.global_rank == 0:
            self._save_timeouts(trainer)

    def _save_timeouts(self, trainer: Trainer) -> None:
        assert self.client is not None and self.timeouts_path is not None
        path = self.timeouts_path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(self.client.state_dict(), indent=2, sort_keys=True) + "\n")
            os.replace(tmp, path)  # the next job never reads half a file
        except OSError as exc:
            self._info(trainer, f"cannot save timeouts to {path}: {exc}", level=logging.WARNING)
            return
        self._info(trainer, f"saved timeouts to {path}")

    # -- finished flag ---------------------------------------------------------------------

    def _create_finished_flag(self, trainer: Trainer) -> None:
        flag = os.environ.get(FINISHED_FLAG_ENV)
        if not flag:
            return
        try:
            Path(flag).parent.mkdir(parents=True, exist_ok=True)
            Path(flag).touch()
        except OSError as exc:
            self._info(trainer, f"cannot create the finished flag {flag}: {exc}",
                       level=logging.ERROR)
            return
        self._info(trainer, f"training complete at step {trainer.global_step}; created {flag}")

    # -- simulated fault -------------------------------------------------------------------

    def _arm_fault(self, trainer: Trainer) -> None:
        assert self.simulated_fault_params is not None
        run_id = os.environ.get("TORCHELASTIC_RUN_ID") or "ft_agent"
        planned = plan_fault(self.simulated_fault_params, trainer.world_size, run_id, _cycle())
        if planned is None:
            self._info(trainer, f"simulated fault not armed in cycle {_cycle()}")
            return
        self._info(trainer, f"simulated fault armed: {planned.fault_type} in rank "
                   f"{planned.rank} {planned.delay:.3f} s after training started")
        if planned.rank != trainer.global_rank:
            return
        thread = threading.Thread(target=self._deliver_fault, args=(planned, trainer.global_rank),
                                  name="ft-simulated-fault", daemon=True)
        thread.start()

    def _deliver_fault(self, planned: PlannedFault, rank: int) -> None:
        if self._cancel_fault.wait(planned.delay):
            return  # training ended first
        at = time.time()
        self.logger.warning("simulated fault: %s in rank %d now", planned.fault_type, rank)
        if self.client is not None:
            self.client.send_report("simulated_fault", json.dumps(
                {"fault_type": planned.fault_type, "rank": rank, "at": round(at, 6),
                 "cycle": _cycle()}))
            time.sleep(REPORT_FLUSH_S)
        signum = signal.SIGKILL if planned.fault_type == "rank_killed" else signal.SIGSTOP
        os.kill(os.getpid(), signum)

    # -- logging ---------------------------------------------------------------------------

    def _info(self, trainer: Trainer, message: str, all_ranks: bool = False,
              level: int = logging.INFO) -> None:
        if all_ranks or trainer.global_rank == 0:
            self.logger.log(level, "[FaultToleranceCallback rank %d] %s", trainer.global_rank,
                            message)
