"""A script that never imports ft_agent: it sleeps in a loop and exits 0.

argv[1]: seconds to run in cycle 0; argv[2] (default argv[1]): seconds in later cycles.
"""

import os
import sys
import time

first = float(sys.argv[1])
later = float(sys.argv[2]) if len(sys.argv) > 2 else first
end = time.monotonic() + (first if os.environ.get("FT_CYCLE", "0") == "0" else later)
while time.monotonic() < end:
    time.sleep(0.05)
