"""`python -m relayrl.engine`: the same as `relayrl engine`."""

import sys

from relayrl.engine.launcher import main

sys.exit(main(prog="python -m relayrl.engine"))
