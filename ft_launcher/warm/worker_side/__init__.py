"""Code that runs in processes other than the launcher: warm-restart standbys and the zygote.

The launcher itself imports only constants and pure checks from here (``learning``). These
modules import nothing beyond what a fresh interpreter already has loaded (``_signal``,
``_thread``, ``os``, ``sys``, ``time``, ...), because whatever they import is in the
training script's ``sys.modules`` when a standby becomes a worker.
"""
