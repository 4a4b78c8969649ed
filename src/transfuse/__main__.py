"""`python -m transfuse`: the same as the `transfuse` command (transfuse.cli)."""

import sys

from transfuse.cli import main

sys.exit(main())
