"""Which source code dynamo's trace of a decode step spends its bytecode instructions on (issue #14: a new process
with warm caches still traces the step, 8.0 s of its 13.7 s on the H200).

    python benchmarks/trace_count.py [--method vanilla] [--layers 32] [--out FILE]

Builds a tiny Llama (CPU), optimizes it with ``compile=True`` and counts, while its first ``generate()`` compiles
the decode step, every bytecode instruction dynamo's ``InstructionTranslator`` steps through, by source file and
function. The count is a proxy for tracing time (fake-tensor work per op is not in it). Prints the tables; ``--out``
writes them too.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "1")  # (CPU: sparsecompile's Triton kernels are never launched here)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from decode import row_method  # noqa: E402
from serving import make_model  # noqa: E402
from torch._dynamo import symbolic_convert  # noqa: E402

import sparsecompile  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(sparsecompile.__file__)))


def _where(filename: str) -> str:
    if "site-packages/" in filename:
        return filename.split("site-packages/")[-1]
    return os.path.relpath(filename, ROOT) if filename.startswith(ROOT) else filename


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--method", default="vanilla")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    counts: collections.Counter[tuple[str, str]] = collections.Counter()
    step = symbolic_convert.InstructionTranslatorBase.step

    def counted(self):
        counts[(_where(self.f_code.co_filename), self.f_code.co_name)] += 1
        return step(self)

    symbolic_convert.InstructionTranslatorBase.step = counted
    model = make_model(args.layers, True, "cpu")
    name, options = row_method(args.method)
    sparsecompile.optimize(model, name, compile=True, cuda_graphs=False, **options)
    start = time.perf_counter()
    model.generate(torch.randint(3, 1000, (1, 200)), max_new_tokens=3, do_sample=False)
    seconds = time.perf_counter() - start
    symbolic_convert.InstructionTranslatorBase.step = step
    total = sum(counts.values())
    by_file: collections.Counter[str] = collections.Counter()
    for (file, _), n in counts.items():
        by_file[file] += n
    lines = [f"{args.method}, {args.layers} layers: {total} instructions traced; first generate() {seconds:.1f} s "
             f"(inductor on CPU included)", "by file:"]
    lines += [f"{n:8d} {100 * n / total:5.1f} %  {file}" for file, n in by_file.most_common(25)]
    lines.append("by function:")
    lines += [f"{n:8d} {100 * n / total:5.1f} %  {file}:{name}" for (file, name), n in counts.most_common(40)]
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as sink:
            sink.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
