"""The flags ``lab chaos`` and ``lab soak`` share, declared once with their help.

``lab.cli`` declares every other command and option and calls these for both commands.
"""

from __future__ import annotations

import argparse


def in_flight_arguments(parser: argparse.ArgumentParser) -> None:
    """The work each worker keeps in flight, shared by ``lab chaos`` and ``lab soak``."""
    parser.add_argument("--batch", type=int, default=1,
                        help="each worker's --batch: workflows claimed and in flight together, "
                             "in shared transactions")
    parser.add_argument("--concurrency", type=int, default=1,
                        help="each worker's --concurrency: workflows in flight, each in its "
                             "own transactions (an alternative to --batch)")


def release_argument(parser: argparse.ArgumentParser, default: float | None,
                      default_said: str) -> None:
    """``--release-over``, for chaos and soak alike (their defaults differ)."""
    parser.add_argument("--release-over", type=float, default=default, metavar="S",
                        help="approve a round's workflows in waves over S seconds of its "
                             "fault phase, so faults meet work in flight (default: "
                             f"{default_said})")


def database_fault_arguments(parser: argparse.ArgumentParser) -> None:
    """The disk-full and clock-step flags, shared by ``lab chaos`` and ``lab soak``."""
    parser.add_argument("--disk-full-every", type=float, default=0.0, metavar="MS",
                        help="fill the data directory's filesystem about every MS (0: never)")
    parser.add_argument("--disk-full-for", type=float, default=2000.0, metavar="MS",
                        help="how long each disk-full fault holds the filesystem full")
    parser.add_argument("--disk-full-mb", type=int, default=96, metavar="MB",
                        help="size of the filesystem the data directory is mounted on")
    parser.add_argument("--disk-full-fs", default="auto", choices=("auto", "tmpfs", "loop"),
                        help="tmpfs (RAM), loop (an ext4 image on disk), auto: tmpfs, else loop")
    parser.add_argument("--clock-step-every", type=float, default=0.0, metavar="MS",
                        help="step the server's clock about every MS (0: never)")
    parser.add_argument("--clock-step-max", type=int, default=60, metavar="S",
                        help="largest clock offset, forward or back, in seconds")


def host_arguments(parser: argparse.ArgumentParser) -> None:
    """The lab-hosts flags, shared by ``lab chaos`` and ``lab soak`` (root only); their
    defaults are ``HostFlags``'s."""
    from lab.faults import chaos_settings
    default = chaos_settings.HostFlags()
    parser.add_argument("--hosts", type=int, default=default.hosts, metavar="N",
                        help="spread the run over N lab hosts (3-16; 0: one machine): db1 and "
                             "db2 a replicated pair, tool, w1.. the workers (root)")
    parser.add_argument("--replication", default=default.replication,
                        choices=chaos_settings.REPLICATION_MODES,
                        help="with --hosts: how the standby follows the primary")
    parser.add_argument("--failover-every", type=float, default=default.failover_every, metavar="S",
                        help="with --hosts: fence the primary, promote the standby and rejoin "
                             "the old one about every S seconds (0: never)")
    parser.add_argument("--min-failovers", type=int, default=default.min_failovers, metavar="N",
                        help="the fault phase lasts until N failovers happened; fewer fails")
    parser.add_argument("--net-fault-every", type=float, default=default.net_fault_every,
                        metavar="MS",
                        help="with --hosts: one fault between hosts about every MS, the kinds "
                             "in turn: partition, one_way, delay, jitter, loss, reorder, "
                             "clock_step (0: never)")
    parser.add_argument("--net-fault-for", type=float, default=default.net_fault_for, metavar="MS",
                        help="how long each fault between hosts lasts")
    parser.add_argument("--min-net-faults", type=int, default=default.min_net_faults, metavar="N",
                        help="the fault phase lasts until each kind struck N times; fewer fails")
    parser.add_argument("--skew-max", type=int, default=default.skew_max, metavar="S",
                        help="with --hosts: worker hosts' clocks offset, and stepped, up to S "
                             "seconds either way (libfaketime; 0: true clocks, no clock_step)")
