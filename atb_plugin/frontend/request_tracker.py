"""``RequestTracker``: every request from its hand-off to the engine core to its end, for both doors.

    add(requests, prompt, lease) ──► OutputProcessor.add_request + lease held + client.add_request
    process(EngineCoreOutputs)   ──► OutputProcessor.process ─► RequestOutputs; stop strings ─► client.abort
    abort(request id)            ──► client.abort + OutputProcessor.abort
    any end (finish, stop string, abort, error) ──► the lease dropped; its last holder releases it

A lease (``input_processor.Lease``) is held by every engine request made from one prompt: one,
or the n children of an n > 1 request, which share the prompt's segments. ``release(lease)``
runs once, when the last of them ends, whatever ended it: the offline ``LLM`` releases its
store's segments, the server tells the worker that built them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from atb_plugin.engine.client import EngineCoreClient
from atb_plugin.engine.messages import EngineCoreOutput, EngineCoreRequest
from atb_plugin.frontend.input_processor import Lease
from atb_plugin.frontend.output_processor import OutputProcessor, RequestOutput
from atb_plugin.pooling.outputs import PoolingRequestOutput

__all__ = ["RequestTracker"]


class RequestTracker:
    def __init__(self, client: EngineCoreClient, tokenizer, release: Callable[[Lease], None],
                 on_finish: Callable[[RequestOutput | PoolingRequestOutput], None] | None = None):
        self.client = client
        self.release = release
        self.on_finish = on_finish
        self.output_processor = OutputProcessor(tokenizer, on_finish=self._finished)
        self._lease_of: dict[str, Lease] = {}  # request id -> the lease it holds
        self._holders: dict[Lease, int] = {}  # lease -> requests still holding it

    def add(self, requests: Sequence[EngineCoreRequest], prompt=None, lease: Lease | None = None) -> None:
        """Hand ``requests`` (one prompt's) to the core, each holding ``lease``. If the client
        refuses one, those already added are aborted and the lease released before the error
        propagates."""
        if lease is not None:
            self._holders[lease] = self._holders.get(lease, 0) + len(requests)
            for request in requests:
                self._lease_of[request.request_id] = lease
        added = []
        try:
            for request in requests:
                self.output_processor.add_request(request.request_id, prompt, request.prompt_token_ids,
                                                  request.sampling_params or request.pooling_params)
                added.append(request.request_id)
                self.client.add_request(request)
        except BaseException:
            for request in requests:
                if request.request_id in added:
                    self.abort(request.request_id)  # ends it: drops its hold
                else:
                    self._drop(request.request_id)
            raise

    def process(self, outputs: Iterable[EngineCoreOutput]) -> list[RequestOutput | PoolingRequestOutput]:
        """A step's outputs as ``RequestOutput``s; a request a stop string ended is aborted in
        the core (the core cannot see text)."""
        processed = self.output_processor.process(outputs)
        if processed.to_abort:
            self.client.abort(processed.to_abort)
        return processed.request_outputs

    def abort(self, request_id: str, reason: str = "abort", error: str | None = None):
        """End ``request_id`` here and in the core; its final output (None if it is not ours)."""
        if request_id not in self.output_processor:
            return None
        self.client.abort([request_id])
        return self.output_processor.abort(request_id, reason, error)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def lease_of(self, request_id: str) -> Lease | None:
        return self._lease_of.get(request_id)

    def _finished(self, output: RequestOutput | PoolingRequestOutput) -> None:
        self._drop(output.request_id)
        if self.on_finish is not None:
            self.on_finish(output)

    def _drop(self, request_id: str) -> None:
        lease = self._lease_of.pop(request_id, None)
        if lease is None:
            return
        holders = self._holders.pop(lease) - 1
        if holders > 0:
            self._holders[lease] = holders
        else:
            self.release(lease)
