"""Several nodes: the rendezvous backends and node health checks."""
