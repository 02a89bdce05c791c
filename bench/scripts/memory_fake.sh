# Peak memory at world sizes no lent machine has: one GPU, a fake process group
# (bench.py --fake-world). No communication runs, so only the memory columns
# mean anything; what each system allocates is what it would at that world size.
#   RUNS="4:8b:fxshard,fsdp2_compile 8:1b:fxshard,fsdp2_compile" bash bench/scripts/memory_fake.sh
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-bench-out}; mkdir -p $OUT
for run in ${RUNS:-4:8b:fxshard,fsdp2_compile}; do
  IFS=: read ws model systems <<< "$run"
  timeout ${RUN_TIMEOUT:-240} python bench/bench.py --model $model --fake-world $ws --systems $systems --memory-step 2 \
    --out $OUT/fake$ws-$model.json >> $OUT/memory-fake.log 2>&1
  echo "== fake world $ws, $model"
  python - $OUT/fake$ws-$model.json <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["results"]:
    m = r.get("memory_at_peak", {})
    print(f"{r['system']:14} peak {r['peak_gib']:6.2f} GiB  per step {' '.join(f'{p:.2f}' for p in r['step_peaks_gib'][:4])}"
          f"  traced peak at {m.get('peak_event', '-')[:100]}")
    for b in m.get("by_file", [])[:5]:
        print(f"    {b['gib']:7.3f} GiB {b['blocks']:4d} blocks  {b['where']}")
PY
done
