"""The smallest AOTI load check (issue #17's known risk): build a Linear's package, load it in a fresh process.

    python benchmarks/aoti_min.py build DIR && python -X faulthandler benchmarks/aoti_min.py load DIR
"""

import sys
import time

import torch

role, where = sys.argv[1], sys.argv[2]
device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
model = torch.nn.Linear(64, 32).to(device)
x = torch.randn(4, 64, device=device)
if role == "build":
    start = time.perf_counter()
    program = torch.export.export(model, (x,))
    torch._inductor.aoti_compile_and_package(program, package_path=f"{where}/linear.pt2")
    torch.save({"x": x.cpu(), "y": model(x).detach().cpu()}, f"{where}/io.pt")
    print(f"built in {time.perf_counter() - start:.1f} s")
else:
    start = time.perf_counter()
    runner = torch._inductor.aoti_load_package(f"{where}/linear.pt2")
    io = torch.load(f"{where}/io.pt")
    y = runner(io["x"].to(device))
    y = y[0] if isinstance(y, (list, tuple)) else y
    print(f"loaded and ran in {time.perf_counter() - start:.1f} s, max |err| {(y.cpu() - io['y']).abs().max():.2e}")
