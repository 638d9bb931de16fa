"""The method test matrix: one row per method, with options that make it keep everything
(budget >= sequence length), so it must equal the unpatched model token for token."""

from __future__ import annotations

# method name -> options under which the method must be exactly dense on the tiny-model tests
DENSE_EQUIVALENT = {
    "vanilla": {},
}
