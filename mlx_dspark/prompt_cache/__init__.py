"""The prompt cache: a session's state kept after a prompt so that a later prompt sharing its
prefix continues from it, in memory (``memory``) and on disk (``disk``), behind one
:class:`PromptCache` (``cache``)."""

from .cache import PromptCache

__all__ = ["PromptCache"]
