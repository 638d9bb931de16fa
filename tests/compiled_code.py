"""What a compiled decode step allocates, read from inductor's generated code (CPU)."""

from __future__ import annotations

import re

# A buffer whose leading dim is symbolic: with the page dimension dynamic (``runtime.compilation.page_indexed``), only
# pool-indexed tensors have one in a decode graph (the batch is static), so such a buffer is a copy of a pool tensor.
_POOL_SIZED = re.compile(r"empty_strided_\w+\(\((\d+\*)?s\d+[,)]")


def pool_sized_buffers(code: list[str]) -> list[str]:
    """The allocations of pool-sized buffers in ``code`` (``torch._inductor.utils.run_and_get_code``'s sources)."""
    return [m.group(0) for source in code for m in _POOL_SIZED.finditer(source)]
