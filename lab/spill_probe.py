"""A Triton kernel that cannot fit its registers (a 2048-element fp32 tile live across a loop; compiled with one
warp and ``maxnreg=32``): ``kernel_report --self-check`` compiles it to show that the spill detector fires.
Triton reads a kernel's source from its file, hence a module of its own. Imported only when compiling."""

import triton
import triton.language as tl


@triton.jit
def spilling_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    acc = tl.load(x_ptr + offs)
    for i in range(0, n):
        acc = acc * 1.0001 + tl.load(x_ptr + (offs + i) % BLOCK)
    tl.store(y_ptr + offs, acc)
