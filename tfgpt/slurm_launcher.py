"""One Horovod rank per Slurm task, with no SSH and no MPI.

`horovodrun --gloo` starts every rank itself (over SSH on other hosts) and
runs the HTTP rendezvous server the ranks' Gloo contexts meet at. Under
Slurm, `srun` already starts one task per rank on the right node, so each
task runs this module instead: it works out its rank's place in the job
the way horovodrun does (`horovod.runner.common.util.hosts.
get_host_assignments` over `--hosts`), sets the environment horovodrun
would set for that rank (`HOROVOD_RANK`, `HOROVOD_SIZE`, the local and
cross ranks, `HOROVOD_HOSTNAME`, the rendezvous address, Gloo as the
controller), and runs the command. The task of rank 0 also runs Horovod's
rendezvous server (`horovod.runner.http.http_server`) on `--port` of the
first host until its own command ends.

    srun python -m tfgpt.slurm_launcher --hosts node1:4,node2:4 \\
        --port 29400 -- python train_hvd.py --data /shared/data --out /shared/runs/gpt

deploy/slurm/train.sbatch builds `--hosts` from `scontrol show hostnames`
and runs this inside the image with Apptainer. The rank is `SLURM_PROCID`
unless `--rank` is given; where Slurm says how many tasks it started and
on which node (`SLURM_NTASKS`, `SLURMD_NODENAME`), they are checked
against `--hosts` before anything starts.
"""

import argparse
import os
import signal
import subprocess
import sys
import threading

# Horovod's launcher pieces are plain Python: importing them starts no
# TensorFlow and needs no Horovod build.
from horovod.runner.common.util.hosts import (
    get_host_assignments,
    parse_hosts,
    parse_hosts_and_slots,
)
from horovod.runner.gloo_run import create_run_env_vars, create_slot_env_vars
from horovod.runner.http.http_server import RendezvousHandler, RendezvousHTTPServer

from tfgpt.cli import HelpFormatter


def rank_plan(hosts):
    """Every rank's `SlotInfo` (host, rank, local and cross rank, sizes), as horovodrun assigns them.

    Args:
        hosts: str. `host:slots,host:slots,...`, the form of `horovodrun -H`.

    Ranks fill the first host's slots, then the next host's: Slurm's
    default (block) task distribution.
    """
    try:
        _, slots = parse_hosts_and_slots(hosts)
    except ValueError:
        raise ValueError(
            f"`--hosts` must be `host:slots,host:slots,...`. Received: hosts={hosts!r}"
        ) from None
    if len(slots) != len(hosts.split(",")) or min(slots.values()) < 1:
        raise ValueError(
            "`--hosts` must name each host once, with at least 1 slot. "
            f"Received: hosts={hosts!r}"
        )
    return get_host_assignments(parse_hosts(hosts), sum(slots.values()))


def rank_environment(plan, rank, port, network_interface=""):
    """The environment horovodrun gives rank `rank` of `plan`, with the rendezvous on `port`.

    Args:
        plan: list of SlotInfo. `rank_plan(...)`.
        rank: int. This process's rank.
        port: int. Port of the rendezvous server, on the host of rank 0.
        network_interface: str. Interface Gloo (and NCCL) use between
            hosts; empty lets Gloo use the address the host name resolves to.
    """
    environment = create_run_env_vars(plan[0].hostname, [network_interface], port)
    if not network_interface:
        del environment["HOROVOD_GLOO_IFACE"], environment["NCCL_SOCKET_IFNAME"]
    environment.update(create_slot_env_vars(plan[rank]))
    # As horovodrun does, so that every rank's log lines arrive as written.
    environment["PYTHONUNBUFFERED"] = "1"
    return {name: str(value) for name, value in environment.items()}


def start_rendezvous(plan, port):
    """Horovod's rendezvous server for `plan` on `port` of every interface, serving in a thread.

    Args:
        plan: list of SlotInfo. `rank_plan(...)`: the server learns each
            scope's size (global, per host, per local rank) from it.
        port: int. The port every rank was told.

    `RendezvousServer.start()`, the way horovodrun starts it, binds a random
    port only its own children are told; here the tasks of the other ranks
    were started by Slurm and know the port from the batch script, so the
    same server class is bound to that port.
    """
    server = RendezvousHTTPServer(("", port), RendezvousHandler, 0)
    server.init(plan)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _check_against_slurm(plan, rank, environ):
    """Raises ValueError if Slurm's task count or placement contradicts `plan`."""
    tasks = environ.get("SLURM_NTASKS")
    if tasks is not None and int(tasks) != len(plan):
        raise ValueError(
            f"`--hosts` has {len(plan)} slots but Slurm started {tasks} tasks "
            f"(SLURM_NTASKS): give each host --ntasks-per-node slots"
        )
    node = environ.get("SLURMD_NODENAME")
    if node is not None and node != plan[rank].hostname:
        raise ValueError(
            f"rank {rank} belongs on {plan[rank].hostname} by `--hosts` but Slurm "
            f"started it on {node} (SLURMD_NODENAME): run srun with --distribution=block "
            "and list the hosts in `scontrol show hostnames` order"
        )


def _parser():
    parser = argparse.ArgumentParser(
        prog="python -m tfgpt.slurm_launcher",
        usage="%(prog)s --hosts HOST:SLOTS,... --port PORT [--rank R] -- COMMAND ...",
        description=__doc__,
        formatter_class=HelpFormatter,
    )
    parser.add_argument(
        "--hosts", required=True, metavar="HOST:SLOTS,...",
        help="Every host of the job with its number of ranks, in rank order "
        "(`horovodrun -H` form); rank 0's host runs the rendezvous server.",
    )
    parser.add_argument(
        "--port", required=True, type=int, metavar="PORT",
        help="Port of the rendezvous server on the first host; free on it.",
    )
    parser.add_argument(
        "--rank", type=int, metavar="R",
        help="This task's rank; SLURM_PROCID when not given.",
    )
    parser.add_argument(
        "--network-interface", default="", metavar="NAME",
        help="Network interface the ranks use between hosts (HOROVOD_GLOO_IFACE, "
        "NCCL_SOCKET_IFNAME); empty: the address each host name resolves to.",
    )
    parser.add_argument(
        "command", nargs=argparse.REMAINDER, help="The rank's command, after --."
    )
    return parser


def parse_args(argv=None, environ=None):
    """`(plan, rank, args)` from `argv`; exits 2 with one `error:` line on a bad value."""
    environ = os.environ if environ is None else environ
    parser = _parser()
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command: give the rank's command after --")
    args.command = command
    try:
        plan = rank_plan(args.hosts)
        rank = args.rank
        if rank is None:
            if "SLURM_PROCID" not in environ:
                raise ValueError("`--rank` is required outside a Slurm task (no SLURM_PROCID)")
            rank = int(environ["SLURM_PROCID"])
        if not 0 <= rank < len(plan):
            raise ValueError(
                f"the rank must be in [0, {len(plan)}) for --hosts {args.hosts}. "
                f"Received: rank={rank}"
            )
        if not 0 < args.port < 65536:
            raise ValueError(f"`--port` must be in [1, 65535]. Received: port={args.port}")
        _check_against_slurm(plan, rank, environ)
    except ValueError as error:
        parser.error(str(error))
    return plan, rank, args


def main(argv=None):
    """Runs this task's rank (and, on rank 0, the rendezvous server); returns its exit status."""
    plan, rank, args = parse_args(argv)
    server = None
    if rank == 0:
        try:
            server = start_rendezvous(plan, args.port)
        except OSError as error:
            print(f"error: --port {args.port}: the rendezvous server cannot listen on it "
                  f"on {plan[0].hostname} ({error.strerror})", file=sys.stderr)
            return 2
    child = subprocess.Popen(
        args.command, env={**os.environ, **rank_environment(plan, rank, args.port,
                                                             args.network_interface)},
    )
    # scancel, a preemption and `sbatch --signal` signal every task: pass it
    # on to the rank (train_hvd.py --preemption-signal catches it).
    for signal_number in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(signal_number, lambda number, frame: child.send_signal(number))
    code = child.wait()
    if server is not None:
        server.shutdown()
        server.server_close()
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main())
