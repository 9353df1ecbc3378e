"""e4m3 values read two to an int16 word and converted to 16-bit MMA operands: the fp8 path of the paged
attention and latent attention kernels.

An 8-bit tile that an MMA wants transposed (the value operand: keys are its contraction dim, but the
cache stores a key's values contiguously) is read from shared memory byte by byte, and an 8-bit load
that feeds both products of an attention step is not pipelined. Read as int16 words instead, word j of
a row holds dims 2j and 2j + 1; ``e4m3_pairs`` turns a word tile into two fp16 tiles (the even and the
odd dims), each a 16-bit operand the compiler stages as it does bf16 ones. A dot product over all dims
is the sum of the even and odd halves' products (the queries split the same way), and a product with
the values yields the even and odd output dims apart."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def e4m3_pairs(w, ASM: tl.constexpr):
    """Two e4m3 values packed in each int16 word -> (low byte, high byte) as fp16.

    ASM: the hardware's paired conversion (``cvt.rn.f16x2.e4m3x2``, after a byte permute that
    gathers the low / high bytes of two words). Otherwise (the interpreter) bit moves that
    place each byte in fp16's bit positions, which reads value * 2^-8, then * 256 (exact: every
    e4m3 value, subnormals included, is an fp16 value). Either way the MMA operands are 16-bit tiles the
    compiler stages like bf16 ones (an 8-bit V tile is read from shared memory byte by byte
    when the MMA wants it transposed)."""
    if ASM:
        lo, hi = tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 t0, t1;
            .reg .b16 s0, s1;
            prmt.b32 t0, $2, 0, 0x0020;
            prmt.b32 t1, $2, 0, 0x0031;
            cvt.u16.u32 s0, t0;
            cvt.u16.u32 s1, t1;
            cvt.rn.f16x2.e4m3x2 $0, s0;
            cvt.rn.f16x2.e4m3x2 $1, s1;
            }""",
            constraints="=r,=r,r",
            args=[w],
            dtype=(tl.float16, tl.float16),
            is_pure=True,
            pack=2,
        )
        return lo, hi
    else:
        u = w.to(tl.uint16, bitcast=True)
        lo = ((u << 7) & 0x3F80) | ((u << 8) & 0x8000)
        hi = ((u >> 1) & 0x3F80) | (u & 0x8000)
        return lo.to(tl.float16, bitcast=True) * 256.0, hi.to(tl.float16, bitcast=True) * 256.0
