"""The model runner: the single place where sequences become tensors."""
