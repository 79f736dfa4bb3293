"""`python -m disagg.workers`: the `disagg` command."""

import sys

from disagg.workers.cli import main

sys.exit(main())
