"""The HTTP client of ``vllm-check --nodes 2`` (a child process, on the head's
host): vLLM's OpenAI-compatible server driven through the ``openai``
package (and ``httpx`` for ``/health`` and ``/metrics``), both of which
vLLM's own environment installs. No HTTP is written by hand.

``python -m ppsync.checks.vllm.http_client SPEC.json OUT.json``:

1. waits for ``/health`` to answer 200 (``ready_timeout_s``);
2. sends every request of ``requests`` at once (asyncio), each a
   ``/v1/completions`` call with the prompt as token ids (the model has no
   tokenizer: the server runs with ``--skip-tokenizer-init`` and each
   request asks ``return_token_ids``), ``ignore_eos``, greedy
   (temperature 0) or seeded (temperature > 0 with a per-request seed);
   ``stream`` ones read server-sent chunks, ``cancel_after`` ones close
   their stream after that many tokens (the server sees the client leave
   and aborts the request while the others still decode);
3. sends ``replays`` (the cancelled requests again, whole) after the burst;
4. reads the server's request counters from ``/metrics``, and this host's
   veth counters before the burst and after the replays (``veth``).

In a fault run (``fault_marker`` set) it writes that file once every
request has streamed ``marker_tokens`` tokens (the check then makes the
fault) and records how each request ended: its tokens, and the error the
client got, or its own ``request_timeout_s`` running out (a hang).

OUT holds, per request: the token ids received, how it ended (``length``,
``cancelled``, an error's type and first line), when (time.time()).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["main", "request_counters", "veth_bytes"]

SUCCESS_METRIC = "vllm:request_success_total"
GENERATED_METRIC = "vllm:generation_tokens_total"


def request_counters(metrics_text: str) -> dict[str, int]:
    """vLLM's counters from its Prometheus text, summed over engines and
    models: requests finished by reason (``length``, ``stop``, ...; an
    aborted request is not counted there) and ``generated``, the tokens
    the engine generated (a cancelled request's too, until its abort)."""
    out: dict[str, int] = {}
    for line in metrics_text.splitlines():
        labels, _, value = line.rpartition(" ")
        if line.startswith(SUCCESS_METRIC + "{"):
            key = labels.split('finished_reason="', 1)[-1].split('"', 1)[0]
        elif line.startswith(GENERATED_METRIC + "{"):
            key = "generated"
        else:
            continue
        out[key] = out.get(key, 0) + int(float(value))
    return out


async def _wait_ready(base: str, timeout_s: float) -> float | None:
    """Seconds until /health answered 200; None at the timeout."""
    import httpx

    t0 = time.monotonic()
    async with httpx.AsyncClient(timeout=5.0) as http:
        while time.monotonic() - t0 < timeout_s:
            try:
                if (await http.get(f"{base}/health")).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            await asyncio.sleep(1.0)
    return None


def veth_bytes(ifname: str | None) -> dict[str, int] | None:
    """This host's veth counters (this process runs in the host's network
    namespace, whose /sys shows its own interfaces)."""
    if not ifname:
        return None
    base = Path("/sys/class/net") / ifname / "statistics"
    try:
        return {c: int((base / f"{c}_bytes").read_text()) for c in ("tx", "rx")}
    except OSError:
        return None


def _error(e: BaseException) -> dict[str, str]:
    lines = str(e).splitlines()
    return {"type": f"{type(e).__module__}.{type(e).__qualname__}",
            "line": lines[0][:300] if lines else ""}


class _Marker:
    """Writes the fault marker once every streamed request has its tokens."""

    def __init__(self, path: str | None, waiting: int, tokens: int) -> None:
        self.path, self.waiting, self.tokens = path, waiting, tokens

    def saw(self, count: int, done: list[bool]) -> None:
        if self.path is None or done[0] or count < self.tokens:
            return
        done[0] = True
        self.waiting -= 1
        if self.waiting == 0:
            Path(self.path).write_text(json.dumps({"t": time.time()}))


async def _one(client: Any, model: str, req: dict[str, Any], marker: _Marker) -> dict[str, Any]:
    """One request to its end; what it got."""
    tokens: list[int] = []
    out: dict[str, Any] = {"id": req["id"], "tokens": tokens, "t0": time.time()}
    params = {"model": model, "prompt": req["prompt"], "max_tokens": req["max_tokens"],
              "temperature": req["temperature"],
              "extra_body": {"return_token_ids": True, "ignore_eos": True}}
    if req.get("seed") is not None:
        params["seed"] = req["seed"]
    marked = [False]
    try:
        if not req["stream"]:
            resp = await client.completions.create(**params)
            choice = resp.choices[0]
            tokens += list(getattr(choice, "token_ids", None) or [])
            out["end"] = str(choice.finish_reason)
        else:
            stream = await client.completions.create(stream=True, **params)
            out["end"] = "no finish reason"
            async for chunk in stream:
                for choice in chunk.choices:
                    tokens += list(getattr(choice, "token_ids", None) or [])
                    if choice.finish_reason is not None:
                        out["end"] = str(choice.finish_reason)
                marker.saw(len(tokens), marked)
                cancel = req.get("cancel_after")
                if cancel is not None and len(tokens) >= cancel:
                    await stream.close()  # the client leaves: the server aborts it
                    out["end"] = "cancelled"
                    break
    except Exception as e:  # the outcome to report (a fault run expects one)
        out["end"] = "error"
        out["error"] = _error(e)
    out["t1"] = time.time()
    return out


async def run(spec: dict[str, Any]) -> dict[str, Any]:
    from openai import AsyncOpenAI

    base = spec["base_url"]
    result: dict[str, Any] = {"ready_s": await _wait_ready(base, spec["ready_timeout_s"])}
    if result["ready_s"] is None:
        result["error"] = f"/health did not answer 200 within {spec['ready_timeout_s']:g} s"
        return result
    client = AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0,
                         timeout=spec["request_timeout_s"])
    model = spec["model"]
    streamed = [r for r in spec["requests"] if r["stream"]]
    marker = _Marker(spec.get("fault_marker"), len(streamed), spec.get("marker_tokens", 1))
    result["veth_before"] = veth_bytes(spec.get("veth"))
    result["burst"] = await asyncio.gather(*(_one(client, model, r, marker)
                                            for r in spec["requests"]))
    if spec.get("fault_marker"):
        after = _Marker(None, 0, 0)
        probe = {**spec["requests"][0], "id": "after-fault", "stream": False}
        result["after"] = [await _one(client, model, probe, after)]
    else:
        result["replays"] = await asyncio.gather(*(
            _one(client, model, {**r, "stream": False, "cancel_after": None}, marker)
            for r in spec["requests"] if r["id"] in spec.get("replays", ())))
        result["veth_after"] = veth_bytes(spec.get("veth"))
        result["counters"] = await _counters(base)
    await client.close()
    return result


async def _counters(base: str) -> dict[str, int]:
    import httpx

    async with httpx.AsyncClient(timeout=10.0) as http:
        try:
            return request_counters((await http.get(f"{base}/metrics")).text)
        except httpx.HTTPError:
            return {}


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    Path(sys.argv[2]).write_text(json.dumps(asyncio.run(run(spec))))


if __name__ == "__main__":
    main()
