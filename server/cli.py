"""`gpufleet-server` entry point: `serve` (default), `demo`, `replay TRACE...`, `check-config`, `status`."""

from __future__ import annotations

import os
import sys

PROG = "gpufleet-server"
# name -> one line for `gpufleet-server --help`; each subcommand's own --help gives its flags.
COMMANDS = {
    "serve": "pull the agents, detect stragglers and throttling, serve /alerts, /jobs and /metrics (the default)",
    "demo": "a simulated 4-node cluster with incidents on a timetable, and the server watching it",
    "replay": "run the detection engine offline over recorded snapshot files or a database's history, one JSON line per alert",
    "check-config": "check serve's settings and files without starting, as promtool check config does",
    "status": "what a running server sees now (jobs, culprits, firing alerts), for a terminal",
}


def usage() -> str:
    """The top-level help: the subcommands with one line each."""
    width = max(map(len, COMMANDS)) + 2
    lines = [
        f"usage: {PROG} [COMMAND] [FLAGS...]",
        "",
        "Live monitor for GPU training clusters: names the GPU that drags a job, and why.",
        "",
        "commands:",
    ]
    lines += [f"  {name:{width}}{text}" for name, text in COMMANDS.items()]
    lines += [
        "",
        f"`{PROG} COMMAND --help` shows a command's own flags. Without a command, the flags are serve's:",
        f"`{PROG} --targets a:9471,b:9471` is `{PROG} serve --targets a:9471,b:9471`.",
        f"`{PROG} --version` prints the version.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Dispatch to the subcommand's own main; each parses its own flags."""
    try:
        return _dispatch(argv)
    except KeyboardInterrupt:  # Ctrl-C before a subcommand handles it itself (an import, say): no traceback
        return 130


def _dispatch(argv: list[str] | None) -> int:
    """The subcommand named first (serve by default) on the rest of the arguments."""
    from gpufleet.extras import SERVER_MODULES, missing_extra

    missing = missing_extra("server", SERVER_MODULES)
    if missing:
        # Every subcommand, even --help, belongs to the server extra; one line instead of a traceback.
        print(f"{PROG}: error: {missing}", file=sys.stderr)
        return 2
    from gpufleet.server.allocator import tune_malloc

    tune_malloc()  # every subcommand runs the engine's numpy ticks
    args = sys.argv[1:] if argv is None else list(argv)
    if args[:1] == ["--version"]:
        from gpufleet.server import __version__

        print(f"{PROG} {__version__}")
        return 0
    if args[:1] in (["-h"], ["--help"], ["help"]):
        sys.stdout.write(usage())
        return 0
    command = args[0] if args and not args[0].startswith("-") else "serve"
    rest = args[1:] if args and args[0] == command else args
    if command == "replay":
        # Set before numpy loads OpenBLAS: the engine's matrix products are a tick's few dozen values
        # long, and the thread per core that OpenBLAS starts would only cost replay CPU time.
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
        from gpufleet.server.replay import main as run
    elif command == "demo":
        from gpufleet.server.demo import main as run
    elif command == "serve":
        from gpufleet.server.serve import main as run
    elif command == "check-config":
        from gpufleet.server.serve import check_config as run
    elif command == "status":
        from gpufleet.server.status import main as run
    else:
        print(
            f"{PROG}: unknown command {command!r} (commands: {', '.join(COMMANDS)}; see {PROG} --help)", file=sys.stderr
        )
        return 2
    try:
        return run(rest)
    except SystemExit as exc:  # a subcommand's --help prints through argparse and exits
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)


if __name__ == "__main__":
    sys.exit(main())
