"""Real-SGLang tests: they run SGLang's own classes in the SGLang venv (.venv-sglang) from this (main) venv.
Without that venv they skip, unless KVL_REQUIRE_ALL=1 (CI), where they fail."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
