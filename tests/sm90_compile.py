"""Triton (not Gluon) kernels compiled for sm_90 without a GPU, for tests that read their PTX.

Call these in a fresh (spawned) process: this module imports nothing at the top, so the process's first Triton
import happens here with the interpreter off, whatever the test process set (an interpreted kernel leaves
triton.language patched, and its @triton.jit functions are interpreter wrappers that cannot be compiled).
"""
import os


def fused_decode_ptx() -> str:
    """PTX of the split-K decode partition kernel with the fused combine (Llama-3-8B's head shapes)."""
    os.environ["TRITON_INTERPRET"] = "0"
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from minivllm.kernels.decode_attention import _decode_partition_kernel as kernel
    pointers = {"query_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "out_ptr": "*bf16",
                "partial_out_ptr": "*fp32", "partial_max_ptr": "*fp32", "partial_sum_ptr": "*fp32"}
    constants = dict(SPLIT=True, BLOCK_SIZE=16, BLOCK_G=16, BLOCK_N=64, BLOCK_D=128, DOT_PRECISION="tf32",
                     UPCAST=False, SOFTCAP=False, USE_WINDOW=False, FUSE_REDUCE=True, BLOCK_H=4, CHUNK=16, PDL=1)
    signature = {name: pointers.get(name, "*i32") if name.endswith("_ptr") else "constexpr" if name in constants
                 else "fp32" if name.endswith("scale") else "i32" for name in kernel.arg_names}
    compiled = triton.compile(ASTSource(kernel, signature, constexprs=constants),
                              target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=3))
    return compiled.asm["ptx"]
