"""First-use work of torch's compiler, done once in the zygote's learner for every fork.

torch's compiler does some work once per process, the first time a worker compiles or
loads a compiled graph, whose result depends only on this machine and the installed
packages. A worker forked from a zygote that already did it inherits the result (a cache in
memory) instead of doing it again during the first step after a restart:

- ``torch._inductor.cpu_vec_isa``: which vector instruction sets the C++ compiler can build
  for and this CPU can load. Each is checked by compiling a probe and loading it in a child
  interpreter that imports torch (seconds of CPU per worker). The learner does torch's
  base check of each, whose answer torch keeps per value of
  ``torch._inductor.config.cpp.vec_isa_ok``; the rest (the list, the AVX-512 extras) is
  left to the worker, so a script that sets ``vec_isa_ok`` or ``simdlen`` before it
  compiles still gets its own choice.
- ``torch._inductor.codecache``: ``torch_key()``, a hash of torch's own source files, part of
  every compiled graph's cache key (reading and hashing a few thousand files).

The warm-ups run where the compiler is imported into a zygote, right after the imports: in
the learner round that learned it (a job whose workers compiled), or in the zygote at its
start when ``--ft-preload`` names it. A job that never compiles runs none. One that fails
is skipped: the worker does the work itself, as it would have. One that leaves the process
unsafe to fork (a thread) refuses the compiler as an import would.

Like the rest of ``worker_side`` this imports only what a fresh interpreter has loaded;
torch's modules are looked up in ``sys.modules``.
"""

import sys


def _vector_isas() -> None:
    """Each x86 vector ISA the CPU has: torch's base check (build a probe, load it in a
    child interpreter), cached per ISA and per value of ``config.cpp.vec_isa_ok``; only the
    answer for the default (None), which is the check's own. Neither the list of valid
    ISAs nor the AVX-512 classes' own checks (bf16, VNNI) are cached here: torch caches
    those whatever the setting, and a script that sets ``vec_isa_ok`` before it compiles
    must get its own answer."""
    isa = sys.modules["torch._inductor.cpu_vec_isa"]
    config = sys.modules["torch._inductor.config"]
    check = getattr(isa.VecISA, "_VecISA__bool__impl", None)  # torch's cached base check
    if config.cpp.vec_isa_ok is not None or check is None \
            or isa.platform.machine() not in ("x86_64", "AMD64"):
        return
    flags = isa.x86_isa_checker()
    for one in isa.supported_vec_isa_list:
        if all(flag in flags for flag in str(one).split()):
            check(one, None)


def _torch_key() -> None:
    codecache = sys.modules["torch._inductor.codecache"]
    metrics = getattr(sys.modules.get("torch._dynamo.utils"), "compilation_time_metrics", None)
    had = set(metrics or ())
    codecache.torch_key()
    # torch times the hash among the process's compile times: those stay the worker's own.
    for name in set(metrics or ()) - had:
        metrics.pop(name, None)


# The module a script's first torch.compile() imports (through the inductor backend's
# configuration), never one that torch or torch._dynamo import by themselves: a job that
# imports it compiles, and only such a job pays for the warm-ups.
COMPILER = "torch._inductor.compile_fx"
# (what the warm-up is named by, the module it needs, the warm-up), in this order.
WARMUPS = (("torch_key", "torch._inductor.codecache", _torch_key),
           ("vector_isas", "torch._inductor.cpu_vec_isa", _vector_isas))


def run(names: list[str], unsafe) -> tuple[list[str], tuple[str, str] | None]:
    """Run the warm-ups when ``names`` (what was just imported into this zygote-to-be)
    include ``COMPILER`` and it is loaded.

    Returns the names of the warm-ups that ran, and ``(name, reason)`` for one after which
    ``unsafe()`` gave a reason (the process must then not become the zygote)."""
    if COMPILER not in names or COMPILER not in sys.modules:
        return [], None
    done: list[str] = []
    for name, module, warm in WARMUPS:
        if module not in sys.modules:
            continue
        try:
            warm()
        except Exception:  # noqa: BLE001, S112 - the worker does it itself, as before
            continue
        reason = unsafe()
        if reason is not None:
            return done, (name, reason)
        done.append(name)
    return done, None
