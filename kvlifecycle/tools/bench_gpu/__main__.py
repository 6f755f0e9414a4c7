"""``python -m kvlifecycle.tools.bench_gpu``: the verb without the CLI around it."""

import sys

from .command import main

sys.exit(main())
