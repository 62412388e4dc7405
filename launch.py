"""Trainium fine-tuning studio: the web app, and the same jobs headless.

    python launch.py                  start the web app on http://127.0.0.1:7860
    python launch.py COMMAND ...      train, plan, runs, stop, chat, export, cache (see --help)
    python launch.py --help           every command and its options

The commands live in cli/; this file only hands them the command line.
"""

import sys

from cli.main import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
