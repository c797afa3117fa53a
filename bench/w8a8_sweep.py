"""W8A8 variants emulated in the transformers model (fp32, CPU), for choosing settings on a validation text.

    HELD=valid.txt python bench/w8a8_sweep.py '[("int8 sq0.65 rtn", "rtn-int8", "int8", 0.65)]'

Each variant is (label, weights, activations, SmoothQuant alpha or None): weights "rtn-fp8" / "rtn-int8"
(per-channel round to nearest, the served code's rounding) or "gptq-fp8" / "gptq-int8" (GPTQ rounding onto
the same per-channel grid, act-order), activations "fp8" / "int8" per token, "fp8g32" per token and 32
channels, or None. Calibration:
calib.txt (32 windows x 256 tokens); scored text: $HELD (default heldout.txt), its first 4,096 tokens in
512-token windows every 448, both files in the working directory. Prints perplexity against fp32.
Used to pick SmoothQuant's alpha for int8 on a validation text (Exodus) before the held-out table.
"""
import sys, time, copy, math
import torch, transformers
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent.parent))
from minivllm.models.loader import resolve_model
from minivllm.quantization.quantizer import calibration_windows, collect_input_stats, fold_input_scales
from minivllm.quantization.smoothquant import smoothquant_scale
from minivllm.kernels.quant_rows import quantize_rows_reference, FP8
from minivllm.quantization.algorithms import gptq_quantize_rows
torch.set_num_threads(2)
src = resolve_model(None)
tok = transformers.AutoTokenizer.from_pretrained(src.tokenizer_dir)
base = transformers.AutoModelForCausalLM.from_pretrained(src.weights_dir, dtype=torch.float32).eval()
held = tok(open(__import__("os").environ.get("HELD","heldout.txt")).read(), add_special_tokens=False).input_ids[:4096]
ids = torch.tensor(held)
calib = calibration_windows(open("calib.txt").read(), tok, 32, 256)

@torch.no_grad()
def ppl(model, window=512, stride=448):
    nll, count, prev = 0.0, 0, 0
    for begin in range(0, len(ids), stride):
        end = min(begin + window, len(ids))
        x = ids[begin:end][None]
        logits = model(x).logits[0].float()
        lp = torch.log_softmax(logits[:-1], -1)
        tgt = x[0, 1:]
        start = max(prev - begin, 0)  # first target index (position begin+start+1) not yet scored
        sel = torch.arange(start, end - begin - 1)
        if begin == 0: sel = torch.arange(0, end - begin - 1)
        nll -= lp[sel, tgt[sel]].sum().item(); count += len(sel)
        prev = end
        if end == len(ids): break
    return math.exp(nll / count), count

def fq(x, kind):
    """kind "fp8" / "int8" per row, or "fp8g32" etc.: a scale per row and 32 columns."""
    kind, _, group = kind.partition("g")
    rows = x.reshape(-1, int(group)) if group else x
    codes, scale = quantize_rows_reference(rows, FP8 if kind == "fp8" else torch.int8)
    return (codes.float() * scale).reshape(x.shape)

class FakeLinear(torch.nn.Module):
    def __init__(self, w, act):
        super().__init__(); self.w = w; self.act = act
    def forward(self, x):
        if self.act: x = fq(x.reshape(-1, x.shape[-1]), self.act).reshape(x.shape)
        return torch.nn.functional.linear(x, self.w)

LIN = ("q_proj","k_proj","v_proj","o_proj","gate_proj","up_proj","down_proj")
SITE = {"q_proj":"q_proj","k_proj":"q_proj","v_proj":"q_proj","o_proj":"o_proj","gate_proj":"gate_proj","up_proj":"gate_proj","down_proj":"down_proj"}

def build(weight_mode, act, alpha=None):
    m = copy.deepcopy(base)
    if alpha is not None:
        st = collect_input_stats(m, calib)
        for i, layer in enumerate(m.model.layers):
            fold_input_scales(layer, st, i, lambda ws, s: smoothquant_scale(ws, s[2], alpha))
    st = collect_input_stats(m, calib) if weight_mode.startswith("gptq") else None
    for i, layer in enumerate(m.model.layers):
        mods = {n.rsplit(".",1)[-1]:(n, mod) for n, mod in layer.named_modules() if n.rsplit(".",1)[-1] in LIN}
        for name, (path, mod) in mods.items():
            w = mod.weight.data.float()
            wk = weight_mode.split("-")[-1]
            if weight_mode == "none":
                q = w
            elif weight_mode.startswith("rtn"):
                q = fq(w, wk)
            else:
                codes, scale = gptq_quantize_rows(w, st[(i, SITE[name])][0], FP8 if wk == "fp8" else torch.int8)
                q = codes.float() * scale[:, None]
            parent = layer.get_submodule(path.rsplit(".",1)[0])
            setattr(parent, path.rsplit(".",1)[1], FakeLinear(q, act))
    return m

t = time.time(); b, n = ppl(base); print(f"fp32 {b:.4f} tokens {n} ({time.time()-t:.0f}s)", flush=True)
for label, wm, act, alpha in [(a[0], a[1], a[2], a[3]) for a in __import__('ast').literal_eval(sys.argv[1])]:
    t = time.time(); p, _ = ppl(build(wm, act, alpha))
    print(f"{label:40s} {p:.4f} {100*(p/b-1):+.2f}% ({time.time()-t:.0f}s)", flush=True)
