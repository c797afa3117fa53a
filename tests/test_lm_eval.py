"""lm-evaluation-harness against a live server: its `local-completions` model scores a task written here from
real text (loglikelihood and generate_until); its loglikelihoods must equal the engine's offline
`prompt_logprobs` (fp32, 1e-4) and transformers' (1e-3)."""
from __future__ import annotations

import json

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.engine.async_engine import AsyncEngine
from minivllm.server.api_server import ServerThread, build_app

# Opening sentences of public-domain books, split into a context and the words that follow.
DOCS = [
    ("It is a truth universally acknowledged, that a single man in possession of a good fortune,",
     " must be in want of a wife."),
    ("It was the best of times, it was the worst of times, it was the age of wisdom,",
     " it was the age of foolishness."),
    ("Call me Ishmael. Some years ago, never mind how long precisely, having little or no money in my purse,",
     " I thought I would sail about a little."),
    ("Happy families are all alike;", " every unhappy family is unhappy in its own way."),
    ("In the beginning God created", " the heaven and the earth."),
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lm_eval_tasks")
    with open(folder / "docs.jsonl", "w") as f:
        for context, continuation in DOCS:
            f.write(json.dumps({"context": context, "continuation": continuation}) + "\n")
    common = (f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {folder / 'docs.jsonl'}\n"
              "test_split: test\ndoc_to_text: \"{{context}}\"\ndoc_to_target: \"{{continuation}}\"\n")
    (folder / "ll.yaml").write_text("task: minivllm_ll\noutput_type: loglikelihood\n" + common
                                    + "metric_list:\n  - metric: acc\n")
    (folder / "gen.yaml").write_text("task: minivllm_gen\noutput_type: generate_until\n" + common
                                     + "generation_kwargs:\n  until: [\".\"]\n  max_gen_toks: 8\n"
                                     + "metric_list:\n  - metric: exact_match\n")
    llm = LLM(kv_cache_memory=64 << 20, max_model_len=1024, dtype="float32")
    return folder, llm


@pytest.mark.long
def test_lm_eval_local_completions_matches_offline_and_transformers(setup, hf_model):
    import lm_eval
    from lm_eval.tasks import TaskManager
    folder, llm = setup
    tokenizer = llm.get_tokenizer()
    # lm-eval's own split: encode context + continuation whole, the continuation is what follows the context.
    pairs = []
    for context, continuation in DOCS:
        context_ids = tokenizer(context, add_special_tokens=False).input_ids
        whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
        pairs.append((whole, len(context_ids)))
    offline = llm.generate([{"prompt_token_ids": ids} for ids, _ in pairs],
                           SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0.0), use_tqdm=False)
    offline_ll = [sum(o.prompt_logprobs[p][ids[p]].logprob for p in range(n, len(ids)))
                  for o, (ids, n) in zip(offline, pairs)]
    with torch.inference_mode():
        reference_ll = []
        for ids, n in pairs:
            logprobs = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
            reference_ll.append(sum(logprobs[p - 1, ids[p]].item() for p in range(n, len(ids))))

    from minivllm.models.loader import resolve_model
    thread = ServerThread(build_app(AsyncEngine(llm.llm_engine)))
    url = thread.start()
    try:
        results = lm_eval.simple_evaluate(
            model="local-completions",
            model_args={"model": llm.llm_engine.model_name, "base_url": f"{url}/v1/completions",
                        "tokenizer": resolve_model(None).tokenizer_dir, "num_concurrent": 1, "max_retries": 1},
            tasks=["minivllm_ll", "minivllm_gen"], task_manager=TaskManager(include_path=str(folder)),
            log_samples=True)
    finally:
        thread.stop()
    samples = sorted(results["samples"]["minivllm_ll"], key=lambda s: s["doc_id"])
    served_ll = [s["resps"][0][0][0] for s in samples]
    assert len(served_ll) == len(DOCS)
    assert served_ll == pytest.approx(offline_ll, abs=1e-4)
    assert served_ll == pytest.approx(reference_ll, abs=1e-3)
    generations = sorted(results["samples"]["minivllm_gen"], key=lambda s: s["doc_id"])
    assert len(generations) == len(DOCS) and all(isinstance(s["resps"][0][0], str) for s in generations)
