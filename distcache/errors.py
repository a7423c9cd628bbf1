"""Typed errors raised by distcache.

Every error names what is wrong (the table, the field, the value) and what is allowed, so a user
can fix the input without reading distcache's source.
"""


class DistcacheError(Exception):
    """Base class of every error distcache raises on purpose."""


class DistcacheConfigError(DistcacheError, ValueError):
    """A configuration value is missing, of the wrong type, or out of its allowed range."""


class InvalidBatchError(DistcacheError, ValueError):
    """A batch (or a trace of batches) is malformed: ids of the wrong dtype or shape, offsets
    that do not match the ids, a feature count the module does not have."""


class UnsupportedError(DistcacheError, NotImplementedError):
    """A TorchRec feature that distcache's cached kernel does not support (yet); the message
    says which and what to use instead."""


class UnknownTableError(DistcacheError, KeyError):
    """A table name that the module does not hold; the message lists the ones it does."""


class InvalidIdError(DistcacheError, IndexError):
    """A batch holds an id that is negative or not below its table's number of rows."""


class NonFiniteError(DistcacheError, FloatingPointError):
    """Training produced a NaN or infinite loss or dense parameter; the job stops before it
    writes a checkpoint of that state."""


class CheckpointError(DistcacheError, RuntimeError):
    """A checkpoint cannot be used: its pointer (`latest.json`) or its files are missing or
    corrupt. The message names the path."""


class CacheCapacityError(DistcacheError, RuntimeError):
    """The cache cannot hold the rows that the batches in flight need at the same time.

    Raised before any state changes, so no update is lost: the cache can still be flushed.
    """


class LookaheadWindowError(DistcacheError, RuntimeError):
    """The look-ahead window was used out of order (too many batches enqueued, or none left)."""
