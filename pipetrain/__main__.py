"""The `pipetrain` command's first frame (also `python -m pipetrain`): where the command line says a
local CPU run, the server its ranks fork from starts before anything else is imported, so that its
imports (torch's ~2 s) overlap all of the command's own work (launch/forkserver.py: prestart_early);
then the command itself (cli.py)."""

import sys


def main() -> None:
    from pipetrain.launch.forkserver import prestart_early

    prestart_early(sys.argv[1:])
    from pipetrain.cli import main as command

    command()


if __name__ == "__main__":
    main()
