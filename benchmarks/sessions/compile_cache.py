"""Carry the compile cache from one GPU call to the next (each call starts on a bare machine).

    python benchmarks/sessions/compile_cache.py save DIR      # end of a call:   pack into DIR/cc.tgz.NN pieces
    python benchmarks/sessions/compile_cache.py restore DIR   # start of a call: unpack the pieces found in DIR

A decode compile of the 8B shape takes 35-50 s on a fresh machine, most of it inductor code generation and Triton
compiles that the on-disk caches (``<SPARSECOMPILE_CACHE>/compile``: inductor's FX graph / AOTAutograd caches and
Triton's) turn into hits. ``save`` writes that folder as a gzipped tar in pieces of at most 15 MiB (a call
returns files of up to 16 MiB, 64 MiB in all), and only when the whole fits ``--max-mib`` (default 58: four
pieces, leaving room for results); ``restore`` unpacks them before the benchmarks run. Between the two, on this
machine: copy the returned pieces into ``.carry/cc/`` (ignored by git) and name ``.carry`` in the next call's
``carry``. The graphs' cache keys include the code, so carry the cache only between calls of one checkout.
"""

from __future__ import annotations

import argparse
import glob
import io
import sys
import tarfile
from pathlib import Path

PIECE = 15 * 2**20


def cache_dir() -> Path:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from sparsecompile.config import cache_root

    return cache_root() / "compile"


def save(out: Path, max_mib: float) -> int:
    source = cache_dir()
    if not source.is_dir():
        print(f"compile_cache: nothing to save ({source} does not exist)")
        return 0
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz", compresslevel=6) as tar:
        tar.add(source, arcname="compile")
    data = buffer.getvalue()
    if len(data) > max_mib * 2**20:
        print(f"compile_cache: {len(data) / 2**20:.1f} MiB packed, over --max-mib {max_mib}: not saved")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    for i in range(0, len(data), PIECE):
        (out / f"cc.tgz.{i // PIECE:02d}").write_bytes(data[i:i + PIECE])
    print(f"compile_cache: saved {len(data) / 2**20:.1f} MiB in {-(-len(data) // PIECE)} piece(s) under {out}")
    return 0


def restore(src: Path) -> int:
    pieces = sorted(glob.glob(str(src / "cc.tgz.*")))
    if not pieces:
        print(f"compile_cache: no pieces under {src}: starting cold")
        return 0
    data = b"".join(Path(p).read_bytes() for p in pieces)
    target = cache_dir().parent
    target.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        tar.extractall(target, filter="data")
    print(f"compile_cache: restored {len(data) / 2**20:.1f} MiB into {target / 'compile'}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=("save", "restore"))
    parser.add_argument("dir", type=Path)
    parser.add_argument("--max-mib", type=float, default=58, help="save only up to this size (4 pieces)")
    args = parser.parse_args()
    return save(args.dir, args.max_mib) if args.action == "save" else restore(args.dir)


if __name__ == "__main__":
    sys.exit(main())
