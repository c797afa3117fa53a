"""Speculative decoding on the GPU: verify steps replay the mixed-step CUDA graphs through the Triton
varlen kernel and draft steps run the decode kernel; greedy output equals plain decoding (fp32)."""
from __future__ import annotations

import pytest
import torch

from minivllm import LLM, SamplingParams
from tests.conftest import make_tiny_hf_checkpoint

pytestmark = pytest.mark.gpu

CONFIGS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "adaptive": False},
    "draft_layers": {"method": "draft_model", "draft_layers": 1, "num_speculative_tokens": 3, "adaptive": False},
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fp32_greedy_identical_with_speculation(name, tmp_path):
    make_tiny_hf_checkpoint(tmp_path, "llama3")
    g = torch.Generator().manual_seed(2)
    phrase = torch.randint(3, 128, (6,), generator=g).tolist()
    prompts = [phrase * 5 + torch.randint(3, 128, (n,), generator=g).tolist() for n in (3, 17, 40)]
    options = dict(dtype="float32", skip_tokenizer_init=True, gpu_memory_utilization=0.3, max_model_len=256,
                   max_num_seqs=8)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    plain = LLM(model=str(tmp_path), **options).generate([{"prompt_token_ids": p} for p in prompts], params,
                                                         use_tqdm=False)
    llm = LLM(model=str(tmp_path), speculative_config=CONFIGS[name], **options)
    assert llm.llm_engine.runner.graph_runner is not None
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in plain]
    assert llm.llm_engine.get_stats().spec_decode.num_draft_tokens > 0
    assert llm.llm_engine.block_manager.num_free_blocks == llm.llm_engine.block_manager.num_blocks
