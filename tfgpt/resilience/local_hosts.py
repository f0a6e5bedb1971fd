"""This machine under several names, for elastic horovodrun on one host.

Horovod's elastic driver treats a host name as one machine: when a worker
fails it blacklists the worker's host, every slot of it, so a job whose
workers all run under one name (`localhost:2`) loses all of them with
one, and without `--network-interface` it waits for a second host to
compare network interfaces with (ten minutes, then fails). Listed under
one name per worker, each with one slot, a failed worker takes only its
own name out, and the driver starts every worker here without ssh as long
as each name resolves to an address of this machine's interfaces.

`deploy/local/discover_hosts.sh` runs this as horovodrun's discovery
script; with `--network-interface lo` elastic training then runs on one
machine:

    .venv/bin/horovodrun -np 2 --min-np 1 --max-np 2 --network-interface lo \\
        --host-discovery-script deploy/local/discover_hosts.sh .venv/bin/python \\
        train_hvd.py --elastic ...

`python -m tfgpt.resilience.local_hosts [COUNT]` prints the first COUNT
names (`TFGPT_LOCAL_WORKERS`, default: all of them) as `name:1` lines.
"""

import os
import socket
import sys

import psutil


def local_names():
    """The names of this machine that resolve to one of its IPv4 addresses:
    localhost, 127.0.0.1, its host name and each interface address."""
    addresses = {address.address for entries in psutil.net_if_addrs().values()
                 for address in entries if address.family == socket.AF_INET}
    names = []
    for name in ["localhost", "127.0.0.1", socket.gethostname(), socket.getfqdn(),
                 *sorted(addresses)]:
        try:
            resolved = socket.gethostbyname(name)
        except OSError:
            continue
        if resolved in addresses and name not in names:
            names.append(name)
    return names


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    count = argv[0] if argv else os.environ.get("TFGPT_LOCAL_WORKERS", "0")
    try:
        count = int(count)
    except ValueError:
        count = -1
    names = local_names()
    if count < 0 or count > len(names):
        print(f"error: COUNT must be 0 (all) to {len(names)}, the names this machine has "
              f"({', '.join(names)}). Received: {count}", file=sys.stderr)
        return 2
    for name in names[:count or None]:
        print(f"{name}:1")
    return 0


if __name__ == "__main__":
    sys.exit(main())
