"""The type of a refusal by design: these arguments, or this model, cannot be served, and why.

Some mistakes in what a caller asks for can only be seen while the LLM is built: a
``max_model_len`` longer than the cache that the given ``num_blocks`` hold, a memory budget that
holds no block, a checkpoint whose weights do not match its config.json, a config.json that
transformers refuses, a model or a layer configuration no attention backend runs. Their checks
raise ``ServingRefused`` (or a subclass of it), with the reason as the message. A caller tells such
a refusal of its input from a failure of the build by type, never by message: the command line
refuses a ``ServingRefused`` out of ``LLM(...)`` as the user's mistake (exit status 2, no
traceback), and lets any other exception, a plain ValueError included, keep its traceback.

A ValueError, so that a caller that catches a ValueError for a bad argument still does. Imports
nothing of the package, so that any module may raise it.
"""
from __future__ import annotations


class ServingRefused(ValueError):
    """These arguments, or this model, cannot be served; the message says why. Raised on purpose by
    a check of the caller's input (never for a bug): see the module docstring."""


class UnsupportedModelError(ServingRefused):
    """A model (or one of its layers) compileattn cannot serve correctly; the message says why.
    Defined here, not beside the Hugging Face loader that raises most of them, so that the
    tensor-parallel sharding (``parallel.shard``) refuses a model it cannot shard with the same type
    without importing the loader."""
