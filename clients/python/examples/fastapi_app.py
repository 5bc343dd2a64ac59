"""A FastAPI model server that does its GPU work under a gpuguard memory permit: a request waits
for GPU memory (up to GPUGUARD_PERMIT_TIMEOUT seconds) instead of overflowing the card, and is
answered 503 with a Retry-After header when none came in time: backpressure instead of CUDA OOM.

Run it (next to a running gpuguard daemon):

    GPUGUARD_MODEL=qwen-32b GPUGUARD_PERMIT_GPU_MEM=3GiB GPUGUARD_PERMIT_TIMEOUT=2 \
        uvicorn fastapi_app:app --host 127.0.0.1 --port 8000

Environment: GPUGUARD_MODEL (the `[[model]]` the work is counted against; default: the model
this process belongs to), GPUGUARD_PERMIT_GPU_MEM (GPU memory one request needs, e.g. "3GiB";
default: the daemon's learned size for the model), GPUGUARD_PERMIT_RAM (host RAM per request,
default none), GPUGUARD_PERMIT_TIMEOUT (seconds to wait, default 2), GPUGUARD_SOCKET (the
daemon's socket). Replace `do_work` with the model call.
"""

from __future__ import annotations

import asyncio
import math
import os
from contextlib import asynccontextmanager
from typing import AsyncIterator, Optional

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel

import gpuguard

MODEL: Optional[str] = os.environ.get("GPUGUARD_MODEL") or None
GPU_MEM: Optional[str] = os.environ.get("GPUGUARD_PERMIT_GPU_MEM") or None
RAM: Optional[str] = os.environ.get("GPUGUARD_PERMIT_RAM") or None
TIMEOUT = float(os.environ.get("GPUGUARD_PERMIT_TIMEOUT", "2"))

client = gpuguard.AsyncClient()  # connects on first use, in the server's event loop


class Prompt(BaseModel):
    prompt: str


async def do_work(prompt: str, permit: gpuguard.Permit) -> str:
    """The GPU work for one request (stands in for the model call; `permit.gpu` is the GPU
    index the memory was reserved on)."""
    await asyncio.sleep(0.1)
    return prompt[::-1]


@asynccontextmanager
async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
    yield
    await client.aclose()


app = FastAPI(lifespan=lifespan)


@app.post("/generate")
async def generate(body: Prompt):
    try:
        async with client.permit(
            gpu_bytes=GPU_MEM, ram_bytes=RAM, model=MODEL, timeout=TIMEOUT
        ) as permit:
            text = await do_work(body.prompt, permit)
    except gpuguard.PermitRefused as refused:
        if not refused.transient:  # too large, not allowed, invalid: a configuration problem
            return JSONResponse(
                {"error": refused.message, "reason": refused.reason}, status_code=500
            )
        retry_after = max(1, math.ceil(refused.retry_after or 1))
        return JSONResponse(
            {"error": "the GPU is busy, try again later", "reason": refused.reason},
            status_code=503,
            headers={"Retry-After": str(retry_after)},
        )
    except gpuguard.DaemonUnavailable as err:
        return JSONResponse(
            {"error": f"gpuguard: {err}"}, status_code=503, headers={"Retry-After": "5"}
        )
    return {"text": text, "gpu": permit.gpu, "waited_s": permit.waited}
