"""The RewardService gRPC front door: protobuf in, pipeline calls, protobuf out.

Every refusal is a status with a message that says what to change:
INVALID_ARGUMENT names the field (`items[3].item_id: duplicate id 'a'`), NOT_FOUND an unknown
handle, PERMISSION_DENIED a manager the tenant may not use, RESOURCE_EXHAUSTED a full backlog
or a tenant quota (with `retry-after-ms` in the trailing metadata), UNAVAILABLE a replica
shutting down. A call's deadline is honoured by answering just before it with the unfinished
items as TIMEOUT, instead of letting the caller see a bare DEADLINE_EXCEEDED and lose the
items that did finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterator

import grpc

from relayrl.core.interceptors import current_principal
from relayrl.proto.common.v1 import common_pb2
from relayrl.proto.reward.v1 import reward_pb2, reward_pb2_grpc
from relayrl.reward.config import RewardConfig
from relayrl.reward.convert import item_from_proto, result_to_proto
from relayrl.reward.items import (
    InfraError,
    InvalidItem,
    RateLimited,
    RewardItem,
    RewardResult,
    Status,
)
from relayrl.reward.pipeline import (
    Closing,
    Handle,
    InvalidRequest,
    ManagerNotAllowed,
    Overloaded,
    RequestError,
    RewardPipeline,
    SubmitOptions,
    UnknownHandle,
)
from relayrl.reward.quotas import QuotaStoreUnavailable
from relayrl.reward.tenants import QuotaExceeded, Tenants

logger = logging.getLogger(__name__)

RETRY_AFTER_KEY = "retry-after-ms"
# Answer this long before the caller's deadline (at most), so TIMEOUT results arrive.
DEADLINE_MARGIN_S = 0.25
DEADLINE_MARGIN_FRACTION = 0.1

_REQUEST_ERROR_CODES: dict[type[RequestError], grpc.StatusCode] = {
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    UnknownHandle: grpc.StatusCode.NOT_FOUND,
    ManagerNotAllowed: grpc.StatusCode.PERMISSION_DENIED,
    Overloaded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    QuotaExceeded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    QuotaStoreUnavailable: grpc.StatusCode.UNAVAILABLE,
    Closing: grpc.StatusCode.UNAVAILABLE,
}

# on_error=raise: the status a failed item turns into.
_FAILURE_CODES = {
    Status.INFRA_ERROR: grpc.StatusCode.UNAVAILABLE,
    Status.TIMEOUT: grpc.StatusCode.DEADLINE_EXCEEDED,
    Status.RATE_LIMITED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Status.INVALID_INPUT: grpc.StatusCode.INVALID_ARGUMENT,
}


class _Abort(Exception):
    """Carries a status out of helper code to the handler, which aborts with it."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_s: float | None = None):
        super().__init__(message)
        self.code, self.message, self.retry_after_s = code, message, retry_after_s


def _abort_of(exc: RequestError) -> _Abort:
    code = next(
        (c for cls, c in _REQUEST_ERROR_CODES.items() if isinstance(exc, cls)),
        grpc.StatusCode.INTERNAL,
    )
    return _Abort(code, str(exc), getattr(exc, "retry_after_s", None))


@contextlib.contextmanager
def _request_errors() -> Iterator[None]:
    try:
        yield
    except RequestError as exc:
        raise _abort_of(exc) from None


async def _abort(context: grpc.aio.ServicerContext, abort: _Abort) -> None:
    if abort.retry_after_s is not None:
        context.set_trailing_metadata(
            ((RETRY_AFTER_KEY, str(max(1, round(abort.retry_after_s * 1000)))),)
        )
    await context.abort(abort.code, abort.message)


def _items_from_proto(messages: list[common_pb2.RewardItem]) -> list[RewardItem]:
    """InvalidRequest naming the first item whose environment reward is malformed."""
    items = []
    for index, message in enumerate(messages):
        try:
            items.append(item_from_proto(message))
        except InvalidItem as exc:
            raise InvalidRequest(f"items[{index}].env_reward: {exc}") from None
    return items


def _deadline(context: grpc.aio.ServicerContext) -> float | None:
    """Loop time by which to answer: a margin before the caller's deadline."""
    remaining = context.time_remaining()
    if remaining is None:
        return None
    margin = min(DEADLINE_MARGIN_S, remaining * DEADLINE_MARGIN_FRACTION)
    return asyncio.get_running_loop().time() + max(0.0, remaining - margin)


def _first_failure(results: list[RewardResult]) -> _Abort | None:
    for index, result in enumerate(results):
        if not result.status.is_reward:
            return _Abort(
                _FAILURE_CODES.get(result.status, grpc.StatusCode.INTERNAL),
                f"items[{index}] ({result.item_id!r}) failed with {result.status.name}: "
                f"{result.message} (send on_error=ON_ERROR_MARK to get per-item statuses)",
            )
    return None


class RewardServicer(reward_pb2_grpc.RewardServiceServicer):
    def __init__(self, pipeline: RewardPipeline, tenants: Tenants, config: RewardConfig) -> None:
        self.pipeline = pipeline
        self.tenants = tenants
        self._config = config

    # -- shared --------------------------------------------------------------------------

    def _tenant(self) -> str:
        return self.tenants.name_of(current_principal())

    def options_for(self, options: reward_pb2.ScoreOptions, tenant: str) -> SubmitOptions:
        manager = options.manager or self._config.default_manager
        if manager not in self.pipeline.managers:
            raise _Abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"options.manager: unknown manager {manager!r} (this tenant may use: "
                f"{', '.join(self.tenants.allowed_managers(tenant))})",
            )
        with _request_errors():
            self.tenants.check_manager(tenant, manager)
        if options.on_error == reward_pb2.ON_ERROR_UNSPECIFIED:
            raise_on_error = self._config.pipeline.default_on_error == "raise"
        else:
            raise_on_error = options.on_error == reward_pb2.ON_ERROR_RAISE
        return SubmitOptions(manager, tenant, options.token_level, raise_on_error)

    async def _accept(
        self, items_pb: list[common_pb2.RewardItem], options: SubmitOptions, api: str
    ) -> list[RewardItem]:
        with _request_errors():
            items = _items_from_proto(items_pb)
            self.pipeline.validate(items, options)
            await self.tenants.charge(options.tenant, sum(item.approx_tokens() for item in items))
        self.pipeline.metrics.submissions.labels(tenant=options.tenant, api=api).inc()
        return items

    # -- unary ---------------------------------------------------------------------------

    async def Score(
        self, request: reward_pb2.ScoreRequest, context: grpc.aio.ServicerContext
    ) -> reward_pb2.ScoreResponse:
        try:
            options = self.options_for(request.options, self._tenant())
            items = await self._accept(list(request.items), options, "score")
            with _request_errors():
                results = await self.pipeline.score(items, options, _deadline(context))
            if options.raise_on_error and (failure := _first_failure(results)):
                raise failure
        except _Abort as abort:
            await _abort(context, abort)
        return reward_pb2.ScoreResponse(results=[result_to_proto(r) for r in results])

    async def Submit(
        self, request: reward_pb2.SubmitRequest, context: grpc.aio.ServicerContext
    ) -> reward_pb2.SubmitResponse:
        try:
            options = self.options_for(request.options, self._tenant())
            items = await self._accept(list(request.items), options, "submit")
            with _request_errors():
                handle = await self.pipeline.submit(
                    items, options, deadline_s=_deadline(context), validated=True
                )
        except _Abort as abort:
            await _abort(context, abort)
        return reward_pb2.SubmitResponse(handle=handle.id, num_items=len(handle.entries))

    async def Collect(
        self, request: reward_pb2.CollectRequest, context: grpc.aio.ServicerContext
    ) -> reward_pb2.CollectResponse:
        try:
            if request.wait_s < 0:
                raise _Abort(
                    grpc.StatusCode.INVALID_ARGUMENT, f"wait_s: must be >= 0, got {request.wait_s}"
                )
            with _request_errors():
                handle = self.pipeline.handle(request.handle)
                if handle.entries[0].options.tenant != self._tenant():
                    # Another tenant's handle: indistinguishable from an unknown one.
                    raise UnknownHandle(f"handle {request.handle!r} is unknown")
            wait_s = request.wait_s
            deadline = _deadline(context)
            if deadline is not None:
                wait_s = min(wait_s, max(0.0, deadline - asyncio.get_running_loop().time()))
            with _request_errors():
                done, results = await self.pipeline.collect(request.handle, wait_s)
            raise_on_error = handle.entries[0].options.raise_on_error
            if done and raise_on_error and (failure := _first_failure(results)):
                raise failure
        except _Abort as abort:
            await _abort(context, abort)
        return reward_pb2.CollectResponse(
            done=done,
            results=[result_to_proto(r) for r in results],
            num_pending=handle.num_pending,
        )

    async def ListManagers(
        self, request: reward_pb2.ListManagersRequest, context: grpc.aio.ServicerContext
    ) -> reward_pb2.ListManagersResponse:
        tenant = self._tenant()
        infos = []
        for name in self.tenants.allowed_managers(tenant):
            manager = self.pipeline.managers[name]
            infos.append(
                reward_pb2.ManagerInfo(
                    name=name,
                    type=manager.type_name,
                    supports_batch=manager.supports_batch,
                    data_sources=list(manager.data_sources),
                )
            )
        return reward_pb2.ListManagersResponse(
            managers=infos, default_manager=self._config.default_manager
        )

    # -- streaming -----------------------------------------------------------------------

    async def ScoreStream(
        self,
        request_iterator: AsyncIterator[reward_pb2.ScoreStreamRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[reward_pb2.ScoreStreamResponse]:
        stream = _Stream(self, self._tenant(), _deadline(context))
        reader = asyncio.create_task(stream.read(request_iterator))
        try:
            async for result in stream.results():
                yield reward_pb2.ScoreStreamResponse(result=result_to_proto(result))
            await reader  # re-raises a reader failure
        except _Abort as abort:
            stream.expire("the stream was aborted")
            await _abort(context, abort)
        finally:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)


class _Stream:
    """One ScoreStream call: a reader submits items as they come, results go out as they are
    scored. Item ids must be unique within the stream."""

    def __init__(self, servicer: RewardServicer, tenant: str, deadline: float | None) -> None:
        self._servicer = servicer
        self.pipeline = servicer.pipeline
        self._tenant = tenant
        self._deadline = deadline
        self._options: SubmitOptions | None = None
        self._seen: set[str] = set()
        self._outstanding: dict[str, Handle] = {}  # item id -> its handle, until sent
        self._out: asyncio.Queue[RewardResult | _Abort | None] = asyncio.Queue()
        self._reading = True

    async def read(self, requests: AsyncIterator[reward_pb2.ScoreStreamRequest]) -> None:
        try:
            index = 0
            async for request in requests:
                kind = request.WhichOneof("kind")
                if kind == "options":
                    if index:
                        raise _Abort(
                            grpc.StatusCode.INVALID_ARGUMENT,
                            "options: must be the first message of the stream",
                        )
                    self._options = self._servicer.options_for(request.options, self._tenant)
                elif kind == "item":
                    await self._submit(request.item, index)
                else:
                    raise _Abort(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"message {index}: set `options` or `item`",
                    )
                index += 1
        except _Abort as abort:
            self._out.put_nowait(abort)
        finally:
            self._reading = False
            self._out.put_nowait(None)  # wake the writer to re-check completion

    async def _submit(self, message: common_pb2.RewardItem, index: int) -> None:
        if self._options is None:
            self._options = self._servicer.options_for(_DEFAULT_OPTIONS, self._tenant)
        options = self._options
        where = f"message {index}: item"
        try:
            item = item_from_proto(message)
        except InvalidItem as exc:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"{where}.env_reward: {exc}") from None
        if item.item_id in self._seen:
            raise _Abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{where}.item_id: duplicate id {item.item_id!r}; ids must be unique within "
                "a stream",
            )
        self._seen.add(item.item_id)
        try:
            self.pipeline.validate([item], options)
        except InvalidRequest as exc:
            raise _Abort(
                grpc.StatusCode.INVALID_ARGUMENT, str(exc).replace("items[0]", where, 1)
            ) from None
        try:
            await self._servicer.tenants.charge(options.tenant, item.approx_tokens())
        except QuotaExceeded as exc:
            # One item over quota: that item comes back RATE_LIMITED; the stream goes on.
            self._out.put_nowait(
                RewardResult.failed(item.item_id, RateLimited(str(exc), exc.retry_after_s))
            )
            return
        except QuotaStoreUnavailable as exc:
            # Its quota could not be checked: an infrastructure failure, never a score.
            self._out.put_nowait(RewardResult.failed(item.item_id, InfraError(str(exc))))
            return
        self.pipeline.metrics.submissions.labels(tenant=options.tenant, api="stream").inc()
        with _request_errors():
            handle = await self.pipeline.submit(
                [item], options, deadline_s=self._deadline, validated=True
            )
        self._outstanding[item.item_id] = handle
        handle.entries[0].future.add_done_callback(
            lambda future: self._out.put_nowait(future.result())
        )

    async def results(self) -> AsyncIterator[RewardResult]:
        loop = asyncio.get_running_loop()
        while self._reading or self._outstanding or not self._out.empty():
            timeout = None if self._deadline is None else max(0.0, self._deadline - loop.time())
            try:
                async with asyncio.timeout(timeout):
                    message = await self._out.get()
            except TimeoutError:
                self.expire("the stream's deadline passed before the item was scored")
                self._deadline = None
                continue
            if message is None:
                continue
            if isinstance(message, _Abort):
                raise message
            handle = self._outstanding.pop(message.item_id, None)
            if handle is not None:
                self.pipeline.forget(handle)
            raise_on_error = self._options is not None and self._options.raise_on_error
            if raise_on_error and (failure := _first_failure([message])):
                raise failure
            yield message

    def expire(self, message: str) -> None:
        for handle in list(self._outstanding.values()):
            self.pipeline.expire(handle, message)


_DEFAULT_OPTIONS = reward_pb2.ScoreOptions()
