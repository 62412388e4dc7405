"""Runs: the run folder (folder.py), its event stream and what it adds up to (events.py), a
run as the page and the CLI see it (view.py), and the run manager (manager.py)."""
