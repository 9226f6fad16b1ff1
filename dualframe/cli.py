"""The ``dualframe`` command line: subcommands dispatch to the modules that own them."""
from __future__ import annotations

import argparse
from typing import List, Optional


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand."""
    parser = argparse.ArgumentParser(prog="dualframe", description="Data, model and pipeline parallelism for torch and Keras 3.")
    sub = parser.add_subparsers(dest="command", required=True)
    doctor = sub.add_parser("doctor", help="check the installation, the Horovod build and the launcher environment")
    doctor.add_argument("--json", action="store_true", help="print the report as JSON")
    doctor.add_argument("--require", action="append", default=[], choices=("torch", "tensorflow"),
                        help="fail unless this framework works with Horovod (repeatable)")
    where = doctor.add_mutually_exclusive_group()
    where.add_argument("-H", "--hosts", default=None, help="also ask these hosts (node1:4,node2:4) for their interfaces")
    where.add_argument("--hostfile", default=None, help="the same from a file of 'host slots=N' lines")
    doctor.add_argument("--launcher", choices=("horovodrun", "mpirun"), default="horovodrun",
                        help="whose remote agent reaches the hosts: horovodrun's ssh or Open MPI's plm_rsh_agent")
    doctor.add_argument("--launcher-arg", dest="launcher_args", action="append", default=[],
                        help="the launcher arguments dualframe run gets, e.g. --launcher-arg=--ssh-port=2222 (repeatable)")
    from dualframe.observe.charts import add_arguments as add_timeline_arguments
    from dualframe.plan.cli import add_arguments as add_plan_arguments
    from dualframe.launch.run import add_arguments as add_run_arguments

    add_plan_arguments(sub.add_parser("plan", help="estimate memory per device and recommend a strategy for a model"))
    add_run_arguments(sub.add_parser("run", help="start a script on N processes with horovodrun, mpirun or srun"))
    add_timeline_arguments(sub.add_parser("timeline", help="draw a pipeline trace, a Horovod timeline or scaling results as PNG"))
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of the ``dualframe`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "doctor":
        from dualframe.launch import doctor
        from dualframe.launch.run import LaunchError, parse_hosts

        try:
            hosts = [host for host, _ in parse_hosts(args.hosts, args.hostfile)]
        except LaunchError as error:
            parser.error(str(error))
        return doctor.main(as_json=args.json, required=args.require, hosts=hosts, launcher=args.launcher,
                           launcher_args=args.launcher_args)
    if args.command == "plan":
        from dualframe.plan.cli import main as plan_main

        return plan_main(args)
    if args.command == "run":
        from dualframe.launch.run import main_from_args

        return main_from_args(args)
    if args.command == "timeline":
        from dualframe.observe.charts import main as timeline_main

        return timeline_main(args)
    raise AssertionError(f"unhandled command {args.command}")


if __name__ == "__main__":
    raise SystemExit(main())
