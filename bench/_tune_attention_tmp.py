# TEMPORARY tuning sweep (deleted after use).
import sys, itertools, torch
sys.path.insert(0, '.')
from triton.testing import do_bench
import minivllm.kernels.decode_attention as da
import minivllm.kernels.prefill_attention as pa
sys.path.insert(0, 'bench')
import attention_bench as ab
H, KVH, D = 32, 8, 128
def t(fn): return do_bench(fn, warmup=10, rep=50, return_mode="median")
which = sys.argv[1]
if which in ("prefill", "all"):
    for batch, L in [(8, 512), (1, 4096)]:
        kc, vc, bt = ab.paged_cache(batch, L, KVH, D)
        T = batch * L
        q = torch.randn(T, H, D, dtype=torch.bfloat16, device="cuda")
        qsl = torch.arange(0, T + 1, L, dtype=torch.int32, device="cuda")
        sl = torch.full((batch,), L, dtype=torch.int32, device="cuda")
        flops = 4 * H * D * batch * L * (L + 1) // 2
        res = []
        for bm, bn, w, st in itertools.product([64, 128], [32, 64, 128], [4, 8], [2, 3, 4]):
            pa._tile_config = lambda hd, dt: (bm, bn, w, st)
            try:
                ms = t(lambda: pa.paged_prefill_attention(q, kc, vc, qsl, sl, bt, 0.088))
                res.append((flops / ms / 1e9, bm, bn, w, st))
            except Exception as e:
                print("fail", bm, bn, w, st, repr(e)[:80])
        res.sort(reverse=True)
        print(batch, L, [f"{r[0]:.0f}:{r[1:]}" for r in res[:8]], "worst", f"{res[-1][0]:.0f}")
if which in ("decode", "all"):
    for batch, ctx in [(64, 4096), (8, 4096), (1, 32768)]:
        kc, vc, bt = ab.paged_cache(batch, ctx, KVH, D)
        q = torch.randn(batch, H, D, dtype=torch.bfloat16, device="cuda")
        sl = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        nbytes = 2 * batch * ctx * KVH * D * 2
        res = []
        parts = [None] if batch == 64 else [128, 256, 512, 1024, 2048]
        for bn, w, st, part in itertools.product([32, 64, 128], [2, 4, 8], [2, 3, 4], parts):
            da._decode_config = lambda bd, dt: (bn, w, st)
            ms = t(lambda: da.paged_decode_attention(q, kc, vc, bt, sl, 0.088, partition_size=part))
            res.append((nbytes / ms / 1e6, bn, w, st, part))
        res.sort(reverse=True, key=lambda r: r[0])
        print(batch, ctx, [f"{r[0]:.0f}:{r[1:]}" for r in res[:8]], "worst", f"{res[-1][0]:.0f}")
