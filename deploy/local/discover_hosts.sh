#!/bin/sh
# horovodrun --host-discovery-script for elastic training on one machine:
# prints this machine under one name per worker, one slot each (localhost,
# 127.0.0.1, its host name, its interface addresses: tfgpt.resilience.local_hosts
# says why), the first $TFGPT_LOCAL_WORKERS of them (default: all). Pair it
# with --network-interface lo:
#
#   .venv/bin/horovodrun -np 2 --min-np 1 --max-np 2 --network-interface lo \
#       --host-discovery-script deploy/local/discover_hosts.sh .venv/bin/python \
#       train_hvd.py --elastic ...
repo="$(cd "$(dirname "$0")/../.." && pwd)"
python="$repo/.venv/bin/python"
[ -x "$python" ] || python=python3
PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" exec "$python" -m tfgpt.resilience.local_hosts
