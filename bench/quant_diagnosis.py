"""Where W8A8's perplexity loss comes from: weights vs activations, per layer type, first/last layers.

    python bench/quant_diagnosis.py --text heldout.txt --max-tokens 4096 --kinds int8 fp8
    python bench/quant_diagnosis.py --text heldout.txt --max-tokens 8192 --kinds fp8 --activations-only

Loads the default model unquantized (fp32) and swaps each linear layer's method for one that rounds the
weights per output channel and/or the inputs per token through `w8a8.quantize_rows` (the served code's
rounding) and multiplies in fp32; perplexity through the engine's prompt logprobs, 512-token windows
every 448 tokens (--window, --stride). Prints one line per configuration, relative to the unquantized model.
--activations-only: only the inputs rounded, everywhere and at each site alone. --group G: the inputs' scales
per token and G channels (block-wise activation scales) instead of per token. --lm-head 128,32: only the LM head
rounded to int4 per group (what a quantized head, GPTQ's lm_head: true, costs before any error feedback).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from minivllm.engine.llm import LLM  # noqa: E402
from minivllm.engine.perplexity import perplexity  # noqa: E402
from minivllm.layers.linear import LinearBase  # noqa: E402
from minivllm.quantization.w8a8 import FP8, quantize_rows  # noqa: E402


def fake_quantize(x: torch.Tensor, kind: str, group: int = 0) -> torch.Tensor:
    """Rounded per row, or per `group` columns of each row (a scale per token and group of channels)."""
    rows = x.reshape(-1, group) if group else x
    codes, scale = quantize_rows(rows, FP8 if kind == "fp8" else torch.int8)
    return (codes.float() * scale).to(x.dtype).reshape(x.shape)


class FakeW8A8Method:
    """Weights rounded per output channel (once) and/or activations per token, product in full precision."""

    def __init__(self, weight_kind: str | None, activation_kind: str | None, group: int = 0):
        self.weight_kind, self.activation_kind, self.weight, self.group = weight_kind, activation_kind, None, group

    def apply(self, layer, x, bias):
        if self.weight is None:
            self.weight = fake_quantize(layer.weight.data, self.weight_kind) if self.weight_kind else layer.weight.data
        if self.activation_kind:
            x = fake_quantize(x.reshape(-1, x.shape[-1]), self.activation_kind, self.group).reshape(x.shape)
        return torch.nn.functional.linear(x, self.weight, bias)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--text", required=True)
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--kinds", nargs="+", default=["int8", "fp8"])
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--stride", type=int, default=448)
    parser.add_argument("--activations-only", action="store_true")
    parser.add_argument("--group", type=int, default=0,
                        help="activation scales per token and this many channels (0: per token)")
    parser.add_argument("--lm-head", default="",
                        help="instead: the LM head alone rounded to int4 (asymmetric, per group of these sizes, "
                             "comma-separated), the rest unquantized")
    args = parser.parse_args()
    llm = LLM(None, dtype="float32", kv_cache_memory=1 << 29, enable_prefix_caching=False)
    text = Path(args.text).read_text(encoding="utf-8", errors="replace")
    ids = llm.get_tokenizer().encode(text, add_special_tokens=False)[:args.max_tokens]
    layers = [(n, m) for n, m in llm.llm_engine.runner.model.named_modules() if isinstance(m, LinearBase)]
    original = {n: m.quant_method for n, m in layers}
    baseline = None

    def run(name, weight_kind=None, activation_kind=None, selected=lambda n: True):
        nonlocal baseline
        for n, m in layers:
            m.quant_method = FakeW8A8Method(weight_kind, activation_kind, args.group) if selected(n) else original[n]
        started = time.time()
        ppl = perplexity(llm, ids, args.window, args.stride)["perplexity"]
        baseline = baseline or ppl
        print(f"{name:42s} {ppl:8.4f} {100 * (ppl / baseline - 1):+7.2f}%  ({time.time() - started:.0f} s)", flush=True)

    run("fp32")
    if args.lm_head:   # the head's own weight (untied from the embedding), rounded to nearest per group
        from minivllm.quantization.algorithms import fake_quantize
        head = llm.llm_engine.runner.model.lm_head
        weight = head.weight.data.clone()
        for group in (int(g) for g in args.lm_head.split(",")):
            head.weight = torch.nn.Parameter(fake_quantize(weight, 4, group, sym=False), requires_grad=False)
            run(f"int4 LM head, rtn, group {group}")
        return
    edge = ("0", "1", "28", "29")
    sites = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    for kind in args.kinds:
        if args.activations_only:
            run(f"{kind} activation only", None, kind)
            for site in sites:
                run(f"{kind} activation only at {site}", None, kind, lambda n, s=site: s in n)
            continue
        run(f"{kind} W8A8", kind, kind)
        run(f"{kind} weight only", kind, None)
        run(f"{kind} activation only", None, kind)
        for site in sites:
            run(f"{kind} W8A8 only {site}", kind, kind, lambda n, s=site: s in n)
        run(f"{kind} W8A8 layers 0,1,28,29 only", kind, kind, lambda n: n.split(".")[2] in edge)
        run(f"{kind} W8A8 except layers 0,1,28,29", kind, kind, lambda n: n.split(".")[2] not in edge)


if __name__ == "__main__":
    main()
