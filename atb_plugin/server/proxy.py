"""``atb-plugin proxy``: the front of a prefill/decode disaggregated deployment (vLLM's toy proxy,
docs/kv-transfer.md "The proxy").

    atb-plugin proxy --prefill http://p0:8000 [...] --decode http://d0:8000 [...] [--host --port]

Per completion or chat request it picks a producer and a consumer (round robin), sends the
producer the client's body with ``max_tokens`` = 1, ``stream`` off and
``kv_transfer_params={"do_remote_decode": true}``, then sends the consumer the client's own body
with the ``kv_transfer_params`` the producer answered, and hands the consumer's answer back byte
for byte (SSE streams included). A producer that cannot be reached or fails answers the client
an OpenAI error (502 / 503) at once. ``/health`` checks every instance; ``/v1/models`` is a
consumer's.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import sys
from contextlib import asynccontextmanager

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from atb_plugin.server.protocol import error_response

logger = logging.getLogger("atb_plugin.server.proxy")

# Request headers passed on to the instances (the rest are the proxy's own connection's).
_FORWARDED_HEADERS = ("authorization", "x-request-id")
# Fields a one-token prefill run must not carry: n > 1 and stream options are the client's
# answer's business, min_tokens > 1 contradicts max_tokens = 1.
_PREFILL_DROPPED = ("stream_options", "min_tokens", "n", "best_of")


def error_json(status: int, message: str) -> JSONResponse:
    """An OpenAI error body, as the server's own errors are."""
    return JSONResponse(error_response(message, status).model_dump(), status_code=status)


class Proxy:
    def __init__(self, prefill: list[str], decode: list[str], timeout: float):
        if not prefill or not decode:
            raise ValueError("the proxy needs at least one --prefill and one --decode URL")
        self.prefill_urls = [url.rstrip("/") for url in prefill]
        self.decode_urls = [url.rstrip("/") for url in decode]
        self._prefill = itertools.cycle(self.prefill_urls)
        self._decode = itertools.cycle(self.decode_urls)
        self.timeout = timeout
        self.client: httpx.AsyncClient | None = None

    @staticmethod
    def headers(request: Request) -> dict[str, str]:
        return {name: request.headers[name] for name in _FORWARDED_HEADERS if name in request.headers}

    async def prefill(self, path: str, body: dict, headers: dict) -> tuple[dict | None, Response | None]:
        """Run the prompt on a producer: (its kv_transfer_params, None), or (None, the error to
        answer the client with)."""
        url = next(self._prefill)
        one_token = {key: value for key, value in body.items() if key not in _PREFILL_DROPPED}
        one_token.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
        if path.endswith("chat/completions"):
            one_token["max_completion_tokens"] = 1
        try:
            answer = await self.client.post(url + path, json=one_token, headers=headers)
        except httpx.TimeoutException:
            return None, error_json(502, f"the prefill instance {url} did not answer within {self.timeout:g} s")
        except httpx.HTTPError as error:
            return None, error_json(503, f"the prefill instance {url} is unreachable: {error}")
        if answer.status_code != 200:
            if 400 <= answer.status_code < 500:  # the client's request is at fault: its error as is
                return None, Response(answer.content, answer.status_code,
                                      media_type=answer.headers.get("content-type"))
            return None, error_json(502, f"the prefill instance {url} failed ({answer.status_code}): "
                                         f"{answer.text[:500]}")
        try:
            params = answer.json().get("kv_transfer_params")
        except ValueError:
            return None, error_json(502, f"the prefill instance {url} answered no JSON")
        if params is None:
            logger.warning("the prefill instance %s returned no kv_transfer_params (no MooncakeConnector "
                           "producer?): the decode instance computes the prompt", url)
        return params, None

    async def generate(self, request: Request, path: str) -> Response:
        try:
            body = await request.json()
        except ValueError:
            return error_json(400, "the request body is not valid JSON")
        if not isinstance(body, dict):
            return error_json(400, "the request body must be a JSON object")
        headers = self.headers(request)
        decode_body = dict(body)
        if (body.get("n") or 1) == 1:
            params, failure = await self.prefill(path, body, headers)
            if failure is not None:
                return failure
            decode_body["kv_transfer_params"] = params
        # else n choices: the decode instance computes the prompt (one prefill's blocks are
        # pulled once).
        url = next(self._decode)
        try:
            upstream = await self.client.send(self.client.build_request("POST", url + path, json=decode_body,
                                                                        headers=headers), stream=True)
        except httpx.TimeoutException:
            return error_json(504, f"the decode instance {url} did not answer within {self.timeout:g} s")
        except httpx.HTTPError as error:
            return error_json(503, f"the decode instance {url} is unreachable: {error}")
        media_type = upstream.headers.get("content-type")
        if not media_type or not media_type.startswith("text/event-stream"):
            try:
                content = await upstream.aread()
            finally:
                await upstream.aclose()
            return Response(content, upstream.status_code, media_type=media_type)

        async def passthrough():
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:
                await upstream.aclose()

        return StreamingResponse(passthrough(), upstream.status_code, media_type=media_type)

    async def health(self) -> Response:
        urls = self.prefill_urls + self.decode_urls

        async def check(url: str) -> str | None:
            try:
                answer = await self.client.get(url + "/health", timeout=5)
            except httpx.HTTPError as error:
                return f"{url}: {type(error).__name__}"
            return None if answer.status_code == 200 else f"{url}: {answer.status_code}"

        problems = [p for p in await asyncio.gather(*(check(url) for url in urls)) if p is not None]
        if problems:
            return error_json(503, "unhealthy instances: " + "; ".join(problems))
        return Response(status_code=200)

    async def models(self, request: Request) -> Response:
        url = next(self._decode)
        try:
            answer = await self.client.get(url + "/v1/models", headers=self.headers(request))
        except httpx.HTTPError as error:
            return error_json(503, f"the decode instance {url} is unreachable: {error}")
        return Response(answer.content, answer.status_code, media_type=answer.headers.get("content-type"))


def create_app(proxy: Proxy) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_app):
        # No connection-pool limit: every client stream holds one connection to an instance.
        proxy.client = httpx.AsyncClient(timeout=httpx.Timeout(proxy.timeout, connect=10),
                                         limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        try:
            yield
        finally:
            await proxy.client.aclose()

    app = FastAPI(lifespan=lifespan)
    app.add_api_route("/health", proxy.health, methods=["GET"])
    app.add_api_route("/v1/models", proxy.models, methods=["GET"])

    async def completions(request: Request):
        return await proxy.generate(request, "/v1/completions")

    async def chat(request: Request):
        return await proxy.generate(request, "/v1/chat/completions")

    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", chat, methods=["POST"])
    return app


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="atb-plugin proxy", description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefill", nargs="+", required=True, metavar="URL",
                        help="producer instances (kv_role kv_producer), e.g. http://10.0.0.1:8000")
    parser.add_argument("--decode", nargs="+", required=True, metavar="URL",
                        help="consumer instances (kv_role kv_consumer)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds an instance may take to answer (or between two stream chunks)")
    parser.add_argument("--log-level", default="info")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        proxy = Proxy(args.prefill, args.decode, args.timeout)
    except ValueError as error:
        print(f"atb-plugin proxy: {error}", file=sys.stderr)
        return 2
    uvicorn.run(create_app(proxy), host=args.host, port=args.port, log_level=args.log_level, access_log=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
