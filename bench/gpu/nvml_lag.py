"""How NVML's figures follow a real allocation, measured on a real GPU with PyTorch: the CUDA
context's size, how long after `cudaMalloc` returns the device's `used` and this process's
per-process figure show it (and after `cudaFree`), what each NVML call costs, and how the sum of
the per-process figures compares with `used` (v1 and v2 memory info). The fakes (fake NVML,
fakegpu.py) must be no kinder than what this prints.

    python3 bench/gpu/nvml_lag.py [ROUNDS]    (needs torch with CUDA and nvidia-ml-py)

Prints one JSON object.
"""

import json
import os
import statistics
import sys
import time

import pynvml
import torch

GIB = 1 << 30
SIZE = 2 * GIB
SLACK = 64 << 20


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    pid = os.getpid()

    def used() -> int:
        return pynvml.nvmlDeviceGetMemoryInfo(handle).used

    def mine():
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if proc.pid == pid:
                return proc.usedGpuMemory
        return None

    report = {"driver": pynvml.nvmlSystemGetDriverVersion(), "name": pynvml.nvmlDeviceGetName(handle)}
    before_context = used()
    torch.empty(1, device="cuda:0")
    torch.cuda.synchronize()
    time.sleep(0.3)
    report["context_device_used_bytes"] = used() - before_context
    report["context_per_process_bytes"] = mine()
    try:
        v2 = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
        report["memory_v2"] = {"total": v2.total, "reserved": v2.reserved, "used": v2.used, "free": v2.free}
    except Exception as err:  # an older binding or driver
        report["memory_v2"] = f"{type(err).__name__}: {err}"
    v1 = pynvml.nvmlDeviceGetMemoryInfo(handle)
    report["memory_v1"] = {"total": v1.total, "used": v1.used, "free": v1.free}
    procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
    report["processes"] = [{"pid": p.pid, "used": p.usedGpuMemory} for p in procs]
    report["sum_per_process_bytes"] = sum((p.usedGpuMemory or 0) for p in procs)

    def follow(used_done, mine_done):
        """Seconds from now until each figure showed the change (polling as fast as NVML
        answers, both in one loop), and the polls taken."""
        since, polls = time.perf_counter(), 0
        seen = {"used": None, "per_process": None}
        while None in seen.values() and time.perf_counter() - since < 5:
            polls += 1
            if seen["used"] is None and used_done(used()):
                seen["used"] = round(time.perf_counter() - since, 6)
            if seen["per_process"] is None and mine_done(mine() or 0):
                seen["per_process"] = round(time.perf_counter() - since, 6)
        return seen, polls

    rows = []
    for _ in range(rounds):
        u0, m0 = used(), mine() or 0
        tensor = torch.empty(SIZE, dtype=torch.uint8, device="cuda:0")
        torch.cuda.synchronize()
        up, polls = follow(lambda u: u - u0 >= SIZE - SLACK, lambda m: m - m0 >= SIZE - SLACK)
        del tensor
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
        down, _ = follow(lambda u: u - u0 < SLACK, lambda m: m - m0 < SLACK)
        rows.append({"used_up_s": up["used"], "per_process_up_s": up["per_process"],
                     "polls_up": polls, "used_down_s": down["used"],
                     "per_process_down_s": down["per_process"]})
    report["rounds"] = rows

    def cost(call, n=200):
        t = time.perf_counter()
        for _ in range(n):
            call()
        return round((time.perf_counter() - t) / n * 1e6, 1)

    report["call_us"] = {
        "memory_info": cost(lambda: pynvml.nvmlDeviceGetMemoryInfo(handle)),
        "compute_processes": cost(lambda: pynvml.nvmlDeviceGetComputeRunningProcesses(handle)),
        "utilization": cost(lambda: pynvml.nvmlDeviceGetUtilizationRates(handle)),
    }
    ups = [r["per_process_up_s"] for r in rows if r["per_process_up_s"] is not None]
    report["per_process_up_median_s"] = statistics.median(ups) if ups else None
    print(json.dumps(report))


if __name__ == "__main__":
    main()
