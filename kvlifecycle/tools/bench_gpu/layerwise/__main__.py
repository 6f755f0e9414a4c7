"""``python -m kvlifecycle.tools.bench_gpu.layerwise``: the verb without the CLI around it."""

import sys

from .run import main

sys.exit(main())
