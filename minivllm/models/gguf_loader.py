"""Convert a llama- or gpt2-architecture GGUF file into an HF-style folder that the normal loader reads.

The folder (`$MINIVLLM_CACHE` or `~/.cache/minivllm`, then `gguf-<first 16 hex of the file's sha256>`)
holds config.json, model.safetensors (dequantized to fp32, or bf16 above 1B parameters), the
tokenizer files with the chat template, and a marker naming the converter version. It is built in a
temporary folder and renamed into place, so an interrupted or concurrent conversion never leaves a
half-written folder behind, and a second start only hashes the file.

llama.cpp's converter permutes the rows of attn_q / attn_k so that RoPE rotates interleaved pairs;
`unpermute_rows` restores HF's rotate-half layout. Only this module reads GGUF files, each opened through
model_files.open_gguf (a truncated or corrupt file raises a ModelFileError naming it).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from minivllm import envs
from minivllm.models.model_files import open_gguf, open_safetensors

CONVERTER_VERSION = 1
MARKER_FILE = "minivllm_gguf.json"
BF16_ABOVE_PARAMS = 1_000_000_000

# GGUF tensor name (per block with {i}) -> HF checkpoint name
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(.+)")
# GPT-2 (llama.cpp's `gpt2` architecture): HF names without the `.weight`/`.bias` suffix, which carries
# over. llama.cpp stores the Conv1D weights transposed to [out, in]; they are transposed back.
_GPT2_GLOBAL_NAMES = {"token_embd": "transformer.wte", "position_embd": "transformer.wpe",
                      "output_norm": "transformer.ln_f", "output": "lm_head"}
_GPT2_BLOCK_NAMES = {"attn_norm": "ln_1", "attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj",
                     "ffn_norm": "ln_2", "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"}


def cache_root() -> Path:
    return envs.MINIVLLM_CACHE


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's permute: within each head, rows were reordered from
    [first half | second half] to interleaved pairs (x0, x_half, x1, x_half+1, ...)."""
    rows = weight.shape[0]
    head_dim = rows // num_heads
    return (weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def _metadata(reader) -> dict:
    """Scalar and string fields (the big tokenizer arrays are left to transformers)."""
    from gguf import GGUFValueType
    values = {}
    for key, field in reader.fields.items():
        if field.types and field.types[0] != GGUFValueType.ARRAY:
            values[key] = field.contents()
    return values


def hf_config_from_gguf(reader, has_output: bool) -> dict:
    meta = _metadata(reader)
    arch = meta.get("general.architecture")
    if arch == "gpt2":
        return _gpt2_config(reader, meta)
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} is not supported (only 'llama' and 'gpt2')")
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise ValueError("GGUF files with rope_freqs (Llama 3.1 rope scaling) are not supported")
    num_heads = meta["llama.attention.head_count"]
    hidden = meta["llama.embedding_length"]
    vocab = meta.get("llama.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    head_dim = meta.get("llama.attention.key_length", hidden // num_heads)
    if meta.get("llama.rope.dimension_count", head_dim) != head_dim:
        raise ValueError("GGUF files with partial rotary embedding are not supported")
    rope = {"rope_type": "default", "rope_theta": float(meta.get("llama.rope.freq_base", 10000.0))}
    if meta.get("llama.rope.scaling.type") == "linear":
        rope = {**rope, "rope_type": "linear", "factor": float(meta["llama.rope.scaling.factor"])}
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": meta["llama.feed_forward_length"],
        "num_hidden_layers": meta["llama.block_count"],
        "num_attention_heads": num_heads,
        "num_key_value_heads": meta.get("llama.attention.head_count_kv", num_heads),
        "head_dim": head_dim,
        "max_position_embeddings": meta["llama.context_length"],
        "rms_norm_eps": float(meta["llama.attention.layer_norm_rms_epsilon"]),
        "rope_theta": rope["rope_theta"],   # 4.x style; 5.x reads rope_parameters
        "rope_parameters": rope,
        "hidden_act": "silu",
        "tie_word_embeddings": not has_output,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": "bfloat16",          # the dtype to serve in; the file itself may hold fp32
    }
    if rope["rope_type"] != "default":
        config["rope_scaling"] = rope
    return config


def _gpt2_config(reader, meta: dict) -> dict:
    embedding = next(t for t in reader.tensors if t.name == "token_embd.weight")
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": int(embedding.shape[1]),   # GGUF dims are fastest-first: [hidden, vocab]
        "n_positions": meta["gpt2.context_length"],
        "n_embd": meta["gpt2.embedding_length"],
        "n_inner": meta["gpt2.feed_forward_length"],
        "n_layer": meta["gpt2.block_count"],
        "n_head": meta["gpt2.attention.head_count"],
        "layer_norm_epsilon": float(meta["gpt2.attention.layer_norm_epsilon"]),
        "activation_function": "gelu_new",
        "tie_word_embeddings": True,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }


def _gpt2_hf_name(name: str) -> str | None:
    stem, _, suffix = name.rpartition(".")
    match = _BLOCK_RE.fullmatch(stem)
    if stem in _GPT2_GLOBAL_NAMES:
        return f"{_GPT2_GLOBAL_NAMES[stem]}.{suffix}"
    if match and match.group(2) in _GPT2_BLOCK_NAMES:
        return f"transformer.h.{match.group(1)}.{_GPT2_BLOCK_NAMES[match.group(2)]}.{suffix}"
    return None


def hf_tensors(reader, config: dict) -> dict[str, torch.Tensor]:
    from gguf.quants import dequantize
    num_params = sum(int(np.prod(t.shape)) for t in reader.tensors)
    dtype = torch.bfloat16 if num_params > BF16_ABOVE_PARAMS else torch.float32
    tensors = {}
    for tensor in reader.tensors:
        name = tensor.name
        match = _BLOCK_RE.fullmatch(name)
        is_gpt2 = config["model_type"] == "gpt2"
        if is_gpt2:
            hf_name = _gpt2_hf_name(name)
            if hf_name is None:
                raise ValueError(f"unexpected GGUF tensor {name!r}")
        elif name in _GLOBAL_NAMES:
            hf_name = _GLOBAL_NAMES[name]
        elif match and match.group(2) in _BLOCK_NAMES:
            hf_name = f"model.layers.{match.group(1)}.{_BLOCK_NAMES[match.group(2)]}"
        else:
            raise ValueError(f"unexpected GGUF tensor {name!r}")
        # GGUF lists dims fastest-first; the dequantized array is already [rows, cols] as HF stores it.
        weight = dequantize(tensor.data, tensor.tensor_type).reshape(tuple(reversed(tensor.shape.tolist())))
        if is_gpt2 and weight.ndim == 2 and re.search(r"\.(attn_qkv|attn_output|ffn_up|ffn_down)\.weight$", name):
            weight = weight.T   # back to HF's Conv1D [in, out]
        elif name.endswith("attn_q.weight"):
            weight = unpermute_rows(weight, config["num_attention_heads"])
        elif name.endswith("attn_k.weight"):
            weight = unpermute_rows(weight, config["num_key_value_heads"])
        # np.array copies: F32 tensors are read-only views into the memory-mapped file.
        tensors[hf_name] = torch.from_numpy(np.array(weight, dtype=np.float32, order="C")).to(dtype)
    return tensors


def _save_tokenizer(gguf_path: Path, reader, out_dir: Path) -> None:
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    template = _metadata(reader).get("tokenizer.chat_template")
    if not tokenizer.chat_template and template:
        tokenizer.chat_template = template
    tokenizer.save_pretrained(str(out_dir))


def _is_complete(folder: Path) -> bool:
    marker = folder / MARKER_FILE
    if not marker.is_file():
        return False
    return json.loads(marker.read_text()).get("converter_version") == CONVERTER_VERSION


def convert_gguf(path: str) -> str:
    """Return the HF-style folder for the GGUF file at `path`, converting it on first use."""
    from safetensors.torch import save_file

    gguf_path = Path(path).expanduser().resolve()
    if not gguf_path.is_file():
        raise ValueError(f"GGUF file {path!r} does not exist")
    root = cache_root()
    out_dir = root / f"gguf-{file_sha256(gguf_path)[:16]}"
    if _is_complete(out_dir):
        return str(out_dir)

    root.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=root))
    tmp_dir.chmod(0o755)   # mkdtemp makes it private; the finished cache folder is ordinary
    try:
        reader = open_gguf(gguf_path)
        has_output = any(t.name == "output.weight" for t in reader.tensors)
        config = hf_config_from_gguf(reader, has_output)
        save_file(hf_tensors(reader, config), str(tmp_dir / "model.safetensors"), metadata={"format": "pt"})
        # Written as a plain dict with both rope styles, so transformers 4.x and 5.x read it alike.
        (tmp_dir / "config.json").write_text(json.dumps(config, indent=2))
        if "tokenizer.ggml.tokens" in reader.fields:   # a file without a vocabulary runs from token ids
            _save_tokenizer(gguf_path, reader, tmp_dir)
        (tmp_dir / MARKER_FILE).write_text(json.dumps(
            {"converter_version": CONVERTER_VERSION, "source": str(gguf_path)}))
        if _is_complete(out_dir):   # a concurrent conversion finished first: keep the folder it may be reading
            return str(out_dir)
        if out_dir.exists():        # left by an older converter version
            shutil.rmtree(out_dir, ignore_errors=True)
        try:
            os.rename(tmp_dir, out_dir)
        except OSError:
            if not _is_complete(out_dir):   # not a concurrent conversion that won the race
                raise
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return str(out_dir)


# Linear layers whose Q4_0 / Q4_1 / Q8_0 blocks quantization="gguf" keeps (see quantization/gguf.py).
_LINEAR_SUFFIXES = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
                    "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")


def _linear_tensors(reader) -> list:
    return [t for t in reader.tensors if _BLOCK_RE.fullmatch(t.name) and t.name.endswith(_LINEAR_SUFFIXES)]


def gguf_quant_config(path: str):
    """The GGUFConfig for the file's linear weights, which must all share one kept type."""
    from minivllm.quantization.gguf import GGUFConfig
    reader = open_gguf(path)
    if _metadata(reader).get("general.architecture") != "llama":
        raise ValueError("quantization='gguf' supports llama-architecture GGUF files")
    types = sorted({t.tensor_type.name for t in _linear_tensors(reader)})
    if len(types) != 1:
        raise ValueError(f"quantization='gguf' needs one block type for all linear weights; this file mixes "
                         f"{types}; load without quantization to dequantize")
    return GGUFConfig(types[0])


def gguf_quantized_weights(path: str, weights_dir: str, config: dict):
    """HF-named tensors for a model with kept-quantized linears: those linears' qweight / scales
    (/ mins) straight from the GGUF blocks, everything else from the dequantized conversion."""
    from minivllm.quantization.gguf import held_tensors, unpack_blocks
    reader = open_gguf(path)
    held = set()
    for tensor in _linear_tensors(reader):
        match = _BLOCK_RE.fullmatch(tensor.name)
        prefix = f"model.layers.{match.group(1)}.{_BLOCK_NAMES[match.group(2)]}".removesuffix(".weight")
        codes, scales, mins = unpack_blocks(tensor.data, tensor.tensor_type.name, int(tensor.shape[0]))
        heads = {"attn_q.weight": "num_attention_heads", "attn_k.weight": "num_key_value_heads"}.get(match.group(2))
        if heads:   # llama.cpp's row permutation; each row's blocks move with it
            codes, scales = (unpermute_rows(a, config[heads]) for a in (codes, scales))
            mins = None if mins is None else unpermute_rows(mins, config[heads])
        for suffix, value in held_tensors(codes, scales, mins, tensor.tensor_type.name).items():
            yield f"{prefix}.{suffix}", value
        held.add(f"{prefix}.weight")
    with open_safetensors(Path(weights_dir) / "model.safetensors") as f:
        for name in f.keys():
            if name not in held:
                yield name, f.get_tensor(name)
