"""Exceptions raised by ``shm``. Codec errors are plain ``ValueError``."""


class ShmHandleError(ValueError):
    """A handle does not lead to the data it names.

    Raised for a segment that is missing (released, reaped, never created), foreign (not written
    by atb-plugin, or written by another instance than the one expected), not yet committed,
    corrupted, or whose header disagrees with the decoded shape / dtype. The message names the
    segment and both sides of any mismatch. Readers never substitute zeros for the data.
    """


class ShmStoreFullError(RuntimeError):
    """The store (or ``/dev/shm`` itself) has no room for a new segment right now.

    Transient: it clears as requests finish and release their leases.
    """
