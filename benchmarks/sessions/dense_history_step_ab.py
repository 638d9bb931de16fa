"""Session experiment (#20, 2026-12-05 twenty-seventh session): the decode step of ``kivi2`` with and without
``KiviSpec.dense_history`` (the Gluon kernel reading no positions), in separate processes (``--off``: the package
with the flag forced off), through ``decode.py``'s engine point.

    python benchmarks/sessions/dense_history_step_ab.py [--off] -- <decode.py arguments>
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import decode  # noqa: E402

from sparsecompile.methods import kivi  # noqa: E402

if __name__ == "__main__":
    args = sys.argv[1:]
    if args and args[0] == "--off":
        args = args[1:]
        kivi.KiviRuntime.dense_history = False  # the class flag KiviStorageMixin reads into its KiviSpec
    if args and args[0] == "--":
        args = args[1:]
    sys.exit(decode.main(args))
