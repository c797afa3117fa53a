"""Sequential calibration for GPTQ: the calibration hidden states are carried through the transformers
model one decoder layer at a time, so each linear's input statistics come from a model whose earlier
linears are already quantized (GPTQ's "true sequential": inside a layer too, o_proj sees the rounded
q/k/v, the MLP the rounded attention, down_proj the rounded gate/up) and its rounding compensates them.

`SequentialCalibration` owns the hidden states and the decoder layers' call arguments (captured from
layer 0's call in the model's own forward, so rotary embeddings and the causal mask are the model's);
the quantizer owns the rounding and writes the dequantized weights into the layer before asking for the
next site's statistics. Optionally (`fp8_inputs`) each linear's input is rounded per token to fp8, as the
served W8A8 fp8 path does, so the statistics and the next layer see what is served.
With `target_full_precision` (GPTAQ-style asymmetric calibration) it also carries the unquantized model's
hidden states and returns, per site, the cross term D = (X_fp - X_q)^T X_q, so the caller can fit the
weights to the full-precision outputs X_fp W^T from the quantized inputs X_q before rounding.
"""
from __future__ import annotations

import copy

import torch

SITE_MODULES = {"q_proj": "self_attn.q_proj", "o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_proj",
                "down_proj": "mlp.down_proj"}


class _Stop(Exception):
    """Raised by a hook once the input it waits for is seen: the rest of the layer need not run."""


def _fp8_round_trip(module, args):
    from minivllm.kernels.quant_rows import round_trip_rows
    return (round_trip_rows(args[0], torch.float8_e4m3fn), *args[1:])


def _output(result) -> torch.Tensor:
    return result[0] if isinstance(result, tuple) else result


class SequentialCalibration:
    """Calibration windows' hidden states at the input of the next decoder layer to quantize."""

    @torch.no_grad()
    def __init__(self, hf_model, windows: torch.Tensor, batch_size: int = 8, fp8_inputs: bool = False,
                 target_full_precision: bool = False):
        self.layers = hf_model.model.layers
        self.fp8_inputs = fp8_inputs
        self.hidden, self.calls = [], []   # per batch: hidden states [B, T, D]; layer args and kwargs

        def capture(module, args, kwargs):
            self.hidden.append(args[0].float())
            self.calls.append((args[1:], kwargs))
            raise _Stop
        handle = self.layers[0].register_forward_pre_hook(capture, with_kwargs=True)
        try:
            for start in range(0, len(windows), batch_size):
                try:
                    hf_model(windows[start:start + batch_size], use_cache=False)
                except _Stop:
                    pass
        finally:
            handle.remove()
        # the unquantized model's hidden states and a copy of the layer being quantized, before rounding
        self.hidden_fp = list(self.hidden) if target_full_precision else None
        self.layer_fp, self.layer_fp_index = None, None

    def _run(self, layer, hidden: list, site: str | None, record, fp8_inputs: bool = False) -> list:
        """Run `layer` on each batch; with `site`, stop at that linear's input and pass it to `record`
        (batch index, x [tokens, K]); without, return the layer's outputs."""
        hooks = []
        if fp8_inputs:
            hooks += [m.register_forward_pre_hook(_fp8_round_trip) for m in layer.modules()
                      if isinstance(m, torch.nn.Linear)]
        if site is not None:
            def stop(module, args):
                record(batch, args[0].reshape(-1, args[0].shape[-1]).float())
                raise _Stop
            hooks.append(layer.get_submodule(SITE_MODULES[site]).register_forward_pre_hook(stop))
        outputs = []
        try:
            for batch, (h, (args, kwargs)) in enumerate(zip(hidden, self.calls)):
                try:
                    outputs.append(_output(layer(h, *args, **kwargs)).float())
                except _Stop:
                    pass
        finally:
            for handle in hooks:
                handle.remove()
        return outputs

    @torch.no_grad()
    def input_stats(self, index: int, site: str):
        """(H [K, K], mean |x| [K], max |x| [K]) of `site`'s inputs in layer `index` as it is now (the
        linears quantized so far already rounded); with target_full_precision also D = (X_fp - X_q)^T X_q
        / tokens (else None)."""
        layer = self.layers[index]
        if self.hidden_fp is not None and self.layer_fp_index != index:
            self.layer_fp, self.layer_fp_index = copy.deepcopy(layer), index
        quantized_inputs = {}
        sums = {"H": 0.0, "absum": 0.0, "amax": 0.0, "count": 0, "D": 0.0}

        def record(batch, x):
            sums["H"] = sums["H"] + x.t() @ x
            sums["absum"] = sums["absum"] + x.abs().sum(0)
            sums["amax"] = torch.maximum(torch.as_tensor(sums["amax"]), x.abs().amax(0))
            sums["count"] += x.shape[0]
            if self.hidden_fp is not None:
                quantized_inputs[batch] = x

        self._run(layer, self.hidden, site, record, self.fp8_inputs)
        if self.hidden_fp is not None:   # one batch at a time would do too; the layer's inputs are small
            def cross(batch, x_fp):
                x = quantized_inputs.pop(batch)
                sums["D"] = sums["D"] + (x_fp - x).t() @ x
            self._run(self.layer_fp, self.hidden_fp, site, cross)
        count = sums["count"]
        return (sums["H"] / count, sums["absum"] / count, sums["amax"],
                sums["D"] / count if self.hidden_fp is not None else None)

    @torch.no_grad()
    def advance(self, index: int) -> None:
        """Replace the hidden states by layer `index`'s outputs (call once its linears are rounded)."""
        if self.hidden_fp is not None:
            assert self.layer_fp_index == index, "input_stats copies the layer before it is rounded"
            self.hidden_fp = self._run(self.layer_fp, self.hidden_fp, None, None)
            self.layer_fp, self.layer_fp_index = None, None
        self.hidden = self._run(self.layers[index], self.hidden, None, None, self.fp8_inputs)


def fit_to_full_precision(w: torch.Tensor, H: torch.Tensor, D: torch.Tensor, damp_percent: float = 0.01):
    """GPTAQ-style: the weights whose outputs on the quantized inputs X_q best match the full-precision
    outputs X_fp W^T in least squares, W' = W + W D (H + damp)^-1 with H = X_q^T X_q, D = (X_fp - X_q)^T X_q."""
    H = H.float().clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    H += damp_percent * torch.diag(H).mean() * torch.eye(H.shape[0])
    return w + torch.linalg.solve(H, (w.float() @ D).t()).t()
