import sys

from kvlifecycle.cli import main

sys.exit(main())
