"""fullcg's exception types: every error fullcg raises on bad input names the problem and the fix.

Each type also subclasses the builtin a caller would expect (``ValueError`` for a bad
value, ``TypeError`` for a wrong type, ``RuntimeError`` for a bad state), so code that
catches the builtin keeps working. Messages put the problem and the fix on the first line.

Errors raised while ``torch.compile`` runs the fullcg backend would reach the user as
Dynamo's ``BackendCompilerFailed`` (first line ``backend='fullcg' raised:``);
:func:`through_dynamo` re-raises them as themselves instead.
"""

from __future__ import annotations

__all__ = [
    "FullCGError",
    "InvalidBatchError",
    "PageOutOfRangeError",
    "PageConflictError",
    "PageOwnershipError",
    "MetadataChangedError",
    "InvalidConfigError",
    "ConfigTypeError",
    "KVCacheError",
    "DtypeMismatchError",
    "OverlappingOutputError",
    "InferenceTensorError",
    "ImplementationUnavailableError",
    "through_dynamo",
]


class FullCGError(Exception):
    """Base of every error fullcg raises on bad input."""


class InvalidBatchError(FullCGError, ValueError):
    """A batch description (``AttentionMetadata``) that would compute wrong results or corrupt a cache."""


class PageOutOfRangeError(InvalidBatchError, IndexError):
    """A page id a request reads or writes is negative or past the KV cache's pages.

    Also an ``IndexError``: indexing past the cache is what it prevents.
    """


class PageConflictError(InvalidBatchError):
    """A page that a request writes is also used by another row of the batch (or twice by one)."""


class MetadataChangedError(InvalidBatchError):
    """Metadata whose fields no longer agree with each other (edited after ``build``)."""


class PageOwnershipError(FullCGError, RuntimeError):
    """Across steps: a request uses a page that another live request owns (see ``fullcg.PageOwnership``)."""


class InvalidConfigError(FullCGError, ValueError):
    """A configuration value out of its allowed range."""


class ConfigTypeError(FullCGError, TypeError):
    """A configuration value of the wrong type."""


class KVCacheError(FullCGError, ValueError):
    """A KV cache fullcg cannot use as given (layout, shape, dtype)."""


class DtypeMismatchError(FullCGError, TypeError):
    """Tensors whose dtypes must agree do not (for example q and the KV cache)."""


class OverlappingOutputError(FullCGError, ValueError):
    """``out`` shares memory with an input without being exactly that input."""


class InferenceTensorError(FullCGError, RuntimeError):
    """A KV cache made under ``torch.inference_mode`` written outside it."""


class RegionReuseError(FullCGError, RuntimeError):
    """Dynamo stamped a traced layer out for another layer with the first one's tensors
    (:mod:`fullcg.regions`); ``fullcg.compile`` traces the model again layer by layer."""


class ImplementationUnavailableError(FullCGError, ImportError):
    """An attention implementation that cannot be imported here (its package is missing)."""


_dynamo_types: dict[type, type] = {}


def through_dynamo(error: FullCGError) -> BaseException:
    """``error`` as an exception Dynamo lets through unwrapped (same type, same message).

    Dynamo wraps whatever a compile backend raises in ``BackendCompilerFailed`` except its
    own ``ShortenTraceback`` family; a subclass of both keeps ``isinstance(e, type(error))``
    and puts fullcg's message on the first line the user reads.
    """
    try:
        from torch._dynamo.exc import ShortenTraceback
    except ImportError:  # pragma: no cover - a torch without Dynamo never calls a backend
        return error
    cls = _dynamo_types.get(type(error))
    if cls is None:
        cls = _dynamo_types[type(error)] = type(
            type(error).__name__, (type(error), ShortenTraceback), {"__module__": type(error).__module__}
        )
    wrapped = cls.__new__(cls, *error.args)
    BaseException.__init__(wrapped, *error.args)
    wrapped.first_useful_frame = None
    return wrapped.with_traceback(error.__traceback__)
