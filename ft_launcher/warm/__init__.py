"""Warm restart: the standby pool, the zygote as the launcher sees it, and the code that runs
in the zygote and its standbys."""
