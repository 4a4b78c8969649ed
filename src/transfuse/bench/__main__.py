"""`python -m transfuse.bench`: the same as `transfuse bench`."""

import sys

from transfuse.bench import main

sys.exit(main())
