"""A/B of SiLU-and-mul with fp8 quantization at few rows (run at 41ee57f; .carry/act_old held 5f0a649's
kernels/activation.py). Output: ab_silu_quant_h100.log."""
import importlib.util, sys, torch
sys.path.insert(0, ".")
from minivllm.kernels import activation as new
from minivllm.kernels.tuning import device_seconds
spec = importlib.util.spec_from_file_location("old_act", ".carry/act_old/activation_old.py")
old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)
FP8 = torch.float8_e4m3fn
for rows in (1, 2, 4):
    x = torch.randn(rows, 2 * 14336, device="cuda", dtype=torch.bfloat16)
    a, b = old.silu_and_mul(x, FP8), new.silu_and_mul(x, FP8)
    same = torch.equal(a.codes.view(torch.uint8), b.codes.view(torch.uint8)) and torch.equal(a.scales, b.scales)
    for round_ in range(3):
        t_old = device_seconds(lambda: old.silu_and_mul(x, FP8), calls=20, repeats=10)
        t_new = device_seconds(lambda: new.silu_and_mul(x, FP8), calls=20, repeats=10)
        print(f"rows {rows} round {round_}: old (silu + quant_rows) {t_old*1e6:.2f} us, new (one chunked kernel) {t_new*1e6:.2f} us, identical {same}", flush=True)
