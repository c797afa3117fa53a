"""LoRA adapters through the OpenAI server: the SDK streams from two adapters and the base model at once, each
getting what the offline API gives it; adapters load and unload at runtime; bad ones get a 400 with the reason
and the server stays healthy."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import httpx
import openai
import pytest

from bench.lora_bench import write_random_adapter
from minivllm import LLM, SamplingParams
from minivllm.engine.async_engine import AsyncEngine
from minivllm.lora.request import LoRARequest
from minivllm.server.api_server import ServerThread, build_app

PROMPT = "The three primary colors are"
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    llm = LLM(kv_cache_memory=16 * 2**20, max_model_len=256, seed=0, enable_lora=True, max_loras=2, max_lora_rank=8)
    folder = tmp_path_factory.mktemp("server_adapters")
    hf_config = llm.llm_engine.runner.hf_config
    paths = {"sql": write_random_adapter(folder / "sql", hf_config, 8, ["q_proj", "v_proj", "down_proj"], seed=1),
             "poet": write_random_adapter(folder / "poet", hf_config, 4, ["o_proj", "gate_proj", "up_proj"], seed=2)}
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    offline = {}
    for i, name in enumerate([None, "sql", "poet"]):
        request = None if name is None else LoRARequest(f"offline-{name}", 100 + i, paths[name])
        offline[name] = llm.generate([PROMPT], params, use_tqdm=False, lora_request=request)[0].outputs[0].text
    assert len(set(offline.values())) == 3, "each adapter should change the completion"
    engine = AsyncEngine(llm.llm_engine)
    thread = ServerThread(build_app(engine, "base", lora_modules=[("sql", paths["sql"])],
                                    allow_runtime_lora_updating=True))
    url = thread.start()
    yield SimpleNamespace(url=url, paths=paths, offline=offline, folder=folder)
    thread.stop()


def test_adapters_are_models_and_stream_concurrently_with_the_base(setup):
    models = {m["id"]: m for m in httpx.get(setup.url + "/v1/models").json()["data"]}
    assert models["sql"]["parent"] == "base" and models["base"].get("parent") is None
    response = httpx.post(setup.url + "/v1/load_lora_adapter",
                          json={"lora_name": "poet", "lora_path": setup.paths["poet"]})
    assert response.status_code == 200, response.text
    assert "poet" in {m["id"] for m in httpx.get(setup.url + "/v1/models").json()["data"]}

    client = openai.AsyncOpenAI(base_url=setup.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    async def stream(model: str) -> str:
        chunks = await client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0,
                                                 stream=True, extra_body={"ignore_eos": True})
        return "".join([c.choices[0].text async for c in chunks])

    async def together():
        return await asyncio.gather(*(stream(m) for m in ["base", "sql", "poet", "sql"]))
    texts = asyncio.run(together())
    assert texts == [setup.offline[None], setup.offline["sql"], setup.offline["poet"], setup.offline["sql"]]
    metrics = httpx.get(setup.url + "/metrics").text
    assert 'minivllm:lora_requests_info{max_lora="2"' in metrics


def test_runtime_unload_and_bad_adapters_keep_the_server_healthy(setup):
    broken = setup.folder / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 8, "modules_to_save": ["lm_head"]}))
    for body, status, reason in (
            ({"lora_name": "broken", "lora_path": str(broken)}, 400, "modules_to_save"),
            ({"lora_name": "missing", "lora_path": str(setup.folder / "nowhere")}, 400, "does not exist"),
            ({"lora_name": "sql", "lora_path": setup.paths["sql"]}, 400, "loaded already")):
        response = httpx.post(setup.url + "/v1/load_lora_adapter", json=body)
        assert response.status_code == status and reason in response.json()["error"]["message"], response.text
    assert httpx.get(setup.url + "/health").status_code == 200
    assert httpx.post(setup.url + "/v1/unload_lora_adapter", json={"lora_name": "nope"}).status_code == 404
    httpx.post(setup.url + "/v1/load_lora_adapter", json={"lora_name": "temp", "lora_path": setup.paths["poet"]})
    assert httpx.post(setup.url + "/v1/unload_lora_adapter", json={"lora_name": "temp"}).status_code == 200
    client = openai.OpenAI(base_url=setup.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="temp", prompt=PROMPT, max_tokens=2)
    reply = client.completions.create(model="sql", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0,
                                      extra_body={"ignore_eos": True})
    assert reply.choices[0].text == setup.offline["sql"]
