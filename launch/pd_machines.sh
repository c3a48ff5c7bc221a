#!/usr/bin/env bash
# Prefill-decode disaggregation over machines: a prefill instance on machine A, an AFD decode
# instance spread over machine B (attention ranks + router) and machine C (FFN ranks), started
# apart. Run the part for this machine:
#   launch/pd_machines.sh prefill   # on A
#   launch/pd_machines.sh ffn       # on C
#   launch/pd_machines.sh decode    # on B (attention ranks of the decode instance)
#   launch/pd_machines.sh router    # on B (or anywhere): the OpenAI endpoint on :30000
# Set PREFILL_HOST / DECODE_HOST to the machines' addresses, MODEL to the checkpoint on every
# machine, and AFD_CLUSTER_SECRET to the same secret on every machine: the instances' bootstrap
# and KV sockets authenticate with it. Pages then move over the builtin backend (ZeroMQ, under
# the secret). Mooncake's transfers carry no authentication: BACKEND=mooncake (RDMA with
# IB_DEVICE set, TCP otherwise) runs only with INSECURE=1 (--insecure-cluster, a private network).
set -euo pipefail
PREFILL_HOST=${PREFILL_HOST:?address of the prefill machine}
DECODE_HOST=${DECODE_HOST:?address of the decode attention machine}
MODEL=${MODEL:+--model-path $MODEL}
BACKEND=${BACKEND:-builtin}
IB=${IB_DEVICE:+--disaggregation-ib-device $IB_DEVICE}
if [ "${INSECURE:-0}" = 1 ]; then
  SECURITY="--insecure-cluster"
else
  : "${AFD_CLUSTER_SECRET:?export AFD_CLUSTER_SECRET (the same on every machine), or INSECURE=1 on a private network}"
  SECURITY=""
fi
PD="--disaggregation-transfer-backend $BACKEND $IB $SECURITY"
DECODE_TOPO="--mode afd --dp-size 2 --ffn-nodes 1 --ffn-ranks-per-node 4 --micro-batches 3"
case "${1:?prefill | decode | ffn | router}" in
  prefill)
    afd serve --host 0.0.0.0 --port 30001 $MODEL --mode colocated --dp-size 2 \
      --disaggregation-mode prefill --disaggregation-bootstrap-port 8998 \
      --disaggregation-host "$PREFILL_HOST" $PD ;;
  decode)
    afd launch --role attention --dist-init-addr "$DECODE_HOST:29500" --host 0.0.0.0 --port 30002 $MODEL \
      $DECODE_TOPO --disaggregation-mode decode --disaggregation-host "$DECODE_HOST" $PD ;;
  ffn)
    afd launch --role ffn --node-rank 0 --dist-init-addr "$DECODE_HOST:29500" $MODEL $DECODE_TOPO \
      --disaggregation-mode decode $PD ;;
  router)
    afd router --host 0.0.0.0 --port 30000 --prefill "http://$PREFILL_HOST:30001" --decode "http://$DECODE_HOST:30002" ;;
esac
