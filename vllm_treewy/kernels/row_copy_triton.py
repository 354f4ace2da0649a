"""One hidden row copied by one Triton program, in chunks: the body that the drafter's input kernels
(`level_inputs_triton`, `accepted_chains_triton`) share for the rows they move.

`copy_row` is a `triton.jit` function for use inside a kernel; `row_block(size)` is the chunk (a constexpr) its
launcher passes: at most ROW_BLOCK elements a loop iteration, fewer for a short row.
"""

from __future__ import annotations

import triton
import triton.language as tl

ROW_BLOCK = 1024  # hidden elements a program copies per iteration


def row_block(size: int) -> int:
    """The chunk `copy_row` takes for rows of `size` elements."""
    return min(ROW_BLOCK, triton.next_power_of_2(size))


@triton.jit
def copy_row(source, destination, size, BLOCK: tl.constexpr):
    """`destination[:size] = source[:size]` (pointers to unit-stride rows), BLOCK elements an iteration."""
    columns = tl.arange(0, BLOCK)
    for start in range(0, size, BLOCK):
        live = start + columns < size
        tl.store(destination + start + columns, tl.load(source + start + columns, mask=live), mask=live)
