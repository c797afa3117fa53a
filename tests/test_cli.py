"""The `minivllm` command line: vLLM's flag names reach EngineConfig, with per-command defaults."""
import pytest

from minivllm.cli import build_parser, engine_config_from_args


def config_for(*argv):
    return engine_config_from_args(build_parser().parse_args(list(argv)))


def test_vllm_flag_names_reach_the_engine_config():
    config = config_for("serve", "llama-3-8b", "--load-format", "dummy", "--max-num-seqs", "32",
                        "--max-num-batched-tokens", "2048", "--no-enable-prefix-caching", "--dtype", "half",
                        "--gpu-memory-utilization", "0.5", "--kv-cache-memory", "64MiB", "-tp", "1")
    assert (config.model, config.load_format, config.max_num_seqs, config.max_num_batched_tokens) == (
        "llama-3-8b", "dummy", 32, 2048)
    assert (config.enable_prefix_caching, config.dtype, config.gpu_memory_utilization) == (False, "float16", 0.5)
    assert config.kv_cache_memory == 64 * 2 ** 20


def test_small_batch_prefill_is_on_when_serving_and_off_offline():
    assert config_for("serve").small_batch_prefill_tokens == 512
    assert config_for("serve", "--small-batch-prefill-tokens", "256").small_batch_prefill_tokens == 256
    assert config_for("serve", "--small-batch-prefill-tokens", "0").small_batch_prefill_tokens is None
    assert config_for("generate", "hello").small_batch_prefill_tokens is None


def test_speculative_config_flag_takes_vllm_json_and_names_what_is_wrong(capsys):
    config = config_for("serve", "--speculative-config", '{"method": "suffix", "num_speculative_tokens": 8}')
    assert config.speculative_config == {"method": "suffix", "num_speculative_tokens": 8}
    for text, reason in (("{method: suffix}", "not JSON"), ('["suffix"]', "not a JSON object")):
        with pytest.raises(SystemExit):
            config_for("serve", "--speculative-config", text)
        assert f"--speculative-config: {reason}" in capsys.readouterr().err
    with pytest.raises(ValueError, match="speculative method must be one of"):
        config_for("serve", "--speculative-config", '{"method": "tree"}')


def test_python_dash_m_runs_the_console_script():
    import subprocess
    import sys
    result = subprocess.run([sys.executable, "-m", "minivllm", "serve", "--help"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0
    assert "usage: minivllm serve" in result.stdout and "--max-num-seqs" in result.stdout
