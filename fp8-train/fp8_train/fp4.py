"""Block-scaled formats, emulated: NVFP4, MXFP4 (the FP4 stretch goal) and MXFP8 (for the debug
tool).

    nvfp4  E2M1 elements, 16-element blocks, E4M3 block scales, plus one fp32 per-tensor scale
           that puts the largest block scale at the top of E4M3's range (NVIDIA's recipe)
    mxfp4  E2M1 elements, 32-element blocks, power-of-two (E8M0) block scales (OCP MX spec)
    mxfp8  E4M3 elements, 32-element blocks, power-of-two block scales (OCP MX spec)

Blocks are consecutive elements of the flattened tensor (the zero-padded tail is its own
block); for a Linear's weight, input and output gradient that is along the last dimension, the
one the GEMM reduces over for the forward pass. MX scales are 2**(floor(log2(block amax)) - emax):
the block's amax lands in [2**emax, 2**(emax+1)), so the top of that range saturates at max.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from fp8_train.formats import E2M1, E4M3, Format, cast

BLOCK_RECIPES = ("nvfp4", "mxfp4", "mxfp8")
BLOCK_SIZE = {"nvfp4": 16, "mxfp4": 32, "mxfp8": 32}
ELEMENT_FORMAT = {"nvfp4": E2M1, "mxfp4": E2M1, "mxfp8": E4M3}
_EMAX = {"e2m1": 2, "e4m3": 8}  # exponent of the largest power of two below the format's max


class BlockQuant(NamedTuple):
    dequantized: torch.Tensor  # x after the round trip, x's shape and dtype
    scaled: torch.Tensor  # x multiplied by its block's encode scale, before the cast (flat)
    fmt: Format  # element format


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    flat = x.reshape(-1)
    pad = (-flat.numel()) % block
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(-1, block)


def _unblock(blocks: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return blocks.reshape(-1)[: like.numel()].view(like.shape).to(like.dtype)


def block_quantize(x: torch.Tensor, recipe: str) -> BlockQuant:
    if recipe not in BLOCK_RECIPES:
        raise ValueError(f"unknown block recipe {recipe!r}: choose one of {BLOCK_RECIPES}")
    fmt, block = ELEMENT_FORMAT[recipe], BLOCK_SIZE[recipe]
    xb = _blocks(x.float(), block)
    amax = xb.abs().amax(dim=1, keepdim=True)
    if recipe == "nvfp4":
        tensor_amax = amax.max()
        global_scale = torch.where(
            tensor_amax > 0, (E4M3.max * fmt.max) / tensor_amax, torch.ones_like(tensor_amax)
        )
        decode = cast(amax / fmt.max * global_scale, E4M3) / global_scale  # E4M3-stored block scale
    else:
        exp = (
            torch.floor(torch.log2(amax.clamp(min=torch.finfo(torch.float32).tiny)))
            - _EMAX[fmt.name]
        )
        decode = torch.where(amax > 0, torch.exp2(exp), torch.ones_like(amax))
    encode = torch.where(decode > 0, 1.0 / decode, torch.zeros_like(decode))
    scaled = xb * encode
    deq = cast(scaled, fmt) * decode
    return BlockQuant(_unblock(deq, x), scaled.reshape(-1)[: x.numel()], fmt)


def quantize(x: torch.Tensor, recipe: str) -> torch.Tensor:
    """Block-scaled round trip of x (same shape and dtype)."""
    return block_quantize(x, recipe).dequantized
