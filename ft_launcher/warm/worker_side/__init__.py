"""Code that runs in processes other than the launcher: warm-restart standbys and the zygote.

Nothing here is imported by the launcher itself. These modules import nothing beyond what a
fresh interpreter already has loaded (``_signal``, ``os``, ``sys``, ``time``, ...), because
whatever they import is in the training script's ``sys.modules`` when a standby becomes a
worker.
"""
