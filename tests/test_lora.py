"""Multi-LoRA on the real default model in fp32 (CPU), against transformers + PEFT: adapters of different ranks
and targets, mixed with each other and the base model in one batch, evicted and reloaded, never sharing KV."""
from __future__ import annotations

import copy
import json

import pytest
import torch

from minivllm import LLM, LoRARequest, SamplingParams
from minivllm.core.block_manager import BlockManager
from minivllm.core.scheduler import Scheduler, SchedulerConfig
from minivllm.core.sequence import SequenceGroup
from minivllm.lora import layers as lora_layers
from tests.test_engine import runner_logits

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name: (rank, alpha, targets, rsLoRA)
ADAPTERS = {"ad1": (8, 16, ALL, False), "ad2": (4, 8, ["q_proj", "v_proj"], True),
            "ad3": (16, 8, ["k_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], False),
            "ad4": (2, 4, ["q_proj", "k_proj", "up_proj"], False), "ad5": (8, 32, ["v_proj", "down_proj"], False)}
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    "]
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def peft_model(default_model_path):
    """transformers on the engine's own converted checkpoint, with the adapters above (non-zero random B)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from minivllm.models.gguf_loader import convert_gguf
    base = AutoModelForCausalLM.from_pretrained(convert_gguf(default_model_path), dtype=torch.float32).eval()
    model = None
    for name, (rank, alpha, targets, rslora) in ADAPTERS.items():
        config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora,
                            init_lora_weights=False)
        if model is None:
            model = get_peft_model(copy.deepcopy(base), config, adapter_name=name)
        else:
            model.add_adapter(name, config)
    generator = torch.Generator().manual_seed(0)
    for param_name, param in model.named_parameters():
        if "lora_B" in param_name:
            param.data = torch.randn(param.shape, generator=generator) * 0.1
    return model.eval()


@pytest.fixture(scope="module")
def adapter_dir(peft_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("adapters")
    peft_model.save_pretrained(str(folder), selected_adapters=list(ADAPTERS))
    return folder


def lora(adapter_dir, name: str) -> LoRARequest:
    return LoRARequest(name, list(ADAPTERS).index(name) + 1, str(adapter_dir / name))


@pytest.fixture(scope="module")
def llm():
    return LLM(kv_cache_memory=32 * 2**20, max_model_len=512, seed=0, enable_lora=True, max_loras=4,
               max_lora_rank=16, async_scheduling=True)


@pytest.fixture(scope="module")
def prompt_ids(llm):
    return [llm.get_tokenizer().encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def reference(peft_model, prompt_ids):
    """{adapter name or None: greedy tokens of each prompt} from transformers + PEFT."""
    refs = {}
    with torch.inference_mode():
        for name in [None, *ADAPTERS]:
            if name is None:
                context = peft_model.disable_adapter()
            else:
                peft_model.set_adapter(name)
                context = torch.inference_mode()
            with context:   # the eviction test uses the first prompt only
                refs[name] = [peft_model.generate(input_ids=torch.tensor([ids]), max_new_tokens=MAX_TOKENS,
                                                  do_sample=False, pad_token_id=0)[0, len(ids):].tolist()
                              for ids in (prompt_ids if name in (None, "ad1", "ad2", "ad3") else prompt_ids[:1])]
    assert len({tuple(map(tuple, r)) for r in refs.values()}) >= 4, "the adapters should change the outputs"
    return refs


def _tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_each_adapter_alone_matches_transformers_peft(llm, adapter_dir, prompt_ids, reference):
    assert all(m.stacked is not None for m in llm.llm_engine.runner.lora_manager.methods.values())
    for name in ["ad1", "ad2", "ad3"]:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], GREEDY, use_tqdm=False,
                               lora_request=lora(adapter_dir, name))
        assert _tokens(outputs) == reference[name], name


def test_a_batch_mixing_three_adapters_and_the_base_gives_each_its_own(llm, adapter_dir, prompt_ids, reference):
    names = [None, "ad1", "ad2", "ad3"] * len(prompt_ids)
    prompts = [{"prompt_token_ids": prompt_ids[i // 4]} for i in range(len(names))]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False,
                           lora_request=[None if n is None else lora(adapter_dir, n) for n in names])
    for i, (name, tokens) in enumerate(zip(names, _tokens(outputs))):
        assert tokens == reference[name][i // 4], (name, i)


def test_logits_match_peft(llm, adapter_dir, prompt_ids, peft_model):
    """A prefill and 8 decode steps through the runner under adapter ad3: logits within 1e-4 of PEFT's."""
    llm.llm_engine.add_lora(lora(adapter_dir, "ad3"))
    group = SequenceGroup("logits", None, prompt_ids[1], SamplingParams(temperature=0.0),
                          lora_request=lora(adapter_dir, "ad3"))
    ours, seq = runner_logits(llm.llm_engine, group, 8), group.seqs[0]
    peft_model.set_adapter("ad3")
    with torch.inference_mode():
        ref = peft_model(input_ids=torch.tensor([seq.token_ids[:-1]])).logits[0, len(prompt_ids[1]) - 1:]
    assert (ours - ref).abs().max().item() <= 1e-4 * max(1.0, ref.abs().max().item())


def test_prefix_cache_never_crosses_adapters(llm, adapter_dir, peft_model):
    """The same 40-token prompt under ad1, ad2, the base and ad1 again: only the repeat under ad1 hits the cache."""
    ids = llm.get_tokenizer().encode("Once upon a time, in a land far away, there lived a small dragon who " * 3)
    assert len(ids) > 2 * 16
    hits = []
    for name in ["ad1", "ad2", None, "ad1"]:
        out = llm.generate([{"prompt_token_ids": ids}], GREEDY, use_tqdm=False,
                           lora_request=None if name is None else lora(adapter_dir, name))[0]
        hits.append(out.num_cached_tokens)
        if name == "ad2":
            peft_model.set_adapter("ad2")
            with torch.inference_mode():
                ref = peft_model.generate(input_ids=torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                          pad_token_id=0)[0, len(ids):].tolist()
            assert out.outputs[0].token_ids == ref
    assert hits[:3] == [0, 0, 0] and hits[3] > 0


def test_block_hashes_include_the_adapter():
    bm = BlockManager(num_blocks=8, block_size=4)
    tokens = list(range(9))
    first = SequenceGroup("x", None, tokens, SamplingParams(), lora_request=LoRARequest("ad1", 1, "/a")).seqs[0]
    assert bm.allocate_slots(first, 9)
    first.num_computed_tokens = 9
    bm.cache_blocks(first)
    for lora_request, expected_hit in ((LoRARequest("ad2", 2, "/b"), 0), (None, 0), (LoRARequest("ad1", 1, "/a"), 8)):
        seq = SequenceGroup("y", None, tokens, SamplingParams(), lora_request=lora_request).seqs[0]
        assert bm.get_computed_blocks(seq)[1] == expected_hit


def test_scheduler_admits_no_more_adapters_than_slots():
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=32, max_loras=2),
                          BlockManager(num_blocks=32, block_size=4))
    ids = [1, 1, 2, 3, 0]
    for i, lora_id in enumerate(ids):
        request = LoRARequest(f"l{lora_id}", lora_id, "/x") if lora_id else None
        scheduler.add_seq_group(SequenceGroup(f"r{i}", None, [5, 6, 7], SamplingParams(), lora_request=request))
    output = scheduler.schedule()
    # Head of line: adapter 3 waits for a slot and so does the base request behind it.
    assert [s.lora_int_id for s in output.seqs] == [1, 1, 2]
    for seq in list(scheduler.running):
        if seq.lora_int_id == 2:
            scheduler.abort_request(seq.request_id)
    assert [s.lora_int_id for s in scheduler.schedule().seqs if s.num_computed_tokens == 3] == [3, 0]


def test_eviction_and_reload_with_two_slots_keep_outputs(adapter_dir, prompt_ids, reference, monkeypatch):
    """Also the separate shrink kernel's layout: no layer's A stacked under its weight here (the module's engine
    stacks them all)."""
    monkeypatch.setattr(lora_layers, "STACK_MAX_BYTES", 0)
    llm = LLM(kv_cache_memory=16 * 2**20, max_model_len=256, seed=0, enable_lora=True, max_loras=2,
              max_cpu_loras=2, max_lora_rank=16)
    assert not any(m.stacked is not None for m in llm.llm_engine.runner.lora_manager.methods.values())
    short = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for group in (["ad1", "ad2", "ad3", "ad4", "ad5"], [None, "ad5", "ad1", "ad3"]):   # more adapters than slots
        outputs = llm.generate([{"prompt_token_ids": prompt_ids[0]}] * len(group), short, use_tqdm=False,
                               lora_request=[None if n is None else lora(adapter_dir, n) for n in group])
        assert _tokens(outputs) == [reference[n][0][:4] for n in group]
    manager = llm.llm_engine.runner.lora_manager
    assert manager.num_slot_loads >= 7 and manager.num_disk_loads > 5 and len(manager.cpu_cache) == 2


def _bad_folder(adapter_dir, tmp_path, name: str, config_change=None, tensors_change=None):
    from safetensors.torch import load_file, save_file
    folder = tmp_path / name
    folder.mkdir()
    config = json.loads((adapter_dir / "ad1" / "adapter_config.json").read_text())
    config.update(config_change or {})
    (folder / "adapter_config.json").write_text(json.dumps(config))
    tensors = load_file(str(adapter_dir / "ad1" / "adapter_model.safetensors"))
    if tensors_change:
        tensors = tensors_change(tensors)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return str(folder)


def test_bad_adapters_are_refused_with_the_reason(llm, adapter_dir, prompt_ids, reference, tmp_path):
    first_key = lambda t: next(k for k in t if "q_proj.lora_A" in k)   # noqa: E731
    cases = [
        (str(tmp_path / "missing"), "does not exist"),
        (_bad_folder(adapter_dir, tmp_path, "save", {"modules_to_save": ["lm_head"]}), "modules_to_save"),
        (_bad_folder(adapter_dir, tmp_path, "rank", {"r": 32}), "exceeds max_lora_rank"),
        (_bad_folder(adapter_dir, tmp_path, "dora", {"use_dora": True}), "DoRA"),
        (_bad_folder(adapter_dir, tmp_path, "shape", tensors_change=lambda t: {
            **t, first_key(t): torch.zeros(8, 100)}), "the base model needs"),
        (_bad_folder(adapter_dir, tmp_path, "embed", tensors_change=lambda t: {
            **t, "base_model.model.model.embed_tokens.lora_A.weight": torch.zeros(8, 576)}), "cannot apply LoRA"),
    ]
    for i, (path, reason) in enumerate(cases):
        with pytest.raises(ValueError, match=reason):
            llm.generate([{"prompt_token_ids": prompt_ids[0]}], GREEDY, use_tqdm=False,
                         lora_request=LoRARequest(f"bad{i}", 100 + i, path))
    with pytest.raises(ValueError, match="already used"):
        llm.llm_engine.add_lora(LoRARequest("other", 1, str(adapter_dir / "ad2")))
    with pytest.raises(ValueError, match="positive"):
        LoRARequest("x", 0, "/x")
    out = llm.generate([{"prompt_token_ids": prompt_ids[0]}], GREEDY, use_tqdm=False,
                       lora_request=lora(adapter_dir, "ad1"))
    assert _tokens(out) == [reference["ad1"][0]]   # the engine still serves


def test_lora_request_without_enable_lora_is_refused():
    from minivllm.config import EngineConfig
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(enable_lora=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="max_cpu_loras"):
        EngineConfig(enable_lora=True, max_loras=4, max_cpu_loras=2)


@pytest.mark.gpu
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_gpu_mixed_batch_in_cuda_graphs_matches_peft(adapter_dir, prompt_ids, reference, enforce_eager):
    """The Triton kernels inside the decode and mixed CUDA graphs (fp32, so greedy tokens can match the CPU
    reference), with async scheduling, evicting under three slots."""
    llm = LLM(device="cuda", dtype="float32", max_model_len=512, seed=0, enable_lora=True, max_loras=3,
              max_lora_rank=16, gpu_memory_utilization=0.3, enforce_eager=enforce_eager)
    names = [None, "ad1", "ad2", "ad3"] * len(prompt_ids)
    prompts = [{"prompt_token_ids": prompt_ids[i // 4]} for i in range(len(names))]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False,
                           lora_request=[None if n is None else lora(adapter_dir, n) for n in names])
    assert _tokens(outputs) == [reference[n][i // 4] for i, n in enumerate(names)]
