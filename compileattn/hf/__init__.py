"""Serve transformers causal LMs with compileattn: the registered attention function, the model
adapter and loading. Imports transformers on use, so ``import compileattn`` does not need it."""
