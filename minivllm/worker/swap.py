"""SwapSpace: the CPU copy of the KV cache that swap-to-CPU preemption moves blocks to and from.

One CPU tensor per device KV cache, shaped like it ([2, layers, num_cpu_blocks, block_size, heads, dim]),
pinned on CUDA; fp8 caches are held and copied as bytes (`fp8_as_bytes`). Each step's pairs are copied
in two batched gathers/scatters per cache (never a loop per block): swap-outs first, because the step may
hand the freed GPU blocks to other sequences and its forward pass overwrites them; then swap-ins. On CUDA
the copies run on a side stream that first waits for the main stream (earlier steps may still write the
blocks being swapped out) and the main stream waits for it in turn, so the forward pass sees swapped-in
blocks.
"""
from __future__ import annotations

import torch

from minivllm.attention.torch_backend import fp8_as_bytes


def num_cpu_blocks(swap_space_gib: float, bytes_per_block: int) -> int:
    return int(swap_space_gib * 2**30) // bytes_per_block


class SwapSpace:
    def __init__(self, device_caches: list[torch.Tensor], num_blocks: int) -> None:
        device_caches = [fp8_as_bytes(c) for c in device_caches]
        self.device_caches = device_caches
        self.num_blocks = num_blocks
        on_cuda = device_caches[0].device.type == "cuda"
        self.cpu_caches = [torch.zeros(*c.shape[:2], num_blocks, *c.shape[3:], dtype=c.dtype, pin_memory=on_cuda)
                           for c in device_caches]
        self.stream = torch.cuda.Stream(device_caches[0].device) if on_cuda else None

    @property
    def nbytes(self) -> int:
        return sum(c.numel() * c.element_size() for c in self.cpu_caches)

    def apply(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        """Copy device blocks -> CPU blocks for `swap_out`, then CPU blocks -> device blocks for `swap_in`."""
        if not swap_out and not swap_in:
            return
        if self.stream is None:
            self._copy(swap_out, swap_in)
            return
        main = torch.cuda.current_stream(self.stream.device)
        self.stream.wait_stream(main)
        with torch.cuda.stream(self.stream):
            self._copy(swap_out, swap_in)
        main.wait_stream(self.stream)

    def _copy(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        device = self.device_caches[0].device
        if swap_out:
            src, dst = torch.tensor(swap_out, dtype=torch.int64).t()
            src = src.to(device)
            for device_cache, cpu_cache in zip(self.device_caches, self.cpu_caches):
                # .cpu() waits for the gather: the host blocks here, only in steps that swap out.
                cpu_cache.index_copy_(2, dst, device_cache.index_select(2, src).cpu())
        if swap_in:
            src, dst = torch.tensor(swap_in, dtype=torch.int64).t()
            dst = dst.to(device)
            for device_cache, cpu_cache in zip(self.device_caches, self.cpu_caches):
                staged = cpu_cache.index_select(2, src)
                if device.type == "cuda":
                    # A pinned staging buffer copies asynchronously; the host allocator keeps it alive
                    # until the copy is done.
                    staged = staged.pin_memory().to(device, non_blocking=True)
                device_cache.index_copy_(2, dst, staged)
