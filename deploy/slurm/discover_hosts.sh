#!/bin/bash
# horovodrun --host-discovery-script for deploy/slurm/train_elastic.sbatch:
# prints, one per line, the job's nodes whose SSH server (the one the batch
# script starts in the image on every node) accepts a connection now. A node
# that failed or was taken away stops answering and leaves the job; horovodrun
# runs this every second and gives each node --slots-per-host ranks.
#
# Runs inside the image, where scontrol is not available, so the batch script
# passes the job's nodes (`scontrol show hostnames`) in TFGPT_NODES and the
# port in TFGPT_SSH_PORT.
set -u

for node in $TFGPT_NODES; do
    if timeout 2 bash -c "exec 3<>/dev/tcp/$node/$TFGPT_SSH_PORT" 2>/dev/null; then
        echo "$node"
    fi
done
