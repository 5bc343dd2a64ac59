"""Runs the FastAPI example (clients/python/examples/fastapi_app.py) as a model server on a
simulated card: its `do_work` is replaced by one that puts each request's permit size on the
fake NVML card for the work time (fakegpu.py: a request that does not fit is an overflow, a
simulated CUDA OOM, answered 500), and a GET /_stats route reports the card's counts. The
example itself is unchanged: this launcher imports it and swaps the work function.

Serves HTTP on 127.0.0.1 (a free port, written to --port-file once listening) with uvicorn.
Use http_burst.py to fire bursts of requests at it.

Options:
  --state PATH          the fake NVML state file to write (required)
  --card-total SIZE     the card's memory (default 16GiB)
  --weights SIZE        resident weights (default 4GiB)
  --others PATH         other processes on the card (see fakegpu.py)
  --work SECONDS        how long a request works while holding its memory (default 0.2)
  --port-file PATH      where to write the port (default: print it on stdout)
  --app PATH            the example to run (default: the one in this repository)
  --model NAME, --gpu-mem SIZE, --permit-timeout SECONDS, --socket PATH
                        set GPUGUARD_MODEL, GPUGUARD_PERMIT_GPU_MEM (default 3GiB),
                        GPUGUARD_PERMIT_TIMEOUT, GPUGUARD_SOCKET for the example (default: as
                        already set in the environment)

By hand, against the fake daemon:
  python clients/python/tests/fake_daemon.py --socket /tmp/g.sock --gpu-capacity 12GiB &
  python tests/permits/fastapi_server.py --state /tmp/nvml-state --socket /tmp/g.sock \\
      --permit-timeout 0.3 --port-file /tmp/port &
  python tests/permits/http_burst.py --port-file /tmp/port --burst 10 --bursts 3
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import socket
import sys

from fakegpu import FakeCard, import_gpuguard

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_APP = os.path.join(HERE, "..", "..", "clients", "python", "examples", "fastapi_app.py")


def parse_args() -> argparse.Namespace:
    parse_size = import_gpuguard().parse_size
    parser = argparse.ArgumentParser(
        description="The FastAPI example on a simulated card (see the top of this file)."
    )
    parser.add_argument("--state", required=True)
    parser.add_argument("--card-total", type=parse_size, default=parse_size("16GiB"))
    parser.add_argument("--weights", type=parse_size, default=parse_size("4GiB"))
    parser.add_argument("--others", default=None)
    parser.add_argument("--work", type=float, default=0.2)
    parser.add_argument("--port-file", default=None)
    parser.add_argument("--app", default=DEFAULT_APP)
    parser.add_argument("--model", default=None)
    parser.add_argument("--gpu-mem", default=None)
    parser.add_argument("--permit-timeout", default=None)
    parser.add_argument("--socket", default=None)
    return parser.parse_args()


def load_app(path: str):
    spec = importlib.util.spec_from_file_location("fastapi_app", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"fastapi_server.py: cannot load the example at {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    args = parse_args()
    for variable, value in [
        ("GPUGUARD_MODEL", args.model),
        ("GPUGUARD_PERMIT_GPU_MEM", args.gpu_mem),
        ("GPUGUARD_PERMIT_TIMEOUT", args.permit_timeout),
        ("GPUGUARD_SOCKET", args.socket),
    ]:
        if value is not None:
            os.environ[variable] = value
    os.environ.setdefault("GPUGUARD_PERMIT_GPU_MEM", "3GiB")
    import uvicorn

    card = FakeCard(args.state, args.card_total, args.weights, others_path=args.others)
    example = load_app(args.app)

    async def do_work(prompt: str, permit) -> str:
        handle = card.start(permit.gpu_bytes)
        if handle is None:
            raise RuntimeError(
                "CUDA out of memory (simulated: the request did not fit on the card)"
            )
        try:
            await asyncio.sleep(args.work)
        finally:
            card.finish(handle)
        return prompt

    example.do_work = do_work
    example.app.add_api_route("/_stats", card.stats, methods=["GET"])

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1024)  # connections wait in the backlog until uvicorn accepts them
    port = listener.getsockname()[1]
    if args.port_file:
        with open(args.port_file + ".tmp", "w") as port_file:
            port_file.write(f"{port}\n")
        os.replace(args.port_file + ".tmp", args.port_file)
    else:
        print(port, flush=True)
    server = uvicorn.Server(uvicorn.Config(example.app, log_level="warning", lifespan="on"))
    server.run(sockets=[listener])
    sys.exit(0)


if __name__ == "__main__":
    main()
