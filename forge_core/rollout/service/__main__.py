"""`python -m forge_core.rollout.service ...`: run one engine service (forge_core.rollout.service.server.main)."""

import sys

from forge_core.rollout.service.server import main

if __name__ == "__main__":
    sys.exit(main())
