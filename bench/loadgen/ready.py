"""Waiting for a server that is still starting: its model name, then one request that works.

Runs in the load generator's process (conveyor bench serve), on its asyncio loop, before warm-ups
and the timed run. Both steps retry while the server cannot answer yet, for at most
--ready-check-timeout-s each, and stop at once on an answer that waiting will not change.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import aiohttp

from conveyor.bench.loadgen.client import Endpoint, send_request
from conveyor.bench.loadgen.datasets import SampleRequest

_MODELS_FIRST_DELAY_S = 0.25  # a server that is just starting often listens within a second
_MODELS_MAX_DELAY_S = 2.0
_MODELS_MIN_ATTEMPT_S = 5.0


async def first_model(
    session: aiohttp.ClientSession, endpoint: Endpoint, stop: asyncio.Event, timeout_s: float
) -> str:
    """The first model of GET /v1/models, asked again while the server is still starting.

    It runs before the ready check, so it waits the same ``timeout_s`` (0: one try): a refused
    connection, a 5xx or an empty list is retried with backoff, a 4xx is final.
    """
    url = endpoint.base_url.rstrip("/") + "/v1/models"
    deadline = time.monotonic() + timeout_s
    delay = _MODELS_FIRST_DELAY_S
    while True:
        # However long the request timeout, one try must not outlast the deadline by much.
        attempt_s = max(deadline - time.monotonic(), _MODELS_MIN_ATTEMPT_S)
        model, error, final = await _ask_models(session, endpoint, url, attempt_s)
        if model is not None:
            return model
        left = deadline - time.monotonic()
        if final or left <= 0:
            waited = "" if final else f" within --ready-check-timeout-s {timeout_s:g}"
            raise RuntimeError(f"GET {url} gave no model{waited} ({error}); pass --model NAME")
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), min(delay, left))
        if stop.is_set():
            raise KeyboardInterrupt
        delay = min(delay * 2, _MODELS_MAX_DELAY_S)


async def _ask_models(
    session: aiohttp.ClientSession, endpoint: Endpoint, url: str, timeout_s: float
) -> tuple[str | None, str, bool]:
    """(model or None, why not, whether asking again is pointless)."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        async with session.get(url, headers=endpoint.headers(), timeout=timeout) as response:
            if response.status != 200:
                text = (await response.text(errors="replace")).strip()[:200]
                return None, f"HTTP {response.status}: {text}", response.status < 500
            body = await response.json(content_type=None)
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
        return None, f"{type(exc).__name__}: {exc}"[:200], False
    except ValueError as exc:  # not JSON
        return None, f"not JSON: {exc}"[:200], True
    models = body.get("data") if isinstance(body, dict) else None
    if not isinstance(models, list):
        return None, "no data list in the answer", True
    if not models:
        return None, "no model listed yet", False
    if not isinstance(models[0], dict) or "id" not in models[0]:
        return None, "the first model has no id", True
    return str(models[0]["id"]), "", False


async def wait_until_ready(
    session: aiohttp.ClientSession, endpoint: Endpoint, stop: asyncio.Event, timeout_s: float
) -> None:
    """Retry one tiny request while the server cannot be reached; an HTTP error is final.

    Its prompt shares nothing with the dataset, so a prefix cache learns nothing from it.
    """
    probe = SampleRequest("ready check", prompt_len=2, output_len=1, ignore_eos=True)
    deadline = time.monotonic() + timeout_s
    while True:
        out = await send_request(session, endpoint, probe)
        if out.success:
            return
        if out.error.startswith("HTTP") or time.monotonic() > deadline:
            raise RuntimeError(f"the first request to {endpoint.url} failed: {out.error}")
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), 1.0)
        if stop.is_set():
            raise KeyboardInterrupt
