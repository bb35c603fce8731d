"""Hugging Face Trainer integration: ``FaultToleranceCallback``.

    from ft_agent.transformers import FaultToleranceCallback
    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[FaultToleranceCallback()])

Under ``ft_launcher`` it heartbeats through training, evaluation and saves, reports each
step and each checkpoint written (the goodput ledger), offers the Trainer's state to the
launcher's in-memory snapshots after every optimizer step, and at the start of ``train()``
resumes from the snapshot the launcher chose when it is newer than where ``train()``
started (a disk checkpoint given to ``resume_from_checkpoint``, or the start). Outside the
launcher every call is a no-op after one warning.

What a snapshot holds: the model's ``state_dict()``, the optimizer's and the LR scheduler's,
the random number generators (``ft_agent.stateful.RNGState``) and the training's progress
in ``TrainerState`` (``STATE_FIELDS``). What it does not: the data loader's position. HF
skips the batches already trained only when ``train()`` itself loads a checkpoint, before
any callback runs, so after a restore from a snapshot the loader goes on from where
``train()`` put it (docs/stacks.md says what that means).

transformers is an optional dependency (the ``[transformers]`` extra); ``import ft_agent``
never imports it, only ``import ft_agent.transformers`` does.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Any

if importlib.util.find_spec("transformers") is None:
    raise ImportError(
        "ft_agent.transformers needs Hugging Face transformers, which is not installed: "
        "pip install 'ft-launcher[transformers]'"
    )

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from ft_agent.client import RankMonitorClient, get_client
from ft_agent.stateful import RNGState, restore_stateful, snapshot_stateful

__all__ = ["STATE_FIELDS", "FaultToleranceCallback", "TrainerProgress"]

# The training's progress in TrainerState, as a checkpoint's trainer_state.json carries it;
# the rest (max_steps, save_steps, batch size, ...) comes from this run's TrainingArguments.
STATE_FIELDS = ("global_step", "epoch", "total_flos", "num_input_tokens_seen", "log_history",
                "best_metric", "best_global_step", "best_model_checkpoint")


class TrainerProgress:
    """``STATE_FIELDS`` of a ``TrainerState`` as a ``Stateful`` (read and set in place: the
    Trainer keeps using the same object)."""

    def __init__(self, state: TrainerState) -> None:
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        return {name: getattr(self.state, name) for name in STATE_FIELDS
                if hasattr(self.state, name)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for name in STATE_FIELDS:
            if name in state_dict:
                setattr(self.state, name, state_dict[name])


def trainer_app_state(state: TrainerState, model: Any, optimizer: Any,
                      lr_scheduler: Any) -> dict[str, Any]:
    """What a snapshot of a Trainer holds, as an app state for ``ft_agent.stateful``."""
    app: dict[str, Any] = {"model": model, "optimizer": optimizer,
                           "lr_scheduler": lr_scheduler, "rng": RNGState(),
                           "trainer_state": TrainerProgress(state)}
    return {name: obj for name, obj in app.items() if obj is not None}


class FaultToleranceCallback(TrainerCallback):
    """Heartbeats, progress, checkpoint reports and in-memory snapshots for an HF Trainer.

    Args:
        snapshots: offer the Trainer's state to ``RankMonitorClient.snapshot`` after every
            optimizer step (the launcher decides which of them it takes) and resume from
            the launcher's choice at the start of ``train()``. False keeps the heartbeats
            and reports only.
        client: the ``RankMonitorClient`` to use when the script has its own; default, the
            process-wide ``ft_agent.get_client()``. Connected by the callback either way.
        logger_name: the ``logging`` logger this callback writes to.
    """

    def __init__(self, snapshots: bool = True, client: RankMonitorClient | None = None,
                 logger_name: str = "ft_agent.transformers") -> None:
        self.snapshots = bool(snapshots)
        self.logger = logging.getLogger(logger_name)
        self.client = client
        self.restored_step: int | None = None  # the snapshot this train() resumed from

    # -- connection ------------------------------------------------------------------------

    def _connect(self) -> RankMonitorClient:
        """The client, connected (again after the goodbye at the end of a train())."""
        if self.client is None:
            self.client = get_client()
        self.client.init_workload_monitoring()  # a no-op when connected or not launched
        return self.client

    @property
    def _live(self) -> bool:
        return self.client is not None and self.client.is_initialized

    def _heartbeat(self) -> None:
        if self._live:
            self.client.send_heartbeat()  # type: ignore[union-attr]

    # -- Trainer events --------------------------------------------------------------------

    def on_init_end(self, args: TrainingArguments, state: TrainerState,
                    control: TrainerControl, **kwargs: Any) -> None:
        """Connect as the Trainer is built: the model's set-up is done."""
        self._connect()
        self._heartbeat()

    def on_train_begin(self, args: TrainingArguments, state: TrainerState,
                       control: TrainerControl, model: Any = None, optimizer: Any = None,
                       lr_scheduler: Any = None, **kwargs: Any) -> None:
        """Resume from the launcher's snapshot when it is newer than where ``train()``
        started. The optimizer and LR scheduler exist from this event on, after any
        checkpoint given to ``resume_from_checkpoint`` was loaded."""
        client = self._connect()
        self._heartbeat()
        self.restored_step = None
        if not (self.snapshots and self._live):
            return
        started_at = state.global_step
        app_state = trainer_app_state(state, model, optimizer, lr_scheduler)
        self.restored_step = restore_stateful(app_state, newer_than=started_at, client=client)
        if self.restored_step is not None:
            self.logger.info("rank %d cycle %d: resumed from the snapshot of step %d "
                             "(train() started at step %d)", args.process_index, client.cycle,
                             self.restored_step, started_at)
        self._heartbeat()

    def on_step_end(self, args: TrainingArguments, state: TrainerState,
                    control: TrainerControl, model: Any = None, optimizer: Any = None,
                    lr_scheduler: Any = None, **kwargs: Any) -> None:
        """After each optimizer step: progress (a heartbeat too), then the snapshot."""
        if not self._live:
            return
        client = self.client
        assert client is not None
        client.report_progress(state.global_step)
        if self.snapshots:
            app_state = trainer_app_state(state, model, optimizer, lr_scheduler)
            snapshot_stateful(app_state, state.global_step, client=client)

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                **kwargs: Any) -> None:
        """A checkpoint of this step is written: the ledger's restart point."""
        if self._live:
            self.client.report_checkpoint(state.global_step)  # type: ignore[union-attr]

    def on_train_end(self, args: TrainingArguments, state: TrainerState,
                     control: TrainerControl, **kwargs: Any) -> None:
        """Say goodbye: what the script does after ``train()`` is not judged for hangs."""
        if self._live:
            self.client.send_heartbeat()  # type: ignore[union-attr]
            self.client.shutdown_workload_monitoring()  # type: ignore[union-attr]

    # Heartbeats wherever the Trainer spends time between steps: epochs, gradient
    # accumulation, evaluation, logging.
    def _beat(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
              **kwargs: Any) -> None:
        self._heartbeat()

    on_epoch_begin = on_epoch_end = on_substep_end = _beat
    on_prediction_step = on_evaluate = on_log = _beat
