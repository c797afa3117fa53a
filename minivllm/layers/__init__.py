"""Building blocks of the models: linear layers with per-parameter weight loaders, embedding and LM
head, RMSNorm, rotary embedding, activation, the attention layer (KV store -> backend), and the sampler.
Layers know nothing about sequences or scheduling; attention reads its metadata from the forward context."""
