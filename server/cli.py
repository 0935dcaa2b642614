"""`gpufleet-server` entry point: `serve` (default), `replay TRACE...`, `demo`, `check-config`, `status`."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """Dispatch to the subcommand's own main; each parses its own flags."""
    from gpufleet.server.allocator import tune_malloc

    tune_malloc()           # every subcommand runs the engine's numpy ticks
    args = sys.argv[1:] if argv is None else list(argv)
    if args[:1] == ["--version"]:
        from gpufleet.server import __version__

        print(f"gpufleet-server {__version__}")
        return 0
    command = args[0] if args and not args[0].startswith("-") else "serve"
    rest = args[1:] if args and args[0] == command else args
    if command == "replay":
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
        print(f"gpufleet-server: unknown command {command!r} (use serve, replay, demo, check-config or status)",
              file=sys.stderr)
        return 2
    return run(rest)


if __name__ == "__main__":
    sys.exit(main())
