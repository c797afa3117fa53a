"""minivllm: a small, readable LLM inference engine and OpenAI-compatible server."""
from minivllm.lora.request import LoRARequest
from minivllm.outputs import CompletionOutput, Logprob, RequestOutput
from minivllm.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "LoRARequest", "RequestOutput", "CompletionOutput", "Logprob", "__version__"]


def __getattr__(name: str):
    # The engine pulls in torch and transformers; import it only when asked for.
    if name == "LLM":
        from minivllm.engine.llm import LLM
        return LLM
    raise AttributeError(name)
