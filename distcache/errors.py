"""Typed errors raised by distcache.

Every error names what is wrong (the table, the field, the value) and what is allowed, so a user
can fix the input without reading distcache's source.
"""


class DistcacheError(Exception):
    """Base class of every error distcache raises on purpose."""


class DistcacheConfigError(DistcacheError, ValueError):
    """A configuration value is missing, of the wrong type, or out of its allowed range."""


class InvalidIdError(DistcacheError, IndexError):
    """A batch holds an id that is negative or not below its table's number of rows."""


class CacheCapacityError(DistcacheError, RuntimeError):
    """The cache cannot hold the rows that the batches in flight need at the same time.

    Raised before any state changes, so no update is lost: the cache can still be flushed.
    """


class LookaheadWindowError(DistcacheError, RuntimeError):
    """The look-ahead window was used out of order (too many batches enqueued, or none left)."""
