"""The offline quantizer end to end on a tiny model that uses the default model's tokenizer, calibrated
on real English prose: each method's folder loads through our loader, rtn weights stay within half a
step of the originals, and GPTQ's weights beat round-to-nearest on the calibration inputs' output error
(the quantity it minimises)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import transformers

from tests.conftest import tiny_hf_config
from minivllm.models.loader import load_model, resolve_model
from minivllm.quantization.algorithms import (awq_search_clip, fake_quantize, group_params, output_error,
                                              quantize_codes, quantize_rtn, search_group_params)
from minivllm.quantization.packing import dequantize
from minivllm.quantization.quantizer import (INPUT_OF, LINEARS, calibration_windows, collect_input_stats,
                                             quantize_model)
from minivllm.quantization.sequential import SITE_MODULES, SequentialCalibration, fit_to_full_precision

GROUP = 32


def prose() -> str:
    """The King James Bible from the Debian package bible-kjv (scripts/setup.sh installs it); without
    it, the repository's own English documentation."""
    if shutil.which("bible"):
        return subprocess.run(["bible", "gen1:1-gen3:24"], capture_output=True, text=True, check=True).stdout
    root = Path(__file__).resolve().parent.parent
    return "\n".join((root / name).read_text() for name in ("README.md", "WRITEUP.md", "ARCHITECTURE.md")
                     if (root / name).is_file())


def write_tiny_llama(folder: Path, initialize) -> tuple:
    """A tiny llama with the default model's vocabulary and tokenizer files, plus a calibration file, in
    `folder`; `initialize(name, param)` sets each parameter (seed 0). Returns (folder, model, calib)."""
    default = resolve_model(None)
    config = tiny_hf_config("llama3")
    config.vocab_size = default.hf_config.vocab_size
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            initialize(name, param)
    model.save_pretrained(str(folder))
    transformers.AutoTokenizer.from_pretrained(default.tokenizer_dir).save_pretrained(str(folder))
    calib = folder / "calib.txt"
    calib.write_text(prose())
    return folder, model.eval(), calib


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny"), lambda name, param: param.normal_(0, 0.08))


def dequantized_weight(module) -> torch.Tensor | None:
    """W [N, K] in fp32 of a loaded quantized linear (weight-only layout or W8A8 codes), else None."""
    if hasattr(module, "qweight"):
        group_size, _ = module.quant_method.groups(module.input_size)
        w = dequantize(module.qweight, module.scales, module.zeros, group_size, module.quant_method.bits,
                       module.input_size)
        if module.perm is not None:
            w = w[torch.argsort(module.perm)]
        return w.t()
    if hasattr(module, "weight_scale"):
        return module.weight.float() * module.weight_scale.view(-1, 1)
    return None


def loaded_linears(folder: Path) -> dict:
    """{checkpoint-like name: dequantized W [N, K]} from our loader, packed layers split per shard."""
    model = load_model(resolve_model(str(folder)), torch.float32, torch.device("cpu"))
    weights = {}
    for name, module in model.named_modules():
        w = dequantized_weight(module)
        if w is None:
            continue
        shards = getattr(module, "shard_offsets", None)
        for shard, (start, size) in (shards or {None: (0, w.shape[0])}).items():
            part = {"q": "q_proj", "k": "k_proj", "v": "v_proj", 0: "gate_proj", 1: "up_proj"}.get(shard)
            key = name.replace("qkv_proj", part).replace("gate_up_proj", part) if part else name
            weights[key] = w[start:start + size]
    return weights


@pytest.mark.parametrize("bits", [4, 8])
def test_rtn_round_trips_within_half_a_step(tiny_model, tmp_path, bits):
    folder, reference, _ = tiny_model
    quantize_model(str(folder), "rtn", str(tmp_path), bits=bits, group_size=GROUP)
    loaded = loaded_linears(tmp_path)
    assert len(loaded) == 14
    for name, w in loaded.items():
        original = reference.get_parameter(name + ".weight").detach()
        groups = original.shape[1] // GROUP
        amax = original.abs().reshape(original.shape[0], groups, GROUP).amax(-1).repeat_interleave(GROUP, 1)
        step = amax * 2 / ((1 << bits) - 1)
        # half a step, plus the fp16 rounding of the scale (<= 2^-11 relative, times 2^(bits-1) levels)
        assert ((w - original).abs() <= step * (0.5 + (1 << (bits - 1)) / 2048)).all(), name


@pytest.mark.parametrize("desc_act, w8a8, grid_search", [(False, None, False), (True, None, False),
                                                      (True, "fp8", False), (True, "int8", False),
                                                      (True, None, True)])
def test_gptq_beats_rtn_on_calibration_error(tiny_model, tmp_path, desc_act, w8a8, grid_search):
    """Weight-only int4 groups (min/max ranges or grid-searched ones), and W8A8's per-channel fp8 / int8
    grids."""
    folder, reference, calib = tiny_model
    quantize_model(str(folder), "rtn", str(tmp_path / "rtn"), group_size=GROUP, w8a8=w8a8)
    quantize_model(str(folder), "gptq", str(tmp_path / "gptq"), group_size=GROUP, calib=str(calib),
                   num_samples=8, seq_len=64, desc_act=desc_act, w8a8=w8a8, sym=not grid_search,
                   grid_search=grid_search)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    stats = collect_input_stats(reference, calibration_windows(calib.read_text(), tokenizer, 8, 64))
    rtn, gptq = loaded_linears(tmp_path / "rtn"), loaded_linears(tmp_path / "gptq")
    site = {"q_proj": "q_proj", "k_proj": "q_proj", "v_proj": "q_proj", "o_proj": "o_proj",
            "gate_proj": "gate_proj", "up_proj": "gate_proj", "down_proj": "down_proj"}
    for name in rtn:
        layer, proj = int(name.split(".")[2]), name.rsplit(".", 1)[-1]
        H = stats[(layer, site[proj])][0]
        original = reference.get_parameter(name + ".weight").detach()
        assert output_error(gptq[name] - original, H) < output_error(rtn[name] - original, H), name


def test_awq_folder_loads_and_tracks_the_original(tiny_model, tmp_path):
    folder, reference, calib = tiny_model
    quantize_model(str(folder), "awq", str(tmp_path), group_size=GROUP, calib=str(calib), num_samples=8, seq_len=64)
    assert (tmp_path / "tokenizer.json").is_file()
    model = load_model(resolve_model(str(tmp_path)), torch.float32, torch.device("cpu"))
    from tests.conftest import PagedRun
    ids = transformers.AutoTokenizer.from_pretrained(str(folder))(calib.read_text()[:400]).input_ids[:48]
    ours = PagedRun(model, 1, len(ids)).step([ids])[0]
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0]
    # AWQ rescales weights and norms: the function, not the tensors, must stay close
    assert ((ours - expected).abs().max() / expected.abs().max()).item() < 0.1


def test_quantizer_rejects_bad_options(tiny_model, tmp_path):
    folder, _, _ = tiny_model
    with pytest.raises(ValueError, match="calibration"):
        quantize_model(str(folder), "gptq", str(tmp_path))
    with pytest.raises(ValueError, match="4-bit"):
        quantize_model(str(folder), "awq", str(tmp_path), bits=8, calib="x")
    with pytest.raises(ValueError, match="grid search"):
        quantize_model(str(folder), "awq", str(tmp_path), calib="x", grid_search=True)


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_w8a8_folder_loads_as_serialized_w8a8_within_a_step(tiny_model, tmp_path, kind):
    from minivllm.quantization import get_quantization_config
    from minivllm.quantization.w8a8 import W8A8LinearMethod
    folder, reference, _ = tiny_model
    quantize_model(str(folder), "rtn", str(tmp_path), w8a8=kind)
    config = get_quantization_config(resolve_model(str(tmp_path)).hf_config)
    assert config.name == kind and config.serialized
    model = load_model(resolve_model(str(tmp_path)), torch.float32, torch.device("cpu"))
    methods = [m.quant_method for m in model.modules() if hasattr(m, "weight_scale")]
    assert len(methods) == 2 * 2 * 2 and all(isinstance(m, W8A8LinearMethod) for m in methods)  # 2 layers
    loaded = loaded_linears(tmp_path)
    assert len(loaded) == 14
    for name, w in loaded.items():
        original = reference.get_parameter(name + ".weight").detach()
        step = original.abs().amax(dim=1, keepdim=True) / (448 if kind == "fp8" else 127)
        if kind == "int8":   # round to nearest: half a step
            assert ((w - original).abs() <= step * 0.5 + 1e-7).all(), name
        else:                # e4m3 keeps 3 mantissa bits: within 2^-4 of each value (or of a subnormal step)
            assert ((w - original).abs() <= torch.maximum(original.abs() / 16, step * 2 ** -9)).all(), name


def test_smoothed_w8a8_folder_keeps_the_function(tiny_model, tmp_path):
    """SmoothQuant moves scale between a norm (or up_proj) and the next linears: the served int8 model must
    still compute the reference's function, to within int8's rounding."""
    from tests.conftest import PagedRun
    folder, reference, calib = tiny_model
    quantize_model(str(folder), "gptq", str(tmp_path), calib=str(calib), num_samples=8, seq_len=64,
                   w8a8="int8", smooth_alpha=0.75)
    model = load_model(resolve_model(str(tmp_path)), torch.float32, torch.device("cpu"))
    ids = transformers.AutoTokenizer.from_pretrained(str(folder))(calib.read_text()[:400]).input_ids[:48]
    ours = PagedRun(model, 1, len(ids)).step([ids])[0]
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0]
    assert ((ours - expected).abs().max() / expected.abs().max()).item() < 0.05


def test_w8a8_options_and_checkpoints_are_checked(tiny_model, tmp_path):
    from minivllm.quantization.compressed_tensors import CompressedTensorsConfig
    from minivllm.quantization.quantizer import w8a8_quantization_config
    folder, _, calib = tiny_model
    with pytest.raises(ValueError, match="rtn or gptq"):
        quantize_model(str(folder), "awq", str(tmp_path), calib=str(calib), w8a8="fp8")
    with pytest.raises(ValueError, match="fp8 or int8"):
        quantize_model(str(folder), "rtn", str(tmp_path), w8a8="int4")
    with pytest.raises(ValueError, match="calibration"):
        quantize_model(str(folder), "rtn", str(tmp_path), w8a8="int8", smooth_alpha=0.5)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        quantize_model(str(folder), "rtn", str(tmp_path), calib=str(calib), smooth_alpha=1.5)
    static = w8a8_quantization_config("int8", "rtn")
    static["config_groups"]["group_0"]["input_activations"].update(dynamic=False, strategy="tensor")
    with pytest.raises(ValueError, match="dynamic per"):
        CompressedTensorsConfig.from_config(static)
    weight_only = w8a8_quantization_config("fp8", "rtn")
    del weight_only["config_groups"]["group_0"]["input_activations"]
    with pytest.raises(ValueError, match="weight-only"):
        CompressedTensorsConfig.from_config(weight_only)


def test_quantized_folder_serves_through_the_openai_sdk(tiny_model, tmp_path):
    import openai

    from minivllm.engine.async_engine import AsyncEngine
    from minivllm.engine.llm import LLM
    from minivllm.sampling_params import SamplingParams
    from minivllm.server.api_server import ServerThread, build_app

    folder, _, _ = tiny_model
    quantize_model(str(folder), "rtn", str(tmp_path), group_size=GROUP)
    llm = LLM(str(tmp_path), kv_cache_memory=8 << 20, max_model_len=64)
    expected = llm.generate(["In the beginning"], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    thread = ServerThread(build_app(AsyncEngine(llm.llm_engine)))
    url = thread.start()
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        card = client.models.list().data[0]
        assert card.model_extra["quantization"] == "gptq"
        reply = client.completions.create(model=card.id, prompt="In the beginning", max_tokens=4, temperature=0)
        assert reply.choices[0].text == expected[0].outputs[0].text
    finally:
        thread.stop()


def test_smoothquant_keeps_the_function_and_balances_input_and_weight_ranges(tiny_model, tmp_path):
    from minivllm.quantization.smoothquant import smooth_model
    folder, reference, calib = tiny_model
    for bad in ({"calib": None}, {"alpha": 1.5}):
        with pytest.raises(ValueError):
            smooth_model(str(folder), str(tmp_path / "bad"), **{"calib": str(calib), **bad})
    smooth_model(str(folder), str(tmp_path), str(calib), alpha=0.5, num_samples=8, seq_len=64)
    smoothed = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    windows = calibration_windows(calib.read_text(), tokenizer, 8, 64)
    with torch.no_grad():
        torch.testing.assert_close(smoothed(windows[:2]).logits, reference(windows[:2]).logits, rtol=1e-4, atol=1e-4)
    # alpha 0.5: each input channel's max |x| over the calibration text now equals its weight column's max
    # (not checked for gate/up: down_proj's smoothing later rescales up_proj's rows)
    stats = collect_input_stats(smoothed, windows)
    for index, layer in enumerate(smoothed.model.layers):
        for site, linears in (("q_proj", ("q_proj", "k_proj", "v_proj")), ("down_proj", ("down_proj",))):
            parent = layer.self_attn if site == "q_proj" else layer.mlp
            w_amax = torch.stack([getattr(parent, n).weight.abs().amax(0) for n in linears]).amax(0)
            torch.testing.assert_close(stats[(index, site)][2], w_amax, rtol=1e-4, atol=1e-6)


def test_awq_clipping_search_lowers_the_output_error_of_rounding():
    """With 16 levels over a group's full range the typical weights round coarsely; shrinking the range
    (the extremes round to the end codes) must lower the calibration-weighted output error. The search
    minimises each group's share delta_g H_gg delta_g^T, so no group may end up worse than with its full
    range (ratio 1 is among the candidates)."""
    torch.manual_seed(0)
    w = torch.randn(64, 4 * GROUP)
    x = torch.randn(512, 4 * GROUP) * torch.rand(4 * GROUP).mul(3).exp()   # input channels of unequal size
    H = x.t() @ x / x.shape[0]
    clip = awq_search_clip(w, H, bits=4, group_size=GROUP)
    assert clip.shape == (64, 4) and ((clip > 0.45) & (clip <= 1.0)).all()

    def errors(c):
        codes, scales, zeros, g_idx = quantize_rtn(w, 4, GROUP, False, clip=c)
        delta = (codes.float() - zeros.t()[:, g_idx]) * scales.t()[:, g_idx] - w
        groups = torch.stack([((delta[:, i:i + GROUP] @ H[i:i + GROUP, i:i + GROUP]) * delta[:, i:i + GROUP]).sum(1)
                              for i in range(0, w.shape[1], GROUP)], dim=1)
        return groups, ((delta @ H) * delta).sum()
    (full_groups, full), (clipped_groups, clipped) = errors(None), errors(clip)
    assert (clipped_groups <= full_groups * (1 + 1e-5)).all()
    assert clipped < 0.9 * full and (clip < 1).float().mean() > 0.3


def test_grid_search_never_raises_a_groups_weighted_error():
    """Rows shaped like Q4_1 blocks (16 levels d q + m with a float offset m, which an integer zero cannot
    hold): min/max is the search's first candidate, so no row's importance-weighted error may grow, and
    the shrunk ranges and shifted zeros must lower it for most rows."""
    torch.manual_seed(0)
    d = torch.rand(256, 1) * 0.02 + 0.005
    w = d * torch.randint(0, 16, (256, GROUP)).float() - d * (torch.rand(256, 1) * 15)
    w += 0.1 * d * torch.randn_like(w)   # not exactly on the old grid, as after GPTQ's error feedback
    importance = torch.rand(GROUP).mul(3).exp()

    def errors(scale, zero):
        delta = (quantize_codes(w, scale, zero, 4) - zero.unsqueeze(-1)) * scale.unsqueeze(-1) - w
        return (delta * delta) @ importance
    minmax = errors(*group_params(w, 4, False, 1))
    scale, zero = search_group_params(w, 4, False, 1, importance)
    searched = errors(scale, zero)
    assert ((zero >= 1) & (zero <= 15)).all() and (scale == scale.half().float()).all()
    assert (searched <= minmax).all()
    assert (searched < 0.99 * minmax).float().mean() > 0.5 and searched.sum() < 0.8 * minmax.sum()


def test_grid_searched_rtn_folder_loads_with_the_searched_grid(tiny_model, tmp_path):
    """The folder holds the searched scales and zeros (zero - 1 in GPTQ's v1 layout): loaded weights equal
    `quantize_rtn(grid_search=True)`'s and no group's squared error exceeds the min/max folder's."""
    folder, reference, _ = tiny_model
    quantize_model(str(folder), "rtn", str(tmp_path / "minmax"), group_size=GROUP, sym=False)
    quantize_model(str(folder), "rtn", str(tmp_path / "grid"), group_size=GROUP, sym=False, grid_search=True)
    minmax, grid = loaded_linears(tmp_path / "minmax"), loaded_linears(tmp_path / "grid")
    assert len(grid) == 14
    lowered = 0
    for name, w in grid.items():
        original = reference.get_parameter(name + ".weight").float()
        codes, scales, zeros, g_idx = quantize_rtn(original, 4, GROUP, False, 1, grid_search=True)
        expected = (codes.float() - zeros.t()[:, g_idx]) * scales.t()[:, g_idx]
        torch.testing.assert_close(w, expected, rtol=0, atol=1e-6, msg=name)
        group_error = lambda v: (v - original).pow(2).reshape(v.shape[0], -1, GROUP).sum(-1)  # noqa: E731
        assert (group_error(w) <= group_error(minmax[name]) * (1 + 1e-5) + 1e-9).all(), name
        lowered += int((group_error(w) < 0.99 * group_error(minmax[name])).sum())
    assert lowered > 0


def test_sequential_calibration_sees_the_quantized_model_inputs(tiny_model):
    """Each site's H, and each layer's input hidden states, are those of the model whose linears
    quantized before it (earlier layers, earlier sites of the same layer) are rounded, the others not."""
    import copy
    folder, reference, calib = tiny_model
    model = copy.deepcopy(reference)
    windows = calibration_windows(calib.read_text(), transformers.AutoTokenizer.from_pretrained(str(folder)), 6, 32)
    calibration = SequentialCalibration(model, windows, batch_size=4)
    seen_stats, seen_hidden = {}, {}
    with torch.no_grad():
        for index, layer in enumerate(model.model.layers):
            seen_hidden[index] = torch.cat(calibration.hidden)
            for site in SITE_MODULES:
                seen_stats[(index, site)] = calibration.input_stats(index, site)
                for name in (name for name in LINEARS if INPUT_OF[name] == site):
                    linear = layer.get_submodule(SITE_MODULES[site].replace(site, name))
                    linear.weight.copy_(fake_quantize(linear.weight, 4, GROUP, True))
            calibration.advance(index)
    actual_hidden = {}
    hooks = [layer.register_forward_pre_hook(lambda m, args, i=i: actual_hidden.setdefault(i, []).append(args[0]))
             for i, layer in enumerate(model.model.layers)]
    actual_stats = collect_input_stats(model, windows, batch_size=4)
    for handle in hooks:
        handle.remove()
    for index in seen_hidden:
        torch.testing.assert_close(seen_hidden[index], torch.cat(actual_hidden[index]), rtol=1e-5, atol=1e-5)
    for key, (H, mean_abs, amax, cross) in seen_stats.items():
        assert cross is None
        for seen, actual in zip((H, mean_abs, amax), actual_stats[key]):
            torch.testing.assert_close(seen, actual, rtol=1e-4, atol=1e-5, msg=str(key))
    # the rounding made a difference downstream, so the comparison above could have failed
    fresh = collect_input_stats(reference, windows, batch_size=4)
    assert not torch.allclose(fresh[(0, "o_proj")][0], actual_stats[(0, "o_proj")][0], rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("w8a8, extra", [(None, {}), ("fp8", {"fp8_inputs": True}),
                                         (None, {"target_full_precision": True})])
def test_sequential_gptq_folder_loads_and_beats_rtn(tiny_model, tmp_path, w8a8, extra):
    """The sequential folder loads; on the inputs it was calibrated on (the quantized model's own), its
    weights have a lower output error than round-to-nearest's."""
    folder, reference, calib = tiny_model
    quantize_model(str(folder), "rtn", str(tmp_path / "rtn"), group_size=GROUP, w8a8=w8a8)
    quantize_model(str(folder), "gptq", str(tmp_path / "gptq"), group_size=GROUP, calib=str(calib), num_samples=8,
                   seq_len=64, desc_act=True, w8a8=w8a8, sym=w8a8 is not None, sequential=True, **extra)
    rtn, gptq = loaded_linears(tmp_path / "rtn"), loaded_linears(tmp_path / "gptq")
    assert len(gptq) == 14
    import copy
    quantized = copy.deepcopy(reference)
    with torch.no_grad():
        for name, w in gptq.items():
            quantized.get_parameter(name + ".weight").copy_(w)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    stats = collect_input_stats(quantized, calibration_windows(calib.read_text(), tokenizer, 8, 64))
    for name in rtn:
        if extra.get("target_full_precision"):   # fitted to other targets: only the layer-0 inputs agree
            continue
        layer, proj = int(name.split(".")[2]), name.rsplit(".", 1)[-1]
        H = stats[(layer, INPUT_OF[proj])][0]
        original = reference.get_parameter(name + ".weight").detach()
        assert output_error(gptq[name] - original, H) < output_error(rtn[name] - original, H), name


def test_fit_to_full_precision_is_the_least_squares_fit():
    torch.manual_seed(0)
    x_fp = torch.randn(400, 24)
    x_q = x_fp + 0.1 * torch.randn(400, 24)
    w = torch.randn(8, 24)
    fitted = fit_to_full_precision(w, x_q.t() @ x_q, (x_fp - x_q).t() @ x_q, damp_percent=0.0)
    expected = torch.linalg.lstsq(x_q, x_fp @ w.t()).solution.t()
    torch.testing.assert_close(fitted, expected, rtol=1e-4, atol=1e-4)
