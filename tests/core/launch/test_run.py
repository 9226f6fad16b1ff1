"""``dualframe run``: the launcher it picks and the exact command it prints, for every launcher.

Dry runs are checked against literal command lines; then the same tool really starts 2 processes with
horovodrun and with mpirun (a script that prints what the launcher told it), and srun is a fake on
PATH that records its arguments, inside fake SLURM variables.
"""
import os
import pathlib
import stat
import subprocess
import sys

import pytest

from dualframe.launch.run import LaunchError, choose_launcher, parse_hosts, plan_launch

ROOT = pathlib.Path(__file__).resolve().parents[3]
BIN = pathlib.Path(sys.executable).parent
ALL = {"horovodrun": "/opt/bin/horovodrun", "mpirun": "/usr/bin/mpirun", "srun": "/usr/bin/srun"}
THREADS_1 = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1"}


def launch(*program, available=ALL, environ=None, cores=2, **options):
    return plan_launch(program=list(program), environ=environ or {}, cores=cores, find=available.get,
                       python="/venv/bin/python", **options)


def test_horovodrun_on_this_host_uses_gloo_and_loopback():
    job = launch("train.py", "--lr", "0.1", np=2)
    assert job.command == ["/opt/bin/horovodrun", "-np", "2", "-H", "localhost:2", "--gloo",
                           "--network-interfaces", "lo", "/venv/bin/python", "train.py", "--lr", "0.1"]
    assert job.env == THREADS_1
    assert job.shell() == ("MKL_NUM_THREADS=1 OMP_NUM_THREADS=1 TF_NUM_INTEROP_THREADS=1 TF_NUM_INTRAOP_THREADS=1 "
                           "/opt/bin/horovodrun -np 2 -H localhost:2 --gloo --network-interfaces lo "
                           "/venv/bin/python train.py --lr 0.1")


def test_horovodrun_on_two_hosts_with_mpi_shares_each_nodes_cores():
    job = launch("train.py", np=8, hosts="node1:4,node2:4", gloo=False, cores=16)
    assert job.command == ["/opt/bin/horovodrun", "-np", "8", "-H", "node1:4,node2:4", "--mpi",
                           "/venv/bin/python", "train.py"]
    assert job.env["OMP_NUM_THREADS"] == "4" and job.env["TF_NUM_INTEROP_THREADS"] == "1"


def test_horovodrun_elastic_arguments_go_before_the_program(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=2\n# a comment\n")
    job = launch("train.py", np=2, hostfile=str(hostfile), launcher_args=["--min-np", "1", "--max-np", "2"])
    assert job.command == ["/opt/bin/horovodrun", "-np", "2", "--hostfile", str(hostfile), "--gloo",
                           "--network-interfaces", "lo", "--min-np", "1", "--max-np", "2", "/venv/bin/python", "train.py"]


def test_mpirun_when_horovodrun_is_missing_oversubscribes_only_past_the_cores():
    only_mpirun = {"mpirun": "/usr/bin/mpirun"}
    job = launch("train.py", np=4, available=only_mpirun, environ={"PATH": "/venv/bin:/usr/bin"}, cores=2)
    assert job.launcher == "mpirun"
    command = job.command
    assert command[0] == "/usr/bin/mpirun" and "--oversubscribe" in command
    tail = command[command.index("-np"):]
    assert tail == ["-np", "4", "--bind-to", "none", "--map-by", "slot", "-x", "OMP_NUM_THREADS", "-x",
                    "MKL_NUM_THREADS", "-x", "TF_NUM_INTRAOP_THREADS", "-x", "TF_NUM_INTEROP_THREADS", "-x", "PATH",
                    "/venv/bin/python", "train.py"]
    assert "--oversubscribe" not in launch("train.py", np=2, available=only_mpirun).command


def test_mpirun_on_hosts():
    job = launch("train.py", np=4, launcher="mpirun", hosts="a:2,b:2", cores=8)
    assert job.command[job.command.index("-np"):job.command.index("--bind-to")] == ["-np", "4", "-H", "a:2,b:2"]
    assert "--oversubscribe" not in job.command and job.env["OMP_NUM_THREADS"] == "4"


def test_srun_inside_an_allocation():
    slurm = {"SLURM_JOB_ID": "42", "SLURM_JOB_NUM_NODES": "2", "SLURM_CPUS_PER_TASK": "8"}
    job = launch("train.py", "--epochs", "3", np=8, environ=slurm)
    assert job.command == ["/usr/bin/srun", "--ntasks=8", "--cpus-per-task=8", "--ntasks-per-node=4",
                           "--kill-on-bad-exit=1", "/venv/bin/python", "train.py", "--epochs", "3"]
    assert job.env["OMP_NUM_THREADS"] == "8"


def test_outside_slurm_srun_is_not_chosen_and_a_binary_runs_as_is():
    assert choose_launcher("auto", {}, ALL.get) == "horovodrun"
    assert choose_launcher("auto", {"SLURM_JOB_ID": "1"}, ALL.get) == "srun"
    assert launch("./train", np=1).command[-1] == "./train"


def test_explicit_threads_win():
    assert launch("train.py", np=2, threads=3).env["OMP_NUM_THREADS"] == "3"


@pytest.mark.parametrize("options, message", [
    ({"np": 0}, r"-np must be an int >= 1 \(np: 0\)"),
    ({"np": 2, "threads": 0}, r"--threads must be an int >= 1 \(threads: 0\)"),
    ({"np": 2, "hosts": "a:2", "hostfile": "h"}, "give -H or --hostfile, not both"),
    ({"np": 2, "launcher": "srun", "hosts": "a:2"}, "srun takes its hosts from the SLURM allocation"),
    ({"np": 2, "launcher": "pbs"}, "unknown launcher 'pbs'; choose one of auto, horovodrun, mpirun, srun"),
    ({"np": 2, "hosts": "a:b:c"}, "cannot read host 'a:b:c'"),
])
def test_refusals_name_the_rule(options, message):
    with pytest.raises(LaunchError, match=message):
        launch("train.py", **options)


def test_no_launcher_at_all_says_how_to_get_one():
    with pytest.raises(LaunchError, match="neither horovodrun nor mpirun is on PATH; run `bash scripts/bootstrap.sh`"):
        launch("train.py", np=2, available={})
    with pytest.raises(LaunchError, match="nothing to run"):
        launch(np=2)


def test_hostfile_forms():
    assert parse_hosts(hosts="a:2,b") == [("a", 2), ("b", 1)]
    with pytest.raises(LaunchError, match="cannot read the hostfile '/no/such/file'"):
        parse_hosts(hostfile="/no/such/file")


def _dualframe(*args, env=None):
    env = dict(os.environ, PATH=f"{BIN}:{os.environ['PATH']}", PYTHONPATH=str(ROOT), **(env or {}))
    return subprocess.run([sys.executable, "-m", "dualframe", "run", *args], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=240)


SCRIPT = ("import os, sys\nfrom dualframe.launch.topology import detect\nt = detect()\n"
          "print(f'rank {t.rank} of {t.size} via {t.launcher}, OMP_NUM_THREADS={os.environ.get(\"OMP_NUM_THREADS\")}, "
          "args {sys.argv[1:]}', flush=True)\n")


@pytest.mark.parametrize("launcher", ["horovodrun", "mpirun"])
def test_really_starts_two_processes(tmp_path, launcher):
    script = tmp_path / "where.py"
    script.write_text(SCRIPT)
    result = _dualframe("-np", "2", "--launcher", launcher, str(script), "--flag", "x")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    first_line = result.stdout.splitlines()[0]
    assert f"/{launcher} " in first_line and " -np 2 " in first_line and first_line.endswith(f"{script} --flag x")
    seen = "horovodrun" if launcher == "horovodrun" else "mpirun"
    for rank in (0, 1):
        assert f"rank {rank} of 2 via {seen}, OMP_NUM_THREADS=1, args ['--flag', 'x']" in result.stdout


def test_srun_with_a_fake_srun_that_records(tmp_path):
    fake = tmp_path / "srun"
    fake.write_text(f'#!/bin/sh\necho "$OMP_NUM_THREADS $*" > {tmp_path}/srun.args\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    slurm = {"SLURM_JOB_ID": "7", "SLURM_NNODES": "1", "SLURM_CPUS_PER_TASK": "2",
             "PATH": f"{tmp_path}:{BIN}:{os.environ['PATH']}"}
    env = dict(os.environ, PYTHONPATH=str(ROOT), **slurm)
    result = subprocess.run([sys.executable, "-m", "dualframe", "run", "-np", "2", "train.py", "-v"],
                            capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    recorded = (tmp_path / "srun.args").read_text().strip()
    assert recorded == f"2 --ntasks=2 --cpus-per-task=2 --ntasks-per-node=2 --kill-on-bad-exit=1 {sys.executable} train.py -v"


def test_dry_run_prints_and_starts_nothing():
    result = _dualframe("-np", "3", "--launcher", "mpirun", "--dry-run", "no_such_script.py")
    assert result.returncode == 0
    printed = result.stdout.strip()
    assert " -np 3 --bind-to none --map-by slot -x OMP_NUM_THREADS -x MKL_NUM_THREADS -x TF_NUM_INTRAOP_THREADS " \
           "-x TF_NUM_INTEROP_THREADS -x PATH -x PYTHONPATH" in printed
    assert printed.endswith(f"{sys.executable} no_such_script.py") and len(result.stdout.splitlines()) == 1
    assert "--oversubscribe" in result.stdout and "3 processes on" in result.stderr


def test_network_interfaces_for_each_launcher():
    job = launch("train.py", np=2, hosts="a:1,b:1", network_interfaces="ib0,eth0")
    assert job.command[:8] == ["/opt/bin/horovodrun", "-np", "2", "-H", "a:1,b:1", "--gloo", "--network-interfaces",
                               "ib0,eth0"]
    job = launch("train.py", np=2, launcher="mpirun", hosts="a:1,b:1", network_interfaces="eth0")
    at = job.command.index("--mca")
    assert job.command[at:at + 6] == ["--mca", "btl_tcp_if_include", "eth0", "--mca", "oob_tcp_if_include", "eth0"]
    assert job.env["NCCL_SOCKET_IFNAME"] == "eth0" and job.command[job.command.index("NCCL_SOCKET_IFNAME") - 1] == "-x"
    job = launch("train.py", np=2, environ={"SLURM_JOB_ID": "1"}, network_interfaces="eth0")
    assert job.env["OMPI_MCA_btl_tcp_if_include"] == "eth0" and job.env["NCCL_SOCKET_IFNAME"] == "eth0"
    with pytest.raises(LaunchError, match=r"--network-interfaces takes interface names separated by commas, e.g. eth0 "
                                          r"or ib0,eth0 \(network_interfaces: '10.0.0.0/24'\)"):
        launch("train.py", np=2, network_interfaces="10.0.0.0/24")


def test_loopback_only_when_the_job_is_known_to_be_on_this_host(tmp_path):
    def elastic(*lines):
        script = tmp_path / "hosts.sh"
        script.write_text("#!/bin/sh\n" + "".join(f"echo {line}\n" for line in lines))
        script.chmod(0o755)
        return launch("train.py", np=2, launcher_args=["--min-np", "1", f"--host-discovery-script={script}"])

    remote_hosts = elastic("localhost:1", "node2:1")
    assert "--network-interfaces" not in remote_hosts.command and "-H" not in remote_hosts.command
    assert remote_hosts.notes == ["the host discovery script names other hosts (or failed): no --network-interfaces "
                                  "lo; pass --network-interfaces naming the interface between them"]
    assert remote_hosts.command[:4] == ["/opt/bin/horovodrun", "-np", "2", "--gloo"]
    assert "--network-interfaces" not in elastic().command  # prints nothing: unknown
    this_host = elastic("localhost:1", "127.0.0.1:1")
    assert this_host.command[4:6] == ["--network-interfaces", "lo"] and "names only this host now" in this_host.notes[0]
    mine = launch("train.py", np=2, launcher_args=["--network-interfaces=eth0"])
    assert mine.command.count("--network-interfaces=eth0") == 1 and "lo" not in mine.command and not mine.notes
    assert launch("train.py", np=2, network_interfaces="eth0").command[6:8] == ["--network-interfaces", "eth0"]
