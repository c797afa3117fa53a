"""The router in front of two live CPU servers (the default model, each its own process).

Affinity: requests sharing a long prefix go to one replica, whose prefix cache then hits; requests
with another prefix go to the other replica (the policy spreads load, then sticks to where a prefix
is cached). Failure: a replica killed in the middle of a request fails that request with an OpenAI
error, gets no new requests, and requests keep succeeding on the other replica.
"""
from __future__ import annotations

import re
import threading
import time

import httpx
import pytest

from minivllm.cli import serve_specs
from minivllm.router.app import BACKEND_HEADER, build_router_app
from minivllm.router.launcher import replica_argv, start_servers, stop_replicas
from minivllm.router.policy import PrefixAffinityPolicy, Replica
from minivllm.server.api_server import ServerThread

PREFIX_A = ("You are a meticulous assistant for a shipping company. Always answer with the tracking number "
            "first, then a short summary of the shipment status, then any delays and their causes. ")
PREFIX_B = ("Translate the following sentence from English into French, keeping the tone informal and the "
            "meaning exact, and do not add any explanation of your own afterwards at all. ")


@pytest.fixture(scope="module")
def cluster():
    """Two servers started by the launcher (`minivllm router --serve ARGS --serve ARGS`), both serving the
    default model as `smol`, one also as `a` and the other as `b`, and the router in front."""
    common = "--kv-cache-memory 32MiB --max-model-len 512 --uvicorn-log-level warning"
    specs = serve_specs([f"--served-model-name smol a {common}", f"--served-model-name smol b {common}"])
    urls, procs = start_servers(specs, startup_timeout_s=240)
    try:
        thread = ServerThread(build_router_app(urls, health_interval=0.5))
        router = thread.start()
        yield urls, procs, router
        thread.stop()
    finally:
        stop_replicas(procs)
        assert all(p.poll() is not None for p in procs)


def _prefix_cache_hits(url: str) -> float:
    text = httpx.get(url + "/metrics").text
    return float(re.search(r"^minivllm:prefix_cache_hits(?:_total)?(?:\{[^}]*\})? (\S+)$", text, re.M).group(1))


def _complete(router: str, prompt: str, max_tokens: int = 2, **extra) -> httpx.Response:
    return httpx.post(router + "/v1/completions", timeout=120, json={
        "model": "smol", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra})


def test_policy_prefers_the_prefix_owner_until_it_is_far_busier():
    a, b = Replica("a"), Replica("b")
    policy = PrefixAffinityPolicy([a, b], chunk_chars=8, max_imbalance_tokens=100)
    hashes = policy.prefix_hashes("m", "x" * 40)
    policy.record(b, hashes)
    assert policy.choose("m", hashes) is b
    assert policy.choose("m", policy.prefix_hashes("m", "y" * 40)) is a   # unknown prefix: tie, fewest served
    b.outstanding_tokens = 101
    assert policy.choose("m", hashes) is a                              # affinity yields to load
    b.healthy = False
    b.outstanding_tokens = 0
    assert policy.choose("m", hashes) is a


def test_replica_argv_replaces_dp_host_and_port():
    argv = ["serve", "m", "--data-parallel-size", "2", "--port=9000", "--host", "0.0.0.0", "-tp", "2"]
    assert replica_argv(argv, 1234) == ["serve", "m", "-tp", "2", "--host", "127.0.0.1", "--port", "1234"]
    specs = serve_specs(["m --served-model-name a -tp 2 -dp 2", "n"])   # GPUs each server takes
    assert [n for _, n in specs] == [2, 2, 1] and specs[2][0] == ["serve", "n"]


def test_shared_prefixes_stick_to_one_replica_and_hit_its_cache(cluster):
    urls, _, router = cluster
    hits_before = [_prefix_cache_hits(u) for u in urls]
    served: dict[str, set[str]] = {"A": set(), "B": set()}
    for i, key in enumerate("AABBABAB"):
        response = _complete(router, (PREFIX_A if key == "A" else PREFIX_B) + f"Question {i}: where is it?")
        assert response.status_code == 200, response.text
        served[key].add(response.headers[BACKEND_HEADER])
    assert len(served["A"]) == 1 and len(served["B"]) == 1 and served["A"] != served["B"]
    for url, before in zip(urls, hits_before):
        assert _prefix_cache_hits(url) >= before + 3 * 32   # 3 repeats of a prefix of >= 2 blocks each
    # Streaming passes through chunk by chunk and keeps the affinity.
    with httpx.stream("POST", router + "/v1/completions", timeout=120, json={
            "model": "smol", "prompt": PREFIX_A + "Stream it.", "max_tokens": 4, "stream": True}) as stream:
        assert stream.headers[BACKEND_HEADER] in served["A"]
        events = [line for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) >= 3
    assert _complete(router, "Hi", model="nope").status_code == 404


def test_requests_route_by_model_name(cluster):
    urls, _, router = cluster
    names = {card["id"] for card in httpx.get(router + "/v1/models").json()["data"]}
    assert names == {"smol", "a", "b"}
    for _ in range(2):   # whatever the load or the prefix, a model goes where it is served
        for model, url in (("a", urls[0]), ("b", urls[1])):
            response = _complete(router, PREFIX_A + "Which model?", model=model)
            assert response.status_code == 200 and response.headers[BACKEND_HEADER] == url


def test_killed_replica_fails_its_request_and_the_other_keeps_serving(cluster):
    urls, procs, router = cluster
    owner = _complete(router, PREFIX_A + "Warm up.").headers[BACKEND_HEADER]
    victim = urls.index(owner)
    result = {}
    long_request = threading.Thread(target=lambda: result.setdefault("r", _complete(
        router, PREFIX_A + "Tell a very long story.", max_tokens=400, ignore_eos=True)))
    long_request.start()
    time.sleep(2.0)   # the request is decoding on its prefix's replica
    procs[victim].kill()
    long_request.join(60)
    response = result["r"]
    assert response.status_code == 502, response.text
    assert response.json()["error"]["code"] == "backend_failed"
    for i in range(4):   # including the prefix the dead replica owned
        response = _complete(router, (PREFIX_A if i % 2 else PREFIX_B) + f"After the crash {i}.")
        assert response.status_code == 200, response.text
        assert response.headers[BACKEND_HEADER] == urls[1 - victim]
    metrics = httpx.get(router + "/metrics").text
    assert f'minivllm_router:backend_healthy{{backend="{urls[victim]}"}} 0' in metrics
    assert httpx.get(router + "/health").status_code == 200
