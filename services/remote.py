"""The one mechanism behind every RPC surface: services, their remote methods, and calls by method.

A service is a class whose methods marked ``@remote`` other members may call. The process that
hosts one ``serve``s an instance; a caller names the method object itself::

    class PsSurface(Service):
        @remote
        def lookup(self, param: str, ids: torch.Tensor) -> torch.Tensor: ...

    rows = call("ps1", PsSurface.lookup, param, ids)      # on a trainer

torch RPC pickles the method by its qualified name (as the seed's ``_remote_method`` did), so grep
and an IDE lead from every call to the code that serves it. On the callee, ``_invoke``:

* finds the served instance of the method's class (``NotReady`` while there is none) and calls the
  method on it, so a subclass's override runs;
* refuses anything not marked ``@remote`` and checks the arguments against the method's signature
  and type hints (pydantic, strict): the caller's mistake is a ``BadRequest``;
* lets a domain error (``services/errors.py``) through as it is, and reports any other exception,
  which is a bug on this side, as ``InternalError`` with its traceback in this process's log.

Only this module calls ``rpc_async``; membership's bootstrap (``services/membership.py``) and the
seed baseline (``trainer/lm/bench_seed.py``) are the only other raw RPC users.
"""
from __future__ import annotations

import ast
import functools
import inspect
import logging
import sys
import threading
import time
import typing
from dataclasses import dataclass
from typing import Any, Callable, Optional, TypeVar

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from pydantic import ConfigDict, TypeAdapter, ValidationError

from services import errors
from services.errors import BadRequest, InternalError, NotReady, RpcpsError, Superseded

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")

_STRICT = ConfigDict(strict=True, arbitrary_types_allowed=True)
_DOMAIN_ERRORS = {cls.__name__: cls for cls in vars(errors).values()
                  if isinstance(cls, type) and issubclass(cls, RpcpsError)}


def remote(fn: Optional[F] = None, *, asynchronous: bool = False) -> Any:
    """Mark a method as callable from other members. ``asynchronous``: it returns a
    ``torch.futures.Future``, answered when that completes (``rpc.functions.async_execution``)."""
    def mark(f: F) -> F:
        f.__rpcps_remote__ = asynchronous  # type: ignore[attr-defined]
        return f
    return mark(fn) if fn is not None else mark


def is_remote(method: Any) -> bool:
    return callable(method) and hasattr(method, "__rpcps_remote__")


def remote_methods(cls: type) -> list[str]:
    """The names of ``cls``'s remote methods (its RPC surface), in definition order."""
    seen: dict[str, None] = {}
    for klass in reversed(cls.__mro__):
        for name, value in vars(klass).items():
            if is_remote(value):
                seen[name] = None
    return list(seen)


class Service:
    """Base of a class with remote methods: hooks that ``_invoke`` runs around each call."""

    def before_call(self, caller: str, method: str, version: int = 0) -> None:
        """On the RPC thread, before the arguments are checked. ``version``: what the caller's
        view of the service's state is as of, as the caller sent it (0: it sent none); the
        parameter servers take their layout's epoch this way."""

    def after_call(self, method: str, seconds: float, ok: bool) -> None:
        """After the method returned (``ok``) or raised, bad requests included."""

    def superseded(self, caller: str, method: str) -> None:
        """A request of an old incarnation of ``caller`` was refused (``Superseded``)."""


class _Hosted:
    """What this process serves, by class: the one process-wide registry RPC entry points read.

    torch calls a module-level function on an RPC thread, so the object it acts on must be
    reachable from module scope; this is that, for every service, behind one lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_class: dict[type, object] = {}

    def serve(self, instance: object) -> None:
        """Serve ``instance`` as its class and as every base class that declares remote methods."""
        kind = type(instance)
        with self._lock:
            for cls in kind.__mro__:
                if cls is kind or any(is_remote(v) for v in vars(cls).values()):
                    self._by_class[cls] = instance

    def withdraw(self, instance: object) -> None:
        with self._lock:
            for cls in [c for c, i in self._by_class.items() if i is instance]:
                del self._by_class[cls]

    def get(self, cls: type[T]) -> T:
        with self._lock:
            found = self._by_class.get(cls)
        if found is None:
            raise NotReady(f"this process serves no {cls.__name__} (yet)")
        return found  # type: ignore[return-value]


_HOSTED = _Hosted()
serve = _HOSTED.serve
withdraw = _HOSTED.withdraw
local = _HOSTED.get


# --- the callee ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Signature:
    """A remote method's parameters after ``self``, as RPC passes them: positionally."""

    owner: type
    names: tuple[str, ...]                       # the named parameters, in order
    required: int                                # how many of them have no default
    rest: Optional[str]                          # the *args parameter's name, if any
    adapters: tuple[Optional[TypeAdapter], ...]  # per named parameter (None: any value)
    rest_adapter: Optional[TypeAdapter]


@functools.lru_cache(maxsize=None)
def _signature(method: Callable[..., Any]) -> _Signature:
    module = sys.modules[method.__module__]
    owner: Any = module
    for part in method.__qualname__.split(".")[:-1]:
        owner = getattr(owner, part)
    hints = typing.get_type_hints(method, vars(module))
    params = list(inspect.signature(method).parameters.values())[1:]
    named = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    rest = next((p.name for p in params if p.kind is p.VAR_POSITIONAL), None)

    def adapter(name: Optional[str]) -> Optional[TypeAdapter]:
        hint = hints.get(name) if name else None
        return None if hint is None or hint is Any else TypeAdapter(hint, config=_STRICT)
    return _Signature(owner, tuple(p.name for p in named), sum(p.default is p.empty for p in named), rest,
                      tuple(adapter(p.name) for p in named), adapter(rest))


def _checked(method: Callable[..., Any], args: tuple) -> list[Any]:
    """``args`` as the method takes them, or ``BadRequest`` saying what is wrong. (By hand rather
    than ``inspect.Signature.bind``: this runs on every call, and binding costs as much as the rest.)"""
    sig = _signature(method)
    if len(args) < sig.required:
        raise BadRequest(f"{method.__name__}: missing a required argument: {sig.names[len(args)]!r}")
    if len(args) > len(sig.names) and sig.rest is None:
        raise BadRequest(f"{method.__name__}: too many positional arguments ({len(args)} for {len(sig.names)})")
    values: list[Any] = []
    for i, value in enumerate(args):
        named = i < len(sig.names)
        adapter = sig.adapters[i] if named else sig.rest_adapter
        if adapter is not None:
            try:
                value = adapter.validate_python(value)
            except ValidationError as exc:
                problem = exc.errors()[0]
                where = "".join(f"[{p}]" for p in problem["loc"])
                name = sig.names[i] if named else f"{sig.rest}[{i - len(sig.names)}]"
                raise BadRequest(f"{method.__name__}: {name}{where}: {problem['msg']}, "
                                 f"got {describe(problem['input'])}") from None
        values.append(value)
    return values


def _invoke(method: Callable[..., Any], caller: str, rank: int, *args: Any, version: int = 0) -> Any:
    """The one RPC entry point: ``method`` of this process's service, checked, timed and guarded.
    ``rank``: the caller's in the group, its incarnation (ranks are never reused: a member started
    again under its name joins with a newer one); ``version``: handed to the service's
    ``before_call``."""
    if not is_remote(method):
        raise BadRequest(f"{getattr(method, '__qualname__', method)!r} is not a remote method")
    service = local(_signature(method).owner)
    name = method.__name__
    hooks = service if isinstance(service, Service) else None
    if not _current(caller, rank):
        # A fencing token: a member declared lost and replaced, or evicted, may still run (frozen,
        # cut off); whatever it sends now must not land.
        if hooks is not None:
            hooks.superseded(caller, name)
        raise Superseded(f"{name} from {caller} of rank {rank} refused: no longer a member of that name in this "
                         f"group (evicted, or replaced by a newer start)")
    if hooks is not None:
        hooks.before_call(caller, name, version)
    started, ok = time.perf_counter(), False
    try:
        result = getattr(service, name)(*_checked(method, args))
        ok = True
        return result
    except BadRequest as exc:
        log.warning("bad %s request from %s: %s", name, caller, exc)
        raise
    except RpcpsError:
        raise
    except Exception as exc:
        log.exception("%s failed on a request from %s", method.__qualname__, caller)
        raise InternalError(f"{method.__qualname__} failed: {type(exc).__name__}: {exc}") from None
    finally:
        if hooks is not None:
            hooks.after_call(name, time.perf_counter() - started, ok)


def _current(caller: str, rank: int) -> bool:
    """Whether ``rank`` is the member named ``caller`` in this process's view of the group."""
    try:
        return rpc.get_worker_info(caller).id == rank
    except RuntimeError:            # no member of that name: it was evicted
        return False


@rpc.functions.async_execution
def _invoke_async(method: Callable[..., Any], caller: str, rank: int, *args: Any,
                  version: int = 0) -> torch.futures.Future:
    """``_invoke`` for methods that answer with a future."""
    try:
        return _invoke(method, caller, rank, *args, version=version)
    except Exception as exc:  # noqa: BLE001 - returned as the future's error, like any other answer
        failed: torch.futures.Future = torch.futures.Future()
        failed.set_exception(exc)
        return failed


# --- the caller ------------------------------------------------------------------------------------
def call_async(to: str, method: Callable[..., Any], *args: Any, timeout: Optional[float] = None,
               version: int = 0) -> torch.futures.Future:
    """Start ``method(*args)`` on member ``to``'s service; ``wait`` on the future for its answer.
    ``version``: the service's ``before_call`` is told it (0: none)."""
    entry = _invoke_async if getattr(method, "__rpcps_remote__", False) else _invoke
    kwargs = {} if timeout is None else {"timeout": timeout}
    me = rpc.get_worker_info()
    return rpc.rpc_async(to, entry, args=(method, me.name, me.id, *args),
                         kwargs={"version": version} if version else None, **kwargs)


def call(to: str, method: Callable[..., Any], *args: Any, timeout: Optional[float] = None) -> Any:
    """``method(*args)`` on member ``to``'s service, synchronously."""
    return wait(call_async(to, method, *args, timeout=timeout))


def wait(fut: Any) -> Any:
    """``fut.wait()``, with a peer's domain error raised again as its own type.

    torch delivers a callee's exception as RuntimeError("<Type>: On WorkerInfo(...):\\n<repr>\\n
    <traceback>"), whatever its type; the type's name and the message are parsed back here."""
    try:
        return fut.wait()
    except RuntimeError as exc:
        head, _, rest = str(exc).partition(": On WorkerInfo")
        cls = _DOMAIN_ERRORS.get(head)
        if cls is None:
            raise
        where, _, body = rest.partition(":\n")
        representation = body.split("\n", 1)[0]
        try:
            message = ast.literal_eval(representation[len(head) + 1:-1])
        except (ValueError, SyntaxError):
            message = representation
        name = where.rsplit("name=", 1)[-1].rstrip(")")
        raise cls(f"{name}: {message}") from None


def describe(x: Any) -> str:
    """A value as an error message names it: a tensor by dtype and shape, anything else by type and start."""
    if isinstance(x, torch.Tensor):
        return f"{x.dtype} tensor {list(x.shape)}"
    text = repr(x)
    return f"{type(x).__name__} {text[:60]}{'…' if len(text) > 60 else ''}"


def in_autograd_context() -> bool:
    """Whether this thread is in a distributed autograd context: a trainer's step, or on a
    server, a request sent from one (what it reads then carries the way back for gradients)."""
    try:
        dist_autograd._current_context()
        return True
    except RuntimeError:
        return False
