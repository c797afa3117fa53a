"""The live dashboard in a real browser: headless Chromium (Debian's) driven by Selenium against a live
CPU server under load with a KV pool small enough to preempt. The page must show the KV grid and the
queues changing; a screenshot is saved to docs/dashboard.png. Also: the engine's snapshot is plain data
that agrees with the block manager, and /dashboard/snapshot serves it.

Chromium is a required test dependency (scripts/setup.sh installs it where it can): when it is
missing this test fails, it does not skip.
"""
from __future__ import annotations

import asyncio
import shutil
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from minivllm.config import EngineConfig
from minivllm.core.block_manager import BlockManager
from minivllm.engine.async_engine import AsyncEngine
from minivllm.server.api_server import ServerThread, build_app
from tests.test_block_manager import make_seq

SCREENSHOT = Path(__file__).resolve().parent.parent / "docs" / "dashboard.png"
SYSTEM = "You are a helpful assistant. Answer briefly and precisely. " * 3  # a shared prefix: cache hits


@pytest.fixture(scope="module")
def server():
    # ~30 blocks of 16 tokens for 12 running requests of ~100 tokens each (and 4 more waiting): preemption
    # all the time.
    engine = AsyncEngine.from_config(EngineConfig(kv_cache_memory=22 << 20, max_model_len=128, max_num_seqs=12))
    with ServerThread(build_app(engine)) as url:
        yield url, engine


class Load:
    """Concurrent completions with a shared prefix, from a background thread, until stopped."""

    def __init__(self, url: str, concurrency: int = 16) -> None:
        self.url, self.concurrency = url, concurrency
        self.stop = threading.Event()
        self.statuses: Counter = Counter()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _run(self) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=120) as client:
            async def worker(k: int) -> None:
                i = 0
                while not self.stop.is_set():
                    body = {"prompt": f"{SYSTEM} Question {k}.{i}: name a color.", "max_tokens": 24 + 8 * (k % 4),
                            "temperature": 0.8, "ignore_eos": True, "priority": 0}
                    response = await client.post("/v1/completions", json=body)
                    self.statuses[response.status_code] += 1
                    i += 1
            await asyncio.gather(*(worker(k) for k in range(self.concurrency)))

    def __enter__(self) -> Load:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(120)


def browser():
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    assert chromium and driver_path, ("Chromium and chromedriver are required for the dashboard test: install "
                                      "Debian's `chromium chromium-driver` (scripts/setup.sh does as root)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 "--window-size=1440,900", "--hide-scrollbars"):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(driver_path), options=options)


def test_block_manager_snapshot_codes():
    """One character per block: ref count (shared after a fork), free, and free-but-cached after a free."""
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = make_seq(range(10))
    assert bm.allocate_slots(parent, 10)
    parent.num_computed_tokens = 10
    bm.cache_blocks(parent)  # two full blocks get hashes
    child = parent.fork(index=1)
    bm.fork(parent, child)
    snapshot = bm.snapshot()
    assert snapshot["blocks"] == "222....." and snapshot["num_shared"] == 3 and snapshot["num_free"] == 5
    bm.free(parent)
    bm.free(child)
    assert bm.snapshot()["blocks"] == "cc......" and bm.snapshot()["num_cached"] == 2


def test_snapshot_is_plain_data_that_matches_the_pool(server):
    url, engine = server
    with Load(url, concurrency=4):
        time.sleep(2.0)
        body = httpx.get(url + "/dashboard/snapshot", timeout=30).json()
    kv = body["snapshot"]["kv"]
    assert len(kv["blocks"]) == kv["num_blocks"] and set(kv["blocks"]) <= set(".c123456789")
    assert kv["blocks"].count(".") + kv["blocks"].count("c") == kv["num_free"]
    assert {"running", "waiting", "preempted", "num_running"} <= set(body["snapshot"]["scheduler"])
    for entry in body["snapshot"]["scheduler"]["running"]:
        assert entry["num_blocks"] * kv["block_size"] >= entry["computed_tokens"] > 0


@pytest.mark.long
def test_dashboard_in_headless_chromium(server):
    url, engine = server
    driver = browser()
    try:
        with Load(url) as load:
            driver.get(url + "/dashboard")
            seen_blocks, seen_running, seen_rows = set(), set(), 0
            deadline = time.monotonic() + 60
            shot = False
            while time.monotonic() < deadline:
                state = driver.execute_script("return window.dashboardState")
                if state["blocks"]:
                    seen_blocks.add(state["blocks"])
                    seen_running.add(state["running"])
                    seen_rows = max(seen_rows, state["rows"])
                # Screenshot once the page has history and the pool is busy.
                if not shot and state["updates"] > 100 and state["running"] > 2 and state["blocks"].count(".") < 10:
                    SCREENSHOT.parent.mkdir(exist_ok=True)
                    driver.save_screenshot(str(SCREENSHOT))
                    shot = True
                if shot and len(seen_blocks) >= 5 and len(seen_running) >= 2:
                    break
                time.sleep(0.2)
            assert engine.snapshot_subscribers == 1  # the page's event stream
        assert shot, "the pool never got busy enough for the screenshot"
        assert len(seen_blocks) >= 5, "the KV grid did not change"
        assert len(seen_running) >= 2 and seen_rows > 0, "the queues did not change"
        assert set(load.statuses) == {200}, load.statuses
        assert SCREENSHOT.stat().st_size > 10_000
    finally:
        driver.quit()
