"""A script that does not talk to ft_agent in this run: it sleeps in a loop and exits 0.

argv[1]: seconds to run in cycle 0; argv[2] (default argv[1]): seconds in later cycles;
``--ft`` (never passed by the tests) would import ft_agent, as training scripts that keep
it behind a flag do: the import statement is in the source, the import never happens.
"""

import os
import sys
import time

if "--ft" in sys.argv:
    import ft_agent  # noqa: F401

args = [a for a in sys.argv[1:] if a != "--ft"]
first = float(args[0])
later = float(args[1]) if len(args) > 1 else first
end = time.monotonic() + (first if os.environ.get("FT_CYCLE", "0") == "0" else later)
while time.monotonic() < end:
    time.sleep(0.05)
