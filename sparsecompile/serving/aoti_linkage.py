"""The C++ runtime an AOTInductor package links: one ``libstdc++`` per process, or the package does not load.

An AOTI package's wrapper library constructs its model with ``std::regex`` (the device string is parsed when the
model is created), which looks up locale facets. A wrapper that carries its own static copy of libstdc++, loaded
into a process that already holds the shared ``libstdc++.so.6`` (every torch process does), sees two sets of
locale globals: some of its references bind to the process's copy, others to its own, and a facet id of one copy
indexes the other's table. Found on the H200 image, whose ``CXX`` (``/opt/gcc/bin/g++``) links libstdc++ statically
into shared objects: every CUDA package segfaulted in ``parse_device_str`` -> ``std::regex`` (cuda-gdb backtrace,
``benchmarks/results/aoti_probe_native_h200.jsonl``); the same link on the CPU machine (g++ with
``-static-libstdc++``) fails there with ``std::bad_cast`` from the same constructor. Naming the shared library on
the link line (``-l:libstdc++.so.6``, before the compiler driver's own ``-lstdc++``) makes the wrapper use the
process's copy, and the package loads.

:func:`link_options` is what export adds to inductor's options; :func:`check_package` refuses, before the loader
runs it, a package whose wrapper carries no ``libstdc++.so.6`` dependency (built before this fix or elsewhere).
"""

from __future__ import annotations

import struct
import sys
import zipfile
from pathlib import Path
from typing import Any

from .manifest import ArtifactError

SHARED_LIBSTDCXX = "libstdc++.so.6"
_SHT_DYNAMIC, _DT_NEEDED = 6, 1


def link_options() -> dict[str, Any]:
    """Inductor options that link an AOTI package's wrapper against the shared libstdc++ (Linux; empty elsewhere,
    or on a torch without the option)."""
    import torch._inductor.config as inductor_config

    if not sys.platform.startswith("linux") or not hasattr(inductor_config.aot_inductor, "custom_op_libs"):
        return {}
    libs = list(inductor_config.aot_inductor.custom_op_libs or [])
    return {"aot_inductor.custom_op_libs": [*libs, f":{SHARED_LIBSTDCXX}"]}


def elf_needed(image: bytes) -> list[str] | None:
    """The ``DT_NEEDED`` entries of a 64-bit little-endian ELF shared object, or None for anything else."""
    if image[:4] != b"\x7fELF" or image[4] != 2 or image[5] != 1:
        return None
    shoff, = struct.unpack_from("<Q", image, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", image, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", image, shoff + i * shentsize) for i in range(shnum)]
    needed: list[str] = []
    for _, kind, _, _, offset, size, link, _, _, _ in sections:
        if kind != _SHT_DYNAMIC:
            continue
        strings = sections[link][4]
        for entry in range(offset, offset + size, 16):
            tag, value = struct.unpack_from("<qQ", image, entry)
            if tag == _DT_NEEDED:
                start = strings + value
                needed.append(image[start:image.index(b"\0", start)].decode())
    return needed


def wrapper_libraries(package: Path) -> dict[str, list[str] | None]:
    """Every shared object inside an AOTI package (a zip archive) -> its ``DT_NEEDED`` list."""
    with zipfile.ZipFile(package) as archive:
        return {name: elf_needed(archive.read(name)) for name in archive.namelist() if name.endswith(".so")}


def check_package(package: Path) -> None:
    """Raise :class:`ArtifactError` when a wrapper in ``package`` does not load the shared libstdc++ (Linux only:
    such a wrapper crashes the process while its model is constructed, see the module docstring)."""
    if not sys.platform.startswith("linux"):
        return
    for name, needed in wrapper_libraries(package).items():
        if needed is not None and not any(lib.startswith("libstdc++.so") for lib in needed):
            raise ArtifactError(
                f"{package.name}: its library {Path(name).name} carries its own static libstdc++ (no "
                f"{SHARED_LIBSTDCXX} among {needed}); loading it next to torch's libstdc++ crashes the process while "
                "the model is constructed. Export the artifact again with this sparsecompile (it links the shared "
                f"{SHARED_LIBSTDCXX}), or with CXX set to a compiler that links libstdc++ dynamically, or use "
                "form='exported'.")
