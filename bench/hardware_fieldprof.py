"""Cost of each field id the agent batches in nvmlDeviceGetFieldValues, alone, on real NVML: thread CPU,
median of 10 calls on GPU 0 (bench/hardware_check.sh). SIM=hgx-h100 uses the simulator (to check this
script)."""

from __future__ import annotations

import os
import statistics
import time

from gpufleet.agent import nvml_fields as F


def main() -> None:
    if os.environ.get("SIM"):
        from gpufleet.agent.sim import SimNvml, load_scenario

        scenario = load_scenario(os.environ["SIM"])
        nvml = SimNvml(scenario, node=scenario.nodes[0])
    else:
        import pynvml as nvml
    nvml.nvmlInit()
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    # (reading, NVML field name, scope) as the agent batches them.
    names = [(r, n, s) for r, n, s in F._SCALARS] + [(str(t), n, 0) for t, n in F._THROTTLE_FIELDS]

    def thread_ms(request: list, k: int = 10) -> float:
        xs = []
        for _ in range(k):
            start = time.thread_time()
            nvml.nvmlDeviceGetFieldValues(handle, request)
            xs.append(time.thread_time() - start)
        return 1e3 * statistics.median(xs)

    whole = [(getattr(nvml, n), s) for _, n, s in names]
    print(f"whole batch of {len(whole)}: {thread_ms(whole):.3f} ms")
    for _, name, scope in names:
        try:
            print(f"{name:58s} {thread_ms([(getattr(nvml, name), scope)]):8.3f} ms")
        except Exception as exc:  # one field's failure must not hide the others' costs
            print(name, "error", exc)
    for fn in ("nvmlDeviceGetPowerUsage", "nvmlDeviceGetTotalEnergyConsumption"):
        if not hasattr(nvml, fn):
            print(f"{fn:58s} (not offered)")
            continue
        xs = []
        for _ in range(10):
            start = time.thread_time()
            getattr(nvml, fn)(handle)
            xs.append(time.thread_time() - start)
        print(f"{fn:58s} {1e3 * statistics.median(xs):8.3f} ms")
    nvml.nvmlShutdown()


if __name__ == "__main__":
    main()
