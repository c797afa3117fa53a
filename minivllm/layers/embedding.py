"""Token embedding and LM head. The head may share its weight with the embedding (tied embeddings,
e.g. SmolLM2, Qwen2.5-0.5B); then the checkpoint has no separate `lm_head.weight` to load."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.layers.linear import default_weight_loader


class VocabParallelEmbedding(nn.Module):
    """Embedding table [vocab, hidden]; the vocabulary dimension is what tensor parallelism would split."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class ParallelLMHead(VocabParallelEmbedding):
    """hidden [S, hidden] -> logits [S, vocab], in the model dtype."""

    def __init__(self, num_embeddings: int, embedding_dim: int, bias: bool = False):
        super().__init__(num_embeddings, embedding_dim)
        if bias:
            self.bias = nn.Parameter(torch.empty(num_embeddings), requires_grad=False)
            self.bias.weight_loader = default_weight_loader
        else:
            self.register_parameter("bias", None)

    def tie_weights(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden_states, self.weight, self.bias)
