"""Calibration shared by the offline quantizer and SmoothQuant: token windows of a text, per-input statistics of
a transformers Llama-family model's linear layers, and folding per-channel input scales into the weights."""
from __future__ import annotations

import torch


def calibration_tokens(text: str, tokenizer) -> torch.Tensor:
    return tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[0]


def calibration_windows(text: str, tokenizer, num_samples: int, seq_len: int) -> torch.Tensor:
    """`num_samples` token windows spread evenly over the text."""
    ids = calibration_tokens(text, tokenizer)
    if len(ids) < seq_len:
        raise ValueError(f"calibration text has {len(ids)} tokens, fewer than one window of {seq_len}")
    starts = torch.linspace(0, len(ids) - seq_len, num_samples).long()
    return torch.stack([ids[s:s + seq_len] for s in starts])


@torch.no_grad()
def collect_input_stats(hf_model, windows: torch.Tensor, batch_size: int = 8) -> dict:
    """{(layer, projection): (H [K, K], mean |x| [K], max |x| [K])} for q_proj, o_proj, gate_proj and
    down_proj inputs."""
    sums, hooks = {}, []
    for i, layer in enumerate(hf_model.model.layers):
        for name in ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj"):
            key = (i, name.split(".")[-1])

            def hook(module, args, key=key):
                x = args[0].reshape(-1, args[0].shape[-1]).float()
                H, absum, amax, count = sums.get(key, (0.0, 0.0, 0.0, 0))
                amax = torch.maximum(torch.as_tensor(amax), x.abs().amax(0))
                sums[key] = (H + x.t() @ x, absum + x.abs().sum(0), amax, count + x.shape[0])
            hooks.append(layer.get_submodule(name).register_forward_pre_hook(hook))
    try:
        for start in range(0, len(windows), batch_size):
            hf_model(windows[start:start + batch_size])
    finally:
        for handle in hooks:
            handle.remove()
    return {key: (H / count, absum / count, amax) for key, (H, absum, amax, count) in sums.items()}


@torch.no_grad()
def fold_input_scales(layer, stats: dict, index: int, choose) -> None:
    """Multiply the input columns of each group of linears sharing an input by s = choose(weights,
    stats of that input), dividing the op that feeds the input by s (the function is unchanged)."""
    attn, mlp = layer.self_attn, layer.mlp
    groups = [((attn.q_proj, attn.k_proj, attn.v_proj), "q_proj", layer.input_layernorm.weight),
              ((mlp.gate_proj, mlp.up_proj), "gate_proj", layer.post_attention_layernorm.weight),
              ((mlp.down_proj,), "down_proj", mlp.up_proj.weight)]
    chosen = {}
    for linears, site, previous in groups:
        s = chosen[site] = choose([m.weight.float() for m in linears], stats[(index, site)])
        for m in linears:
            m.weight.mul_(s.to(m.weight.dtype))
        if previous.dim() == 1:
            previous.div_(s.to(previous.dtype))
        else:   # up_proj's output rows feed down_proj's inputs
            previous.div_(s.to(previous.dtype).unsqueeze(1))
    return chosen
