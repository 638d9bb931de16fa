"""Session helper (#20): run a script with the Gluon KIVI kernel's launch configuration overridden in-process.

    KIVI_CFG='{"2": {"stages": 2, "programs_per_sm": 16}}' \
        python benchmarks/sessions/with_gluon_config.py benchmarks/kivi_bench.py --stage points ...
"""

from __future__ import annotations

import json
import os
import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from sparsecompile.kernels import kivi_gluon  # noqa: E402

for bits, cfg in json.loads(os.environ.get("KIVI_CFG", "{}")).items():
    kivi_gluon.KIVI_GLUON_CONFIG[int(bits)].update(cfg)
print(f"KIVI_GLUON_CONFIG = {kivi_gluon.KIVI_GLUON_CONFIG}", file=sys.stderr)
script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path.insert(0, str(Path(script).resolve().parent))
runpy.run_path(script, run_name="__main__")
