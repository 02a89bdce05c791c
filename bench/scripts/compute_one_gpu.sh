# 375M at batch 1 on one GPU, no communication: where the captured step's
# kernel time and idle time go, against plain torch.compile with the same
# step captured (compile_graph), then fxshard_graph under Inductor options
# that change its kernels (KNOBS="" skips those). OUT: where logs, JSON and
# gzipped Chrome traces of the profiled steps go.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-$PWD}
OUT=${OUT:-bench-out}; mkdir -p $OUT
MODEL=${MODEL:-375m}
SYSTEMS=${SYSTEMS:-compile_graph,fxshard_graph,fxshard_graph_none}
show() { grep -v Warning $1 | grep "^| \|by kind\|profile per\|by transition\|host time\|Error\|failed" | grep -v "^| model\|^|---" ; }
BENCH_TRACE_DIR=${TRACE:+$OUT} timeout 400 python bench/bench.py --model $MODEL --batch 1 --nproc-per-node 1 \
  --systems $SYSTEMS --profile 3 --out $OUT/compute-$MODEL.json > $OUT/compute-$MODEL.log 2>&1
gzip -f $OUT/trace-*.json 2>/dev/null
echo "== $SYSTEMS"; show $OUT/compute-$MODEL.log
for knob in ${KNOBS-combo_kernels=1}; do
  FXSHARD_INDUCTOR_CONFIG=$knob timeout 200 python bench/bench.py --model $MODEL --batch 1 --nproc-per-node 1 \
    --systems fxshard_graph --profile 3 --out $OUT/knob-$knob.json > $OUT/knob-$knob.log 2>&1
  echo "== fxshard_graph, FXSHARD_INDUCTOR_CONFIG=$knob"; show $OUT/knob-$knob.log
done
