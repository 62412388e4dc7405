"""The studio's command line: the parser and the headless commands behind launch.py."""
