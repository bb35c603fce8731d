"""The rerun state machine: tell a transient fault from a faulty device from a genuine result.

Same public names and semantics as Megatron-Core's ``megatron.core.rerun_state_machine``,
so ``import rerun.rerun_state_machine as rerun_state_machine`` ports Megatron code; and it
runs on CPU, where the device identity is the launcher's ``FT_DEVICE_ID``.

Usage::

    import sys
    import torch
    from rerun import (RerunDataIterator, RerunMode, RerunStateMachine,
                       get_rerun_state_machine, initialize_rerun_state_machine,
                       share_iterations_to_skip)

    initialize_rerun_state_machine(mode=RerunMode.VALIDATE_RESULTS,
                                   result_rejected_tracker_filename="rejected.jsonl")
    machine = get_rerun_state_machine()
    data = RerunDataIterator(iter(loader))
    for step in range(first_step, num_steps):
        while machine.should_run_forward_backward(data):   # once, or twice to re-run
            optimizer.zero_grad()
            loss = loss_fn(model(next(data)))
            machine.validate_result(loss, torch.isnan, "loss is NaN", fatal=True)
            loss.backward()
        save, stop, exit_code = machine.should_checkpoint_and_exit()
        if save:  # the step's start: the loader resumes at its first sample
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "rng": torch.get_rng_state(), "completed_steps": step - 1,
                        "loader": position_at_step_start(),
                        "rerun": machine.state_dict(data, "torch")}, ckpt_path)
        if stop:
            sys.exit(exit_code)     # 16: resume on other hardware; 17: final verdict
        optimizer.step()

    # on start-up, after loading the checkpoint (one file per rank; with Megatron's
    # distributed checkpoint pass "torch_dist" instead), then set the skip list:
    if machine.validate_state_dict(ckpt.get("rerun")):
        machine.load_state_dict(ckpt["rerun"])
    machine.current_iteration = ckpt["completed_steps"]   # as Megatron-LM's train() does
    skip = share_iterations_to_skip(
        RerunStateMachine.get_skipped_iterations_from_tracker_file("rejected.jsonl"))

Verdicts (VALIDATE_RESULTS; a rejected result re-runs the step in place on every rank):

* not reproduced in place: TRANSIENT_ERROR; exit 17 when fatal (after a checkpoint).
* reproduced in place: checkpoint and exit 16; the job resumed on another device re-runs
  the step: different there, PERSISTENT_ERROR; the same, CORRECT_RESULT; exit 17 when fatal.
  Resumed on the same (host, device): exit 16 again.
* a non-fatal validation logs its verdict and training continues.

Steps are numbered from 1 everywhere (``current_iteration``, logs, tracker file, skip list).

Diagnosis listeners: ``add_diagnosis_listener(fn)`` / ``remove_diagnosis_listener(fn)``.
``fn(event)`` is called on every rejected result and every verdict; what it raises is logged
and swallowed. ``event`` is a JSON-serialisable dict:

* ``state``: the machine's RerunState name after the event;
* ``diagnostic``: "TRANSIENT_ERROR", "PERSISTENT_ERROR", "CORRECT_RESULT" or None (a bare
  rejection, a request to re-run elsewhere, an abandoned diagnosis);
* ``iteration`` (1-based step), ``message`` (str), ``fatal`` (bool);
* ``exit_code``: 16, 17 or None, the exit the machine is about to ask for;
* ``host``, ``device`` (this process's device identity), ``rank`` (int or None);
* ``suspicious_host``, ``suspicious_device``: the device that reproduced the result, or None.

``current_device_identity()`` returns ``(host, device)``: the CUDA device (by UUID) when CUDA
is available and initialised, else ``FT_DEVICE_ID``, else ``LOCAL_RANK``, else ``"0"``.

Differences from Megatron-Core 0.16 (deliberate fixes; the README's "Porting from
Megatron-LM" lists them all): per-step failure state is reset every step; step numbers are
1-based everywhere; a skipped step with a pending diagnosis resumes training instead of
exiting 17 forever; a checkpoint taken at an exit 17 resumes cleanly; replayed microbatches
are private copies; a step re-run from a checkpoint reads the loader, as in Megatron-LM, and
its samples are checked against those the checkpoint recorded; +inf vs -inf, ``a == -b`` and
NaN comparisons are mismatches; REPORT_DETERMINISM_STATS works; the first step is validated;
tracker files of both formats are read line by line; state dicts carry a version and the
saving rank, are checked on load, and ``validate_state_dict`` never raises.
"""

# The public names are rerun_state_machine's ``__all__``: listed once, there.
from . import rerun_state_machine as _machine
from .rerun_state_machine import *  # noqa: F403

__all__ = list(_machine.__all__)
