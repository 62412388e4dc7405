"""Trainium fine-tuning studio: the web app, and the same jobs headless.

    python launch.py                  start the web app on http://127.0.0.1:7860
    python launch.py COMMAND ...      train, plan, runs, stop, chat, export, cache, doctor (see --help)
    python launch.py --help           every command and its options

The commands live in cli/; this file only hands them the command line.
"""

import os
import sys

from cli.main import main
from studio_core.machine.children import skip_final_collection

if __name__ == "__main__":
    skip_final_collection()  # its exit skips the last garbage collection (the web app's heap: Gradio's)
    try:
        code = main(sys.argv[1:])
        sys.stdout.flush()
    except BrokenPipeError:  # what reads our output has gone (`launch.py runs | head`): nothing to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so exit's flush finds no pipe
        code = 1
    sys.exit(code)
