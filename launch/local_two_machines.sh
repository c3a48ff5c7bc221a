#!/usr/bin/env bash
# An AFD deployment as it runs on separate machines, here on one host: one attention "machine"
# (2 attention ranks + the HTTP server, which hosts the rendezvous) and two F "machines" of two
# FFN ranks each. Start order does not matter. Ctrl-C stops everything.
#   usage: launch/local_two_machines.sh [MODEL_PATH]   (default: the embedded tiny model)
set -euo pipefail
MODEL=${1:+--model-path $1}
RDV=127.0.0.1:${RDV_PORT:-29500}
TOPO="--mode afd --dp-size 2 --ffn-nodes 2 --ffn-ranks-per-node 2 --micro-batches 3 --dispatch two-stage"
trap 'kill $(jobs -p) 2>/dev/null; wait' EXIT
afd launch --role ffn --node-rank 0 --dist-init-addr "$RDV" $TOPO $MODEL &
afd launch --role ffn --node-rank 1 --dist-init-addr "$RDV" $TOPO $MODEL &
afd launch --role attention --dist-init-addr "$RDV" --port "${PORT:-30000}" $TOPO $MODEL
