"""mdb's terminal UI and command line: the Textual app, its screens, and the ``mdb`` CLI."""

__version__ = "0.1.0"
