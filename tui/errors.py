"""The exceptions the CLI turns into a single line on stderr, never a traceback."""


class MdbError(Exception):
    """Bad input or an unusable environment: shown as ``mdb: error: <message>``, exit code 2.

    Raise it with a message that names what is wrong and how to fix it; the CLI prints no
    traceback for it.
    """

    exit_code = 2


class ModelError(MdbError):
    """The user's model (or its factory) raised: one line naming the exception, the module
    being called and the user's ``file:line`` (:func:`hooks.errors.describe_error`), exit
    code 1."""

    exit_code = 1
