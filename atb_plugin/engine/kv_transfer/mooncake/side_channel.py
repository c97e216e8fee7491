"""The PD side channel: one ZeroMQ ROUTER per producer rank, beside its Transfer Engine.

A consumer rank asks its producer rank's ``KVLayout`` once per peer (where the KV tensors lie,
the Transfer Engine's session, the shapes it must match) and, for each request it pulled or gave
up on, sends an ``Ack`` so the producer frees the blocks. Typed msgspec messages, one per frame.
"""

from __future__ import annotations

import threading

import msgspec
import zmq


class LayoutQuery(msgspec.Struct, tag="layout_query"):
    pass


class KVLayout(msgspec.Struct, tag="layout"):
    """A rank's KV cache as a peer reads it: tensor ``i`` (each layer's K then V, or one latent
    per layer) starts at ``base_addresses[i]``; block ``b`` of it is the ``block_bytes`` bytes at
    ``base + b * block_bytes``."""

    engine_id: str
    session: str  # the Transfer Engine's "host:rpc_port"
    tp_rank: int
    tp_size: int
    dtype: str
    block_size: int
    num_blocks: int
    block_bytes: int
    tensor_shapes: list[list[int]]
    base_addresses: list[int]

    def mismatch(self, other: KVLayout) -> str | None:
        """Why a consumer with layout ``self`` cannot read producer layout ``other`` (None: it can)."""
        for name in ("tp_size", "tp_rank", "dtype", "block_size", "block_bytes"):
            if getattr(self, name) != getattr(other, name):
                return f"{name}: consumer {getattr(self, name)!r}, producer {getattr(other, name)!r}"
        ours = [shape[1:] for shape in self.tensor_shapes]
        theirs = [shape[1:] for shape in other.tensor_shapes]
        if ours != theirs:
            return f"KV tensor shapes (per block): consumer {ours}, producer {theirs}"
        return None


class Ack(msgspec.Struct, tag="ack"):
    """The consumer is done with these requests' blocks (pulled them, or gave up)."""

    request_ids: list[str]


class Nack(msgspec.Struct, tag="error"):
    message: str


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(LayoutQuery | KVLayout | Ack | Nack)


def side_channel_address(host: str, port: int) -> str:
    return f"tcp://{host}:{port}"


class SideChannelServer:
    """The producer rank's listener (a daemon thread): answers layout queries, collects acks."""

    def __init__(self, host: str, port: int, layout: KVLayout):
        self.layout = layout
        self._acked: set[str] = set()
        self._lock = threading.Lock()
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        try:
            self._socket.bind(side_channel_address(host, port))
        except zmq.ZMQError as error:
            self._socket.close()
            self._context.term()
            raise RuntimeError(f"MooncakeConnector: cannot bind the side channel {host}:{port} ({error}); "
                               "set kv_connector_extra_config.side_channel_port") from None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="mooncake-side-channel", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            frames = self._socket.recv_multipart()
            if len(frames) != 2:
                continue  # not one of ours (a DEALER sends exactly one frame)
            identity, payload = frames
            try:
                message = _DECODER.decode(payload)
            except msgspec.DecodeError as error:
                self._socket.send_multipart([identity, _ENCODER.encode(Nack(f"undecodable message: {error}"))])
                continue
            if isinstance(message, LayoutQuery):
                self._socket.send_multipart([identity, _ENCODER.encode(self.layout)])
            elif isinstance(message, Ack):
                with self._lock:
                    self._acked.update(message.request_ids)

    def take_acked(self) -> set[str]:
        with self._lock:
            acked, self._acked = self._acked, set()
        return acked

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._socket.close()
        self._context.term()


class SideChannelClient:
    """A consumer rank's end: one query socket per layout request (a late answer to a query
    that timed out can never be taken for the next one), one ack socket per producer rank."""

    def __init__(self, timeout_s: float):
        self.timeout_ms = max(1, int(timeout_s * 1000))
        self._context = zmq.Context()
        self._ack_sockets: dict[str, zmq.Socket] = {}

    def query_layout(self, host: str, port: int) -> KVLayout:
        """The producer rank's layout; ``TimeoutError`` when it does not answer in time."""
        address = side_channel_address(host, port)
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        try:
            socket.connect(address)
            socket.send(_ENCODER.encode(LayoutQuery()))
            if not socket.poll(self.timeout_ms, zmq.POLLIN):
                raise TimeoutError(f"the producer's side channel {address} did not answer in "
                                   f"{self.timeout_ms / 1000:g} s")
            reply = _DECODER.decode(socket.recv())
        finally:
            socket.close()
        if isinstance(reply, Nack):
            raise RuntimeError(f"the producer's side channel {address} refused the layout query: {reply.message}")
        if not isinstance(reply, KVLayout):
            raise RuntimeError(f"the producer's side channel {address} answered {type(reply).__name__}")
        return reply

    def ack(self, host: str, port: int, request_ids: list[str]) -> None:
        """Fire and forget (a dead producer frees nothing anyway): never blocks."""
        address = side_channel_address(host, port)
        socket = self._ack_sockets.get(address)
        if socket is None:
            socket = self._ack_sockets[address] = self._context.socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.SNDHWM, 10_000)
            socket.connect(address)
        try:
            socket.send(_ENCODER.encode(Ack(request_ids)), zmq.NOBLOCK)
        except zmq.Again:
            pass  # the queue toward an unreachable producer is full: its timeout frees the blocks

    def close(self) -> None:
        for socket in self._ack_sockets.values():
            socket.close()
        self._ack_sockets.clear()
        self._context.term()
