"""The one exception type the CLI turns into a single line on stderr and exit code 2."""


class MdbError(Exception):
    """Bad input or an unusable environment: shown as ``mdb: error: <message>``, exit code 2.

    Raise it with a message that names what is wrong and how to fix it; the CLI prints no
    traceback for it.
    """
