#!/usr/bin/env bash
# The agent against real NVML in one short run, for docs/hardware.md: one snapshot with the probe's debug
# log, then the agent serving and recording while the GPUs sit idle, then work (a matmul loop in PyTorch
# on every GPU, where PyTorch sees CUDA), then idle again; its /metrics idle and under load, nvidia-smi's
# view at the same moments, replay over the recorded trace, and a per-reading report. Nothing on the GPU
# is configured: no clocks, power limits or modes are touched. Then what the agent costs: its CPU beside
# nvitop-exporter's and a forked nvidia-smi query's on the same GPUs (bench/hardware_cost.py), whether it
# holds 0.5 % of a core at 1 Hz, and where its CPU goes, per NVML call (bench/hardware_nvmlprof.py) and per
# field id of its field-value batch (bench/hardware_fieldprof.py). About 5 minutes in all.
#
# On a lent device machine (Python 3.12, nvidia-ml-py and numpy there; orjson, bcrypt, msgspec, nvitop,
# nvitop-exporter and psutil not):
#   make hardware-wheels                     # here, once: cp312 wheels into .whl (ignored by git)
#   device run, carry [".whl"], timeout_s 420:  bash bench/hardware_check.sh
# Here, on the simulator, to check the script itself (short phases):
#   GPUFLEET_HW_SIMULATE=hgx-h100 OUT=/tmp/hw PYTHON=.venv/bin/python IDLE_SECONDS=3 LOAD_SECONDS=3 \
#       COST_WINDOW_S=15 CYCLES=3 bash bench/hardware_check.sh
#
# Results (8 files at most, what the device tool brings back): nvidia-smi.txt, snapshot.json, agent.log,
# metrics-idle.txt, metrics-load.txt, trace.jsonl.gz, report.txt (replay and the budget verdict included),
# cost.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:?set OUT to the folder for the results}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
IDLE_SECONDS=${IDLE_SECONDS:-15}
LOAD_SECONDS=${LOAD_SECONDS:-45}
PORT=${PORT:-19471}
WORK=$(mktemp -d)
export PYTHONUNBUFFERED=1

# The project as it installs (core/ as gpufleet, agent/ as gpufleet.agent, server/ as gpufleet.server),
# without building it: links in a package folder of its own. bench/ imports from the root.
mkdir -p "$WORK/pkg/gpufleet"
for f in "$PWD"/core/*; do ln -s "$f" "$WORK/pkg/gpufleet/"; done
ln -s "$PWD/agent" "$WORK/pkg/gpufleet/agent"
ln -s "$PWD/server" "$WORK/pkg/gpufleet/server"
if [ -d .whl ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" .whl/*.whl \
        || { echo "cannot install the carried wheels"; exit 1; }
    export PYTHONPATH="$WORK/pkg:$WORK/site:$PWD"
else
    export PYTHONPATH="$WORK/pkg:$PWD"
fi
SIMULATE=()
if [ -n "${GPUFLEET_HW_SIMULATE:-}" ]; then SIMULATE=(--simulate "$GPUFLEET_HW_SIMULATE"); fi

smi() {   # what nvidia-smi says of every GPU right now, one CSV line each
    command -v nvidia-smi >/dev/null || return 0
    nvidia-smi --query-gpu=index,name,utilization.gpu,power.draw,power.limit,clocks.sm,clocks.max.sm,temperature.gpu,temperature.memory,clocks_event_reasons.active,memory.used --format=csv
}
fetch() { "$PY" -c 'import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())' "$1"; }

{
    echo "# $(date -u +%FT%TZ) $(uname -a)"
    if command -v nvidia-smi >/dev/null; then nvidia-smi; nvidia-smi -q; echo "# idle"; smi; else echo "no nvidia-smi"; fi
} > "$OUT/nvidia-smi.txt" 2>&1

echo "== one snapshot (--once), probe at debug level"
{ echo "# --once"; } > "$OUT/agent.log"
"$PY" -m gpufleet.agent.cli --once --log.level debug --log.format json "${SIMULATE[@]}" > "$OUT/snapshot.json" 2>> "$OUT/agent.log"
echo "--once exit $?"

echo "== agent serving on 127.0.0.1:$PORT, recording"
echo "# serving" >> "$OUT/agent.log"
"$PY" -m gpufleet.agent.cli --web.listen-address "127.0.0.1:$PORT" --record "$WORK/trace.jsonl" --log.level debug \
    --log.format json "${SIMULATE[@]}" 2>> "$OUT/agent.log" &
AGENT=$!
sleep "$IDLE_SECONDS"
fetch "http://127.0.0.1:$PORT/metrics" > "$OUT/metrics-idle.txt" || echo "no /metrics while idle"

echo "== load for ${LOAD_SECONDS}s"
# As torchrun would tell a rank where its job meets: the agent should name the load's job by it
# (--hpc-job-rendezvous), "<node>/localhost:29555" (in a pod, "<namespace>/<pod>/localhost:29555"),
# through NVML's compute processes and their environ.
MASTER_ADDR=localhost MASTER_PORT=29555 "$PY" - "$LOAD_SECONDS" <<'EOF' &
import sys, threading, time
try:
    import torch
except ImportError:
    sys.exit("no torch: no load")
if not torch.cuda.is_available():
    sys.exit("torch sees no GPU: no load")
seconds = float(sys.argv[1])

def burn(device: int) -> None:
    a = torch.randn(8192, 8192, device=f"cuda:{device}", dtype=torch.bfloat16)
    end = time.time() + seconds
    while time.time() < end:
        for _ in range(20):
            a = (a @ a).clamp_(-1, 1)
        torch.cuda.synchronize(device)

threads = [threading.Thread(target=burn, args=(d,)) for d in range(torch.cuda.device_count())]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(f"load ran on {len(threads)} GPU(s)")
EOF
LOAD=$!
sleep $((LOAD_SECONDS * 2 / 3))
fetch "http://127.0.0.1:$PORT/metrics" > "$OUT/metrics-load.txt" || echo "no /metrics under load"
{ echo "# under load"; smi; } >> "$OUT/nvidia-smi.txt" 2>&1
wait "$LOAD"
sleep "$IDLE_SECONDS"
{ echo "# idle after load"; smi; } >> "$OUT/nvidia-smi.txt" 2>&1

echo "== SIGTERM"
kill -TERM "$AGENT"
wait "$AGENT"
echo "agent exit $? after SIGTERM"

echo "== replay over the recorded trace"
"$PY" -m gpufleet.server.cli replay "$WORK/trace.jsonl" --log.level info > "$WORK/replay.txt" 2>&1
echo "replay exit $?"
"$PY" -m bench.hardware_report "$WORK/trace.jsonl" "$OUT/snapshot.json" "$OUT/metrics-load.txt" > "$OUT/report.txt" 2>&1
echo "report exit $?"
{ echo; echo "replay over the recorded trace:"; cat "$WORK/replay.txt"; } >> "$OUT/report.txt"
gzip -c "$WORK/trace.jsonl" > "$OUT/trace.jsonl.gz"

echo "== cost: gpufleet-agent, nvitop-exporter, nvidia-smi (each alone), then the per-call profile"
# The cost scripts take SIM=SCENARIO for the simulator.
{
    export SIM="${GPUFLEET_HW_SIMULATE:-}"
    echo "# bench/hardware_cost.py"
    "$PY" -m bench.hardware_cost
    echo "# bench/hardware_nvmlprof.py"
    CYCLES=${CYCLES:-30} "$PY" -m bench.hardware_nvmlprof
    echo "# bench/hardware_fieldprof.py"
    "$PY" -m bench.hardware_fieldprof
} > "$OUT/cost.txt" 2>&1
{ echo; grep -h '^budget:' "$OUT/cost.txt" || echo "budget: not measured (see cost.txt)"; } >> "$OUT/report.txt"
cat "$OUT/report.txt"
cat "$OUT/cost.txt"
rm -rf "$WORK"
