"""Reaching the job's hosts before launch: the agent each launcher uses, ssh's answer, the shared interface.

A fake ``ssh`` (a shell script first on PATH) stands for the hosts: ``good*`` hosts answer with the
lines ``ip -o addr show`` prints, ``bad`` fails as ssh does for a host that is cut off, ``slow`` never
answers. The real hosts are in tests/cluster/test_run.py.
"""
import os
import pathlib
import subprocess
import sys
import time

import pytest

from dualframe.launch import remote, watch
from dualframe.launch.remote import Choice, HostReport, Interface

ROOT = pathlib.Path(__file__).resolve().parents[3]
FOUND = "/usr/bin/{}".format
IP_LINES = """1: lo    inet 127.0.0.1/8 scope host lo\\       valid_lft forever preferred_lft forever
1: lo    inet6 ::1/128 scope host \\       valid_lft forever preferred_lft forever
7: eth0@if9    inet 10.203.7.{n}/24 brd 10.203.7.255 scope global eth0\\       valid_lft forever
7: eth0@if9    inet6 fe80::1:{n}/64 scope link \\       valid_lft forever preferred_lft forever
"""
FAKE_SSH = """#!/bin/sh
# the host is the first word that is not an option (or an option's value)
while [ $# -gt 0 ]; do case $1 in -o|-p|-i) shift 2 ;; -*) shift ;; *) break ;; esac; done
host=$1; shift
case $host in
  good*) n=${host#good}; echo dualframe-reached; printf '%s' "$IP_LINES" | sed "s/{n}/${n:-1}/g" ;;
  slow) sleep 30 ;;
  *) echo "ssh: connect to host $host port 22: Connection timed out" >&2; exit 255 ;;
esac
"""


@pytest.fixture
def fake_ssh(tmp_path, monkeypatch):
    script = tmp_path / "ssh"
    script.write_text(FAKE_SSH)
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setenv("IP_LINES", IP_LINES)
    return script


def test_parse_addresses_of_ip_o_addr_show():
    interfaces = remote.parse_addresses(IP_LINES.format(n=2))
    assert interfaces == (Interface("lo", "127.0.0.1/8"), Interface("lo", "::1/128"), Interface("eth0", "10.203.7.2/24"),
                          Interface("eth0", "fe80::1:2/64"))
    assert [i.usable for i in interfaces] == [False, False, True, False]
    assert interfaces[2].network == "10.203.7.0/24"


def test_agents_are_the_launchers_own():
    ssh_options = ["-o", "BatchMode=yes", "-o", f"ConnectTimeout={remote.CONNECT_TIMEOUT_S}"]
    assert remote.remote_agent("mpirun", [], {}, FOUND) == ["ssh", *ssh_options]
    args = ["--mca", "plm_rsh_agent", "/opt/rsh-into", "--mca", "plm_rsh_args", "-q"]
    assert remote.remote_agent("mpirun", args, {}, FOUND) == ["/opt/rsh-into", "-q"]
    assert remote.remote_agent("mpirun", [], {"OMPI_MCA_plm_rsh_agent": "rsh"}, FOUND) == ["rsh"]
    only_rsh = {"rsh": "/usr/bin/rsh"}.get
    assert remote.remote_agent("mpirun", [], {}, only_rsh) == ["rsh"]  # Open MPI's default "ssh : rsh"
    with pytest.raises(remote.HostUnreachableError, match=r"remote agent is not on PATH \(plm_rsh_agent: 'ssh : rsh'\)"):
        remote.remote_agent("mpirun", [], {}, lambda name: None)
    assert remote.remote_agent("horovodrun", ["--ssh-port=2222", "-i", "/k"], {}, FOUND) == [
        "ssh", "-o", "PasswordAuthentication=no", "-o", "StrictHostKeyChecking=no", *ssh_options, "-i", "/k", "-p", "2222"]


def test_hosts_that_answer_and_one_that_does_not(fake_ssh):
    agent = remote.remote_agent("horovodrun", [], {}, FOUND)
    started = time.time()
    reports = remote.probe(["good1", "bad", "good2", "localhost"], agent)
    assert time.time() - started < 5
    assert [r.reachable for r in reports] == [True, False, True, True] and reports[3].local
    assert reports[0].describe() == "lo 127.0.0.1/8, lo ::1/128, eth0 10.203.7.1/24, eth0 fe80::1:1/64"
    assert reports[1].describe() == "UNREACHABLE: ssh: connect to host bad port 22: Connection timed out"
    message = remote.unreachable_message(reports, "horovodrun")
    assert message.startswith("cannot reach bad through horovodrun's remote agent (bad: ssh: connect to host bad "
                              "port 22: Connection timed out); check the host name")
    assert remote.unreachable_message(reports[:1], "mpirun") is None


def test_a_host_that_never_answers_is_named_after_the_timeout(fake_ssh):
    started = time.time()
    [report] = remote.probe(["slow"], ["ssh"], timeout_s=1)
    assert time.time() - started < 5
    assert not report.reachable and report.error == "no answer within 1 s (ssh)"


def _host(name, *addresses, local=False):
    return HostReport(name, True, interfaces=tuple(Interface(n, a) for n, a in addresses), local=local)


@pytest.mark.parametrize("reports, expected", [
    ([_host("a", ("lo", "127.0.0.1/8"), ("eth0", "10.0.0.1/24")), _host("b", ("eth0", "10.0.0.2/24"))],
     Choice(("eth0",), "10.0.0.0/24 is the one subnet every host is on (eth0)", ("10.0.0.0/24",))),
    ([_host("a", ("eth0", "10.0.0.1/24"), ("docker0", "172.17.0.1/16")), _host("b", ("ens3", "10.0.0.2/24"))],
     Choice(("ens3", "eth0"), "10.0.0.0/24 is the one subnet every host is on (ens3, eth0)", ("10.0.0.0/24",))),
    ([_host("a", ("eth0", "10.0.0.1/24")), _host("b", ("eth0", "10.0.1.2/24"))],
     Choice((), "the hosts share no subnet; pass --network-interfaces naming the interface that joins them")),
    ([_host("a", ("eth0", "10.0.0.1/24"), ("ib0", "10.1.0.1/24")), _host("b", ("eth0", "10.0.0.2/24"), ("ib0", "10.1.0.2/24"))],
     Choice((), "the hosts share 2 subnets: 10.0.0.0/24 (eth0), 10.1.0.0/24 (ib0); the launcher chooses unless you "
                "pass --network-interfaces", ("10.0.0.0/24", "10.1.0.0/24"))),
    ([_host("a", ("eth0", "10.0.0.1/24")), HostReport("b", True)],
     Choice((), "the interfaces of b are unknown; pass --network-interfaces")),
    ([_host("localhost", ("lo", "127.0.0.1/8"), local=True)], Choice(("lo",), "every host is this one", ("127.0.0.0/8",))),
])
def test_the_interface_the_hosts_share(reports, expected):
    assert remote.choose_interfaces(reports) == expected


def _dualframe(*args):
    return subprocess.run([sys.executable, "-m", "dualframe", "run", *args], capture_output=True, text=True,
                          cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=60)


@pytest.mark.parametrize("launcher", ["horovodrun", "mpirun"])
def test_run_refuses_a_host_that_cannot_be_reached_by_name(fake_ssh, launcher):
    started = time.time()
    result = _dualframe("-np", "2", "-H", "good1:1,bad:1", "--launcher", launcher, "--dry-run", "train.py")
    assert time.time() - started < 20
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith(f"dualframe run: cannot reach bad through {launcher}'s remote agent "
                                    "(bad: ssh: connect to host bad port 22: Connection timed out)"), result.stderr


def test_run_passes_the_interface_the_hosts_share(fake_ssh):
    result = _dualframe("-np", "2", "-H", "good1:1,good2:1", "--launcher", "mpirun", "--dry-run", "train.py")
    assert result.returncode == 0, result.stderr
    assert " --mca btl_tcp_if_include eth0 --mca oob_tcp_if_include eth0 " in result.stdout
    assert "-x NCCL_SOCKET_IFNAME " in result.stdout and result.stdout.startswith("MKL_NUM_THREADS=")
    assert "# --network-interfaces eth0: 10.203.7.0/24 is the one subnet every host is on (eth0)" in result.stderr
    mine = _dualframe("-np", "2", "-H", "good1:1,good2:1", "--launcher", "horovodrun", "--network-interfaces", "ib0",
                      "--dry-run", "train.py")
    assert " --gloo --network-interfaces ib0 " in mine.stdout and mine.stderr == ""
    unchecked = _dualframe("-np", "2", "-H", "good1:1,bad:1", "--no-host-check", "--launcher", "horovodrun",
                           "--dry-run", "train.py")
    assert unchecked.returncode == 0 and "--network-interfaces" not in unchecked.stdout


def test_a_daemon_that_did_not_start_is_explained(capfd):
    line = "echo 'ORTE was unable to reliably start one or more daemons.' >&2; echo out; exit 3"
    assert watch.run(["sh", "-c", line], dict(os.environ), lambda: "cannot reach dfn2") == 3
    out, err = capfd.readouterr()
    assert out == "out\n"
    assert err.endswith("ORTE was unable to reliably start one or more daemons.\n"
                        "dualframe run: Open MPI could not start or lost a daemon: cannot reach dfn2\n")
    assert watch.run(["sh", "-c", "kill -TERM $$"], dict(os.environ), lambda: "unused") == 128 + 15
    assert "dualframe run" not in capfd.readouterr().err


def test_doctor_reports_each_host_and_the_interface(fake_ssh):
    from dualframe.launch import doctor

    report = doctor.hosts_report(["good1", "good2"], "mpirun")
    assert report["choice"]["interfaces"] == ["eth0"] and report["unreachable"] is None
    lines = doctor.render_hosts(report)
    assert lines[1:] == ["  good1     lo 127.0.0.1/8, lo ::1/128, eth0 10.203.7.1/24, eth0 fe80::1:1/64",
                         "  good2     lo 127.0.0.1/8, lo ::1/128, eth0 10.203.7.2/24, eth0 fe80::1:2/64",
                         "interface   eth0: 10.203.7.0/24 is the one subnet every host is on (eth0); dualframe run "
                         "passes --network-interfaces eth0"]
    bad = doctor.hosts_report(["good1", "bad"], "horovodrun")
    assert doctor.render_hosts(bad)[2:] == [
        "  bad       UNREACHABLE: ssh: connect to host bad port 22: Connection timed out",
        "interface   none chosen: the interfaces of bad are unknown; pass --network-interfaces"]
    fake = {"torch": {"ok": True, "build": {"mpi": True, "gloo": True}}, "tensorflow": {"ok": False},
            "mpi": {"mpirun": {"ok": True}}, "hosts": bad}
    assert doctor.problems(fake, ()) == [bad["unreachable"]] and bad["unreachable"].startswith("cannot reach bad")
